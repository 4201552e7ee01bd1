"""Speculative sampling is lossless: with a random tiny target and draft, the tokens it emits are
distributed as the target's own samples (chi-square, many seeded rows), for the first and the second
position of a round and with sampling filters on both; a broken residual rule fails the same test."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from jaxinfer.engine.sampler import MAX_BANNED, SamplingInputs, distribution, sample
from jaxinfer.engine.spec import propose, verify

VOCAB, PROPOSALS, ROWS = 6, 3, 40_000


def inputs(rows: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> SamplingInputs:
    return SamplingInputs(
        temperature=jnp.full(rows, temperature, jnp.float32), top_k=jnp.full(rows, top_k, jnp.int32),
        top_p=jnp.full(rows, top_p, jnp.float32), min_p=jnp.zeros(rows, jnp.float32),
        seed=jnp.arange(rows, dtype=jnp.uint32), step=jnp.full(rows, 5, jnp.int32),
        banned=jnp.full((rows, MAX_BANNED), -1, jnp.int32))


def tiny_models(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Context-free random 'models': per-position logits of a target and of a different draft."""
    rng = np.random.default_rng(seed)
    target = rng.normal(0, 1.5, (PROPOSALS + 1, VOCAB)).astype(np.float32)
    draft = (target[:PROPOSALS] + rng.normal(0, 1.5, (PROPOSALS, VOCAB))).astype(np.float32)
    return target, draft


def speculate(params: SamplingInputs, target: np.ndarray, draft: np.ndarray, **rule):
    """One round as one jitted program, as in the engine (run op by op, each op compiles per shape)."""
    return _round(params, jnp.asarray(target), jnp.asarray(draft), tuple(rule.items()))


@functools.partial(jax.jit, static_argnums=3)
def _round(params: SamplingInputs, target: jax.Array, draft: jax.Array, rule: tuple):
    rows = params.seed.shape[0]
    tokens, probs = [], []
    for i in range(PROPOSALS):  # the draft proposes position by position, as the engine does
        logits = jnp.broadcast_to(draft[i], (rows, VOCAB))
        token, q, _ = propose(logits, dataclasses.replace(params, step=params.step + i))
        tokens.append(token)
        probs.append(q)
    target_logits = jnp.broadcast_to(target, (rows, PROPOSALS + 1, VOCAB))
    return verify(target_logits, jnp.stack(probs, 1), jnp.stack(tokens, 1),
                  jnp.full(rows, PROPOSALS, jnp.int32), params, **dict(rule))


def p_value(samples: np.ndarray, expected_probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=VOCAB)
    support = expected_probs > 0
    assert support.sum() >= 3, "a chi-square test needs several possible tokens"
    assert counts[~support].sum() == 0, "a token outside the target's sampling set was emitted"
    expected = expected_probs[support].astype(np.float64)
    return chisquare(counts[support], expected / expected.sum() * len(samples)).pvalue


