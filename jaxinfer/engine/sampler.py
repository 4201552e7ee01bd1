"""On-device sampling: greedy, temperature, top-k, top-p, min-p, banned ids, per-request seeds, logprobs.

Repetition, frequency and presence penalties change the logits first (engine/penalties.py).

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


def sample(logits: jax.Array, params: SamplingInputs, penalized: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array]:
    """logits [S, V] float32 -> (token ids [S] int32, logprob of each under the raw model [S]).

    `penalized`: the logits with repetition, frequency and presence penalties applied
    (engine/penalties.py), which the tokens are drawn from; the logprobs stay the raw model's."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    logits = _ban(logits if penalized is None else penalized, params.banned)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    all_greedy = jnp.all(params.temperature <= 0.0)
    tokens = lax.cond(all_greedy, lambda: greedy, lambda: _sample_rows(logits, params, greedy))
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def top_logprobs(logits: jax.Array, wanted: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """The `count` most likely ids of each row under the raw model and their logprobs, [S, count] each;
    zeros unless some row wants them (`wanted` [S] > 0), so a batch without them skips the search."""
    nothing = (jnp.zeros((logits.shape[0], count), jnp.int32), jnp.zeros((logits.shape[0], count), logits.dtype))
    return lax.cond(jnp.any(wanted > 0), lambda: most_likely(logits, Normalizer.of(logits), count), lambda: nothing)


@dataclasses.dataclass(frozen=True)
class Normalizer:
    """Each row's maximum logit and log-sum-exp of the logits less it, [S, 1] each: an id's logprob is
    (logit - top) - log_sum, log_softmax's own arithmetic (so equal to it bit for bit) without writing
    the whole [S, V] log-softmax."""

    top: jax.Array
    log_sum: jax.Array

    @classmethod
    def of(cls, logits: jax.Array) -> Normalizer:
        top = jnp.max(logits, axis=-1, keepdims=True)
        return cls(top, jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True)))

    def logprobs(self, values: jax.Array) -> jax.Array:
        """Logits of the rows ([S, k]) as logprobs."""
        return (values - self.top) - self.log_sum


def most_likely(logits: jax.Array, normalizer: Normalizer, count: int) -> tuple[jax.Array, jax.Array]:
    """The ids of each row's `count` largest logits and their logprobs, [S, count] each."""
    values, ids = lax.top_k(logits, count)
    return ids.astype(jnp.int32), normalizer.logprobs(values)


def _ban(logits: jax.Array, banned: jax.Array) -> jax.Array:
    rows, vocab = logits.shape
    columns = jnp.where(banned >= 0, banned, vocab)  # out of range: dropped
    return logits.at[jnp.arange(rows)[:, None], columns].set(-jnp.inf, mode="drop")


def _sample_rows(logits: jax.Array, params: SamplingInputs, greedy: jax.Array) -> jax.Array:
    """Sampled rows draw Gumbel noise per vocabulary id and take the argmax over their kept set. Only a
    batch where some sampled row uses top-k, top-p or min-p computes kept sets; a row without them
    takes the same token (bit for bit) whatever its neighbours do."""
    scaled = _scaled(logits, params.temperature)
    noise = jax.vmap(_gumbel)(logits, params.seed, params.step)
    perturbed = scaled + noise
    unfiltered = jnp.argmax(perturbed, axis=-1).astype(jnp.int32)
    filtering = _filtering_rows(params, logits.shape[-1])

    def filtered() -> jax.Array:
        keep = _kept(scaled, params, filtering)
        drawn = jnp.argmax(jnp.where(keep, perturbed, -jnp.inf), axis=-1).astype(jnp.int32)
        return jnp.where(filtering, drawn, unfiltered)

    sampled = lax.cond(jnp.any(filtering), filtered, lambda: unfiltered)
    return jnp.where(params.temperature > 0.0, sampled, greedy)


def _scaled(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """[S, V] logits over each row's temperature (greedy rows' values are never used).

    The row's maximum is subtracted first: the values are then <= 0, so any temperature, however
    small, divides them without overflow (at worst to -inf), and a tiny temperature samples as
    sharply as asked instead of being raised to a floor."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # a row with every id banned stays -inf, not NaN
    return (logits - top) / jnp.where(temperature > 0.0, temperature, 1.0)[:, None]


def _filtering_rows(params: SamplingInputs, vocab: int) -> jax.Array:
    """[S] bool: sampled rows that use top-k, top-p or min-p."""
    filters = ((params.top_k > 0) & (params.top_k < vocab)) | (params.top_p < 1.0) | (params.min_p > 0.0)
    return (params.temperature > 0.0) & filters


def _gumbel(logits: jax.Array, seed: jax.Array, step: jax.Array) -> jax.Array:
    """The row's noise, one value per vocabulary id, from its seed and step alone."""
    return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), step), logits.shape, jnp.float32)


# -- kept sets without sorting ------------------------------------------------------------------------
# Each filter keeps an upper set of the row's logits: every token at or above a threshold. The
# threshold is found by bisection over the 2^32 ordered bit patterns of float32 (32 passes over the
# row, each a compare and a sum), which on accelerators costs a fraction of sorting the vocabulary.
# Tokens tied at a threshold are all kept, as vLLM's top-k does.
_SEARCH_STEPS = 32


