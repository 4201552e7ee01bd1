"""The on-device sampler on a tiny vocabulary: supports of top-k/top-p/min-p, distribution, seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer.engine.sampler import MAX_BANNED, SamplingInputs, distribution, sample

LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))


def draw(n: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logits=LOGITS, seed=0, banned=()) -> np.ndarray:
    """n samples of one row, each with its own step (as successive tokens of one request would)."""
    params = SamplingInputs(
        temperature=jnp.full(n, temperature, jnp.float32),
        top_k=jnp.full(n, top_k, jnp.int32),
        top_p=jnp.full(n, top_p, jnp.float32),
        min_p=jnp.full(n, min_p, jnp.float32),
        seed=jnp.full(n, seed, jnp.uint32),
        step=jnp.arange(n, dtype=jnp.int32),
        banned=jnp.tile(jnp.asarray(banned_row(banned), jnp.int32), (n, 1)),
    )
    tokens, _ = jax.jit(sample)(jnp.tile(jnp.asarray(logits), (n, 1)), params)
    return np.asarray(tokens)


def banned_row(ids: tuple[int, ...]) -> list[int]:
    """One row of `SamplingInputs.banned`: the ids, then -1 up to MAX_BANNED."""
    return list(ids) + [-1] * (MAX_BANNED - len(ids))


def test_temperature_one_matches_the_softmax_distribution():
    counts = np.bincount(draw(20000), minlength=6)
    p = np.exp(LOGITS.astype(np.float64))
    expected = p / p.sum() * counts.sum()
    assert stats.chisquare(counts, expected).pvalue > 0.01


def test_temperature_sharpens_and_flattens():
    cold = np.bincount(draw(4000, temperature=0.3), minlength=6) / 4000
    hot = np.bincount(draw(4000, temperature=3.0), minlength=6) / 4000
    assert cold[0] > 0.7 and hot[0] < 0.3


@pytest.mark.parametrize(
    ("kwargs", "support"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.6}, {0, 1}),  # 0.4 < 0.6, then 0.4 + 0.25 reaches it
        ({"top_p": 0.3}, {0}),
        ({"min_p": 0.3}, {0, 1, 2}),  # p >= 0.3 * 0.4
        ({"top_k": 4, "top_p": 0.9, "min_p": 0.2}, {0, 1, 2, 3}),
    ],
)
def test_filters_restrict_the_support(kwargs, support):
    tokens = set(draw(3000, **kwargs).tolist())
    assert tokens == support


def test_top_k_renormalizes_within_the_kept_set():
    counts = np.bincount(draw(20000, top_k=3), minlength=6)
    assert counts[3:].sum() == 0
    counts = counts[:3]
    p = np.exp(LOGITS[:3].astype(np.float64)) / np.exp(LOGITS[:3].astype(np.float64)).sum()
    assert stats.chisquare(counts, p * counts.sum()).pvalue > 0.01


def test_same_seed_same_tokens_other_seed_other_tokens():
    assert (draw(200, seed=11) == draw(200, seed=11)).all()
    assert (draw(200, seed=11) != draw(200, seed=12)).any()


def test_greedy_rows_next_to_sampled_rows_and_logprobs():
    logits = jnp.asarray(np.stack([LOGITS, LOGITS[::-1]]))
    params = SamplingInputs(
        temperature=jnp.array([0.0, 1.0]),
        top_k=jnp.array([0, 1]),
        top_p=jnp.ones(2),
        min_p=jnp.zeros(2),
        seed=jnp.array([1, 2], jnp.uint32),
        step=jnp.zeros(2, jnp.int32),
        banned=jnp.full((2, MAX_BANNED), -1, jnp.int32),
    )
    tokens, logprobs = sample(logits, params)
    assert tokens.tolist() == [0, 5]
    np.testing.assert_allclose(np.asarray(logprobs), [np.log(0.4), np.log(0.4)], rtol=1e-5)


def test_top_p_applies_to_what_top_k_kept_renormalized():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.05, 0.05], np.float32))
    # After top-k=2 the kept mass is 0.4/0.7 = 0.57 for token 0, which already reaches top_p=0.5.
    assert set(draw(2000, top_k=2, top_p=0.5, logits=logits).tolist()) == {0}


def test_banned_ids_are_never_drawn_greedy_or_sampled():
    assert set(draw(2000, banned=(0, 2)).tolist()) <= {1, 3, 4, 5}
    assert set(draw(50, temperature=0.0, banned=(0,)).tolist()) == {1}


def test_a_row_without_filters_draws_the_same_whatever_its_neighbours_filter():
    """Unfiltered rows skip the kept-set searches unless another sampled row filters; either way a
    row's token and distribution (bit for bit) depend only on its logits, settings, seed and step."""
    rows, vocab = 64, 1000
    logits = jax.random.normal(jax.random.key(3), (rows, vocab)) * 3

    def params(top_p_of_row_0: float) -> SamplingInputs:
        return SamplingInputs(temperature=jnp.full(rows, 0.8), top_k=jnp.zeros(rows, jnp.int32),
                              top_p=jnp.ones(rows).at[0].set(top_p_of_row_0), min_p=jnp.zeros(rows),
                              seed=jnp.arange(rows, dtype=jnp.uint32), step=jnp.full(rows, 5, jnp.int32),
                              banned=jnp.full((rows, MAX_BANNED), -1, jnp.int32))

    # the distributions speculative decoding verifies against agree the same way
    np.testing.assert_array_equal(np.asarray(distribution(logits, params(1.0)))[1:],
                                  np.asarray(distribution(logits, params(0.5)))[1:])
    alone, _ = jax.jit(sample)(logits, params(1.0))
    beside_a_filter, _ = jax.jit(sample)(logits, params(0.5))
    np.testing.assert_array_equal(np.asarray(alone)[1:], np.asarray(beside_a_filter)[1:])
    assert len(set(np.asarray(alone).tolist())) > rows // 2, "rows drew different tokens"


