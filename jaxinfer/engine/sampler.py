"""On-device sampling: greedy, temperature, top-k, top-p, min-p, banned ids, per-request seeds, logprobs.

Each row draws with the key `fold_in(key(seed), n)` where n is how many tokens the request has
generated so far, so a request's samples depend only on its seed and its own history, never on
which other requests share the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    """Per-row sampling settings, each [S]. temperature 0 means greedy."""

    temperature: jax.Array  # float32
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32, 1 = off
    min_p: jax.Array  # float32, 0 = off
    seed: jax.Array  # uint32
    step: jax.Array  # int32, tokens generated so far by this request
    banned: jax.Array  # [S, MAX_BANNED] int32 ids that may not be sampled (-1 = none): EOS before min_tokens


MAX_BANNED = 16


def sample(logits: jax.Array, params: SamplingInputs) -> tuple[jax.Array, jax.Array]:
    """logits [S, V] float32 -> (token ids [S] int32, logprob of each under the raw model [S])."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    logits = _ban(logits, params.banned)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    all_greedy = jnp.all(params.temperature <= 0.0)
    tokens = lax.cond(all_greedy, lambda: greedy, lambda: _sample_rows(logits, params, greedy))
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def _ban(logits: jax.Array, banned: jax.Array) -> jax.Array:
    rows, vocab = logits.shape
    columns = jnp.where(banned >= 0, banned, vocab)  # out of range: dropped
    return logits.at[jnp.arange(rows)[:, None], columns].set(-jnp.inf, mode="drop")


def _sample_rows(logits: jax.Array, params: SamplingInputs, greedy: jax.Array) -> jax.Array:
    """Sampled rows draw Gumbel noise per vocabulary id, so a row without top-k, top-p or min-p gets the
    same token whether or not the batch sorts: only a batch where some sampled row filters pays for
    sorting the vocabulary (per row, [S, V]: the costliest part of sampling at a large vocabulary)."""
    scaled = _scaled(logits, params.temperature)
    noise = jax.vmap(_gumbel)(logits, params.seed, params.step)  # drawn once for both paths
    unfiltered = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)
    filtering = _filtering_rows(params, logits.shape[-1])

    def with_sort() -> jax.Array:
        # Rows that do not filter keep the unsorted draw (bit for bit the same computation whether or
        # not the batch sorts, so a row never depends on its neighbours).
        drawn = jax.vmap(_sample_one)(scaled, noise, params.top_k, params.top_p, params.min_p)
        return jnp.where(filtering, drawn, unfiltered)

    sampled = lax.cond(jnp.any(filtering), with_sort, lambda: unfiltered)
    return jnp.where(params.temperature > 0.0, sampled, greedy)


def _scaled(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """[S, V] logits over each row's temperature (greedy rows' values are never used)."""
    return logits / jnp.maximum(temperature, 1e-6)[:, None]


def _filtering_rows(params: SamplingInputs, vocab: int) -> jax.Array:
    """[S] bool: sampled rows that use top-k, top-p or min-p (only they need their vocabulary sorted)."""
    filters = ((params.top_k > 0) & (params.top_k < vocab)) | (params.top_p < 1.0) | (params.min_p > 0.0)
    return (params.temperature > 0.0) & filters


def _gumbel(logits: jax.Array, seed: jax.Array, step: jax.Array) -> jax.Array:
    """The row's noise, one value per vocabulary id, from its seed and step alone."""
    return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), step), logits.shape, jnp.float32)


def _filter(scaled, top_k, top_p, min_p) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One row's sampling set from its tempered logits: (vocabulary order, sorted logits, kept mask)."""
    vocab = scaled.shape[-1]
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    probs = jax.nn.softmax(sorted_logits)
    rank = jnp.arange(vocab)
    keep = rank < jnp.where(top_k > 0, top_k, vocab)
    keep &= probs >= min_p * probs[0]
    # top-p over what top-k and min-p kept, renormalized (as vLLM does): the smallest prefix whose
    # mass reaches top_p; the most likely token always stays.
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / jnp.sum(kept)
    keep &= (jnp.cumsum(kept) - kept < top_p) | (top_p >= 1.0)  # 1: off, even where the sum rounds to 1
    keep = keep.at[0].set(True)
    return order, sorted_logits, keep


def _sample_one(scaled, noise, top_k, top_p, min_p) -> jax.Array:
    order, sorted_logits, keep = _filter(scaled, top_k, top_p, min_p)
    choice = jnp.argmax(jnp.where(keep, sorted_logits + noise[order], -jnp.inf))
    return order[choice].astype(jnp.int32)


def distribution(logits: jax.Array, params: SamplingInputs) -> jax.Array:
    """The distribution `sample` draws from, [S, V]: one-hot on the argmax for greedy rows, else the
    tempered softmax over the kept set (top-k, min-p, top-p), with banned ids at zero."""
    logits = _ban(logits, params.banned)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

    def one(scaled_row, top_k, top_p, min_p):
        order, sorted_logits, keep = _filter(scaled_row, top_k, top_p, min_p)
        probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
        return jnp.zeros_like(probs).at[order].set(probs)

    def mixed() -> jax.Array:
        filtering = _filtering_rows(params, logits.shape[-1])
        scaled = _scaled(logits, params.temperature)
        unfiltered = jax.nn.softmax(scaled, axis=-1)

        def with_sort() -> jax.Array:
            sorted_rows = jax.vmap(one)(scaled, params.top_k, params.top_p, params.min_p)
            return jnp.where(filtering[:, None], sorted_rows, unfiltered)

        sampled = lax.cond(jnp.any(filtering), with_sort, lambda: unfiltered)
        return jnp.where((params.temperature <= 0.0)[:, None], greedy, sampled)

    # An all-greedy batch, or one where no sampled row filters, skips the per-row sort of the vocabulary.
    return lax.cond(jnp.all(params.temperature <= 0.0), lambda: greedy, mixed)