SETTINGS = [dict(temperature=1.0), dict(temperature=2.0, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("setting", SETTINGS, ids=["plain", "filtered"])
@pytest.mark.parametrize("rule", ["standard", "broken"])
def test_emitted_tokens_follow_the_target_distribution(setting, rule):
    target, draft = tiny_models(seed=3)
    params = inputs(ROWS, **setting)
    broken = {"residual_rule": lambda p, q: p} if rule == "broken" else {}  # resamples p: biased to the draft
    tokens, counts, _ = speculate(params, target, draft, **broken)
    tokens, counts = np.asarray(tokens), np.asarray(counts)
    expected = np.asarray(distribution(jnp.asarray(target), inputs(PROPOSALS + 1, **setting)))
    first = p_value(tokens[:, 0], expected[0])
    second = p_value(tokens[counts >= 2, 1], expected[1])  # given the first proposal was accepted
    assert 0.2 < counts.mean() - 1 < PROPOSALS  # some proposals accepted, some rejected
    if rule == "standard":
        assert first > 0.01 and second > 0.01, (first, second)
    else:
        assert min(first, second) < 1e-6, "the test must detect a lossy rule"


def test_a_draft_equal_to_the_target_is_always_accepted():
    target, _ = tiny_models(seed=4)
    params = inputs(2000, temperature=0.9)
    _, counts, _ = speculate(params, target, target[:PROPOSALS])
    assert np.all(np.asarray(counts) == PROPOSALS + 1)


def test_greedy_accepts_exactly_the_target_argmax():
    target, draft = tiny_models(seed=5)
    draft[0] = target[0]  # the first proposal agrees with the target's argmax, the next ones may not
    params = inputs(4, temperature=0.0)
    tokens, counts, _ = speculate(params, target, draft)
    argmax = target.argmax(-1)
    agree = int(np.argmin(np.append(draft.argmax(-1) == argmax[:PROPOSALS], False)))
    assert np.all(np.asarray(counts) == agree + 1)
    assert np.all(np.asarray(tokens)[:, : agree + 1] == argmax[: agree + 1])


def test_nothing_proposed_samples_exactly_as_the_plain_sampler():
    target, _ = tiny_models(seed=6)
    params = inputs(500, temperature=1.0, top_p=0.95)
    logits = jnp.broadcast_to(target, (500, PROPOSALS + 1, VOCAB))
    tokens, counts, _ = jax.jit(verify)(logits, jnp.zeros((500, PROPOSALS, VOCAB)),
                                        jnp.zeros((500, PROPOSALS), jnp.int32), jnp.zeros(500, jnp.int32), params)
    plain, _ = jax.jit(sample)(logits[:, 0], params)
    assert np.all(np.asarray(counts) == 1) and np.array_equal(np.asarray(tokens)[:, 0], np.asarray(plain))


def test_logprobs_are_the_targets_raw_logprobs():
    target, draft = tiny_models(seed=7)
    tokens, counts, logprobs = speculate(inputs(8, temperature=1.0), target, draft)
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(target), axis=-1))
    for row in range(8):
        for i in range(int(counts[row])):
            assert np.isclose(logprobs[row, i], raw[i, tokens[row, i]], atol=1e-5)


def test_dense_training_attention_matches_the_paged_engine_forward():
    """tools/train_draft.py trains with `DenseAttention`; its logits must be the engine's (paged) ones."""
    from flax import nnx
    from harness import PagedForward

    from jaxinfer.config import ModelConfig
    from jaxinfer.layers.attention import AttentionMetadata, DenseAttention
    from jaxinfer.models import KVCache
    from jaxinfer.parallel import make_mesh
    from jaxinfer.weights.loader import abstract_model, fill, parameters, random_model

    cfg = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=8, num_kv_heads=2, head_dim=16)
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    paged = random_model(cfg, mesh, jnp.float32, seed=2)
    tensors = [(n, n, np.asarray(p.get_value())) for n, p in parameters(paged).items()]
    length, sequences = 24, np.random.default_rng(1).integers(0, 300, (2, 24))
    expected = np.stack([PagedForward(paged, page_size=8, num_pages=16, max_pages=4).run(list(s), 0)
                         for s in sequences])
    dense = fill(abstract_model(cfg, jnp.float32, DenseAttention(length)), tensors, mesh, "copy")
    flat = 2 * length
    meta = AttentionMetadata(jnp.tile(jnp.arange(length, dtype=jnp.int32), 2), jnp.zeros(flat, jnp.int32),
                             jnp.zeros((1, 1), jnp.int32), jnp.zeros(flat, jnp.int32))
    caches = tuple(KVCache(jnp.zeros(1), jnp.zeros(1)) for _ in range(cfg.num_layers))
    hidden, _ = nnx.jit(lambda m, t: m(t, caches, meta))(dense, jnp.asarray(sequences.reshape(-1), jnp.int32))
    got = np.asarray(dense.logits(hidden)).reshape(2, length, -1)
    assert np.abs(got - expected).max() < 1e-4