def hf_kept_sets(logits: np.ndarray, temperature: float, settings: list[dict]) -> np.ndarray:
    """transformers' warpers (temperature, top-k, min-p, then top-p), one row at a time: [S, V] kept mask.
    Banned ids are set to -inf first."""
    import torch
    from transformers.generation import logits_process as lp

    kept = []
    for row, setting in zip(logits, settings, strict=True):
        warpers = [lp.TemperatureLogitsWarper(temperature)]
        if setting["top_k"]:
            warpers.append(lp.TopKLogitsWarper(setting["top_k"]))
        if setting["min_p"]:
            warpers.append(lp.MinPLogitsWarper(setting["min_p"]))
        if setting["top_p"] < 1.0:
            warpers.append(lp.TopPLogitsWarper(setting["top_p"]))
        scores = torch.from_numpy(row[None].copy())
        scores[0, list(setting.get("banned", []))] = -torch.inf
        for warper in warpers:
            scores = warper(None, scores)
        kept.append(torch.isfinite(scores)[0].numpy())
    return np.stack(kept)


def unambiguous_top_p(row: np.ndarray, temperature: float, top_k: int, min_p: float, rank: int,
                      banned: tuple[int, ...] = ()) -> float:
    """A top_p halfway between the renormalized masses of the `rank` and `rank + 1` most likely kept
    tokens, so that float32 rounding of a pairwise or tree sum (XLA's, torch's) cannot move the nucleus
    boundary. (At rank 3,000 the margin is about 8e-6: a one-accumulator float32 sum over 128,256
    tokens could be off by more, XLA's sum is within 1e-7.)"""
    p = np.exp((row - row.max()).astype(np.float64) / temperature)
    p[list(banned)] = 0.0
    p /= p.sum()
    order = np.argsort(-p)
    kept = np.ones(len(p), bool)
    if top_k:
        kept[order[top_k:]] = False
    kept &= p >= min_p * p.max()
    mass = np.where(kept, p, 0.0)[order]
    cumulative = np.cumsum(mass / mass.sum())
    return float((cumulative[rank - 1] + cumulative[rank]) / 2)