def _unroll_search() -> bool:
    """Accelerators get the passes unrolled: a GPU while loop reads its condition back to the host
    each pass (not measured here). On the CPU a loop runs as fast (18 to 20 ms either way for 8 rows of
    49,152 with top-k and top-p) and compiles faster: 0.6 s against 0.8 s there, 0.6 s against 2.1 s
    for a 6-token vocabulary (docs/benchmarks.md, "Test suite time")."""
    return jax.default_backend() != "cpu"


def _ordered_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (negative floats reversed, positives above them). Values
    that compare equal get one key: -0.0 (and subnormals where the backend flushes them) become +0.0."""
    x = jnp.where(x == 0.0, jnp.float32(0.0), x)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    bits = jnp.where(bits == jnp.uint32(0x80000000), jnp.uint32(0), bits)  # -0.0, even if fast math folded the above
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_passing(passes, low: jax.Array, high: jax.Array) -> jax.Array:
    """[S] uint32: per row, the largest t in [low, high] with passes(t), given passes(low) and that
    passes is true up to some t and false above it. Never below low, even if passes(low) were false."""

    def halve(_, bounds):
        low, high = bounds
        span = high - low
        middle = low + (span >> 1) + (span & 1)  # rounds up, and never overflows
        ok = passes(middle)
        return jnp.where(ok, middle, low), jnp.where(ok, high, middle - 1)

    return jnp.maximum(lax.fori_loop(0, _SEARCH_STEPS, halve, (low, high), unroll=_unroll_search())[0], low)


def _kept(scaled: jax.Array, params: SamplingInputs, filtering: jax.Array) -> jax.Array:
    """[S, V] bool: each row's sampling set. min-p and top-k first, then top-p over what they kept,
    renormalized (as vLLM does): the smallest set of most likely tokens whose mass reaches top_p.
    The most likely token always stays; rows that do not filter keep everything."""
    keys = _ordered_keys(scaled)
    lowest, highest = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)
    probs = jax.nn.softmax(scaled, axis=-1)
    top_k = jnp.where(filtering, params.top_k, 0)  # greedy rows' settings cost no search
    threshold = jnp.maximum(_min_p_threshold(keys, highest, probs, params.min_p),
                            _top_k_threshold(keys, lowest, highest, top_k))
    uses_top_p = params.top_p < 1.0
    nucleus = lax.cond(jnp.any(uses_top_p & filtering),
                       lambda: _top_p_threshold(keys, highest, probs, params.top_p, threshold), lambda: threshold)
    threshold = jnp.where(uses_top_p, nucleus, threshold)
    return keys >= jnp.where(filtering, threshold, jnp.uint32(0))[:, None]


def _min_p_threshold(keys: jax.Array, highest: jax.Array, probs: jax.Array, min_p: jax.Array) -> jax.Array:
    """The lowest key whose probability is at least min_p times the row's highest (no search needed)."""
    kept = probs >= (min_p * jnp.max(probs, axis=-1))[:, None]
    return jnp.min(jnp.where(kept, keys, highest[:, None]), axis=-1)


def _top_k_threshold(keys: jax.Array, lowest: jax.Array, highest: jax.Array, top_k: jax.Array) -> jax.Array:
    """The largest key with at least top_k tokens at or above it (the lowest key where top-k is off)."""
    vocab = keys.shape[-1]
    top_k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)

    def search() -> jax.Array:
        return _largest_passing(lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= top_k, lowest, highest)

    return lax.cond(jnp.any(top_k < vocab), search, lambda: lowest)


def _top_p_threshold(keys: jax.Array, highest: jax.Array, probs: jax.Array, top_p: jax.Array,
                     start: jax.Array) -> jax.Array:
    """The largest key whose upper set holds at least top_p of the mass at or above `start`."""

    def mass(t: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(keys >= t[:, None], probs, 0.0), axis=-1)

    target = top_p * mass(start)  # top_p < 1 gives target <= mass(start): the search's start passes
    return _largest_passing(lambda t: mass(t) >= target, start, highest)


def distribution(logits: jax.Array, params: SamplingInputs) -> jax.Array:
    """The distribution `sample` draws from, [S, V]: one-hot on the argmax for greedy rows, else the
    tempered softmax over the kept set (top-k, min-p, top-p), with banned ids at zero."""
    logits = _ban(logits, params.banned)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

    def mixed() -> jax.Array:
        filtering = _filtering_rows(params, logits.shape[-1])
        scaled = _scaled(logits, params.temperature)
        unfiltered = jax.nn.softmax(scaled, axis=-1)

        def filtered() -> jax.Array:
            kept = jax.nn.softmax(jnp.where(_kept(scaled, params, filtering), scaled, -jnp.inf), axis=-1)
            return jnp.where(filtering[:, None], kept, unfiltered)

        sampled = lax.cond(jnp.any(filtering), filtered, lambda: unfiltered)
        return jnp.where((params.temperature <= 0.0)[:, None], greedy, sampled)

    return lax.cond(jnp.all(params.temperature <= 0.0), lambda: greedy, mixed)