def test_kept_sets_and_distribution_match_transformers_warpers():
    """The sort-free kept sets (threshold searches) against transformers' sorting warpers, with each row
    under its own mix of top-k, min-p and top-p, on a Llama-3-sized vocabulary."""
    rng = np.random.default_rng(0)
    vocab, temperature = 128256, 0.7
    settings = [dict(top_k=top_k, min_p=min_p, top_p=top_p) for top_k, min_p, top_p in [
        (0, 0.0, "p"), (40, 0.0, 1.0), (1, 0.0, 1.0), (0, 0.05, 1.0), (0, 0.005, 1.0), (2000, 0.0, "p"),
        (40, 0.01, "p"), (0, 0.02, "p"), (vocab, 0.0, "p"), (0, 0.0, 1.0), (5, 0.0, "p"), (40, 0.01, 1.0),
        (0, 0.0, "wide"), (40, 0.0, "p")]]
    rows = len(settings)
    logits = (rng.standard_normal((rows, vocab)) * 2.5).astype(np.float32)
    settings[-1]["banned"] = tuple(np.argsort(-logits[-1])[:3].tolist())  # the 3 likeliest ids
    for row, setting in zip(logits, settings, strict=True):
        if setting["top_p"] == "p":
            kept_rank = int(rng.integers(1, min(setting["top_k"] or 30, 30)))
        elif setting["top_p"] == "wide":
            kept_rank = 3000  # float32 sums over thousands of tokens decide this boundary
        else:
            continue
        setting["top_p"] = unambiguous_top_p(row, temperature, setting["top_k"], setting["min_p"], kept_rank,
                                             setting.get("banned", ()))
    params = SamplingInputs(
        temperature=jnp.full(rows, temperature, jnp.float32),
        top_k=jnp.asarray([s["top_k"] for s in settings], jnp.int32),
        top_p=jnp.asarray([s["top_p"] for s in settings], jnp.float32),
        min_p=jnp.asarray([s["min_p"] for s in settings], jnp.float32),
        seed=jnp.arange(rows, dtype=jnp.uint32), step=jnp.zeros(rows, jnp.int32),
        banned=jnp.asarray([banned_row(s.get("banned", ())) for s in settings], jnp.int32))
    ours = np.asarray(jax.jit(distribution)(jnp.asarray(logits), params))
    expected_kept = hf_kept_sets(logits, temperature, settings)
    for i in range(rows):
        np.testing.assert_array_equal(ours[i] > 0, expected_kept[i], err_msg=f"row {i}: {settings[i]}")
        scaled = logits[i][expected_kept[i]].astype(np.float64) / temperature
        expected = np.exp(scaled - scaled.max())
        np.testing.assert_allclose(ours[i][expected_kept[i]], expected / expected.sum(), rtol=1e-4, atol=1e-7)
    sizes = sorted({int(k.sum()) for k in expected_kept})
    assert len(sizes) >= 8 and sizes[0] == 1 and sizes[-1] == vocab, sizes
    tokens, _ = jax.jit(sample)(jnp.asarray(logits), params)
    assert expected_kept[np.arange(rows), np.asarray(tokens)].all(), "a sampled token outside its kept set"


def test_top_k_keeps_every_token_tied_at_its_threshold():
    logits = np.log(np.array([0.3, 0.2, 0.2, 0.2, 0.1], np.float32))
    assert set(draw(2000, top_k=2, logits=logits).tolist()) == {0, 1, 2, 3}
    signed_zeros = np.array([2.0, 0.0, -0.0, -1.0], np.float32)  # -0.0 == 0.0: a tie, as transformers sees it
    assert set(draw(2000, top_k=2, logits=signed_zeros).tolist()) == {0, 1, 2}


def test_a_tiny_temperature_samples_as_sharply_as_asked():
    """Two logits one float32 ulp apart: at T = 1e-7 the softmax of logits / T is (0.233, 0.767), at
    T = 1e-8 it is (0, 1); no floor on T makes them both sample like a larger one."""
    near_tie = np.array([1.0, 1.0 + 2.0**-23], np.float32)
    for temperature, expected in ((1e-7, 0.7671), (1e-8, 1.0)):
        share = draw(20000, temperature=temperature, logits=near_tie).mean()
        assert abs(share - expected) < 0.015, (temperature, share)
        params = SamplingInputs(*(jnp.asarray([value]) for value in (
            np.float32(temperature), np.int32(0), np.float32(1.0), np.float32(0.0), np.uint32(0), np.int32(0))),
            banned=jnp.asarray([banned_row(())], jnp.int32))
        assert abs(float(distribution(jnp.asarray([near_tie]), params)[0, 1]) - expected) < 1e-3
