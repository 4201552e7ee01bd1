"""Speculative decoding on the device: the draft's proposals and the lossless acceptance rule.

Per row, the draft proposed m <= K tokens d_1..d_m, each drawn from its distribution q_i, and the
target scored the m + 1 positions (distributions p_1..p_{m+1}). Standard speculative sampling
(Leviathan et al. 2023, Chen et al. 2023): d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i));
at the first rejection, position i, the next token is drawn from max(0, p_i - q_i), normalized;
if all m are accepted, a bonus token is drawn from p_{m+1}. The emitted tokens are then
distributed exactly as the target's own samples. p and q are the distributions the sampler draws
from (`sampler.distribution`: temperature, top-k, top-p, min-p and bans applied to both), so a
greedy row (one-hot p and q) accepts exactly the target's argmax.

Randomness is keyed, like the sampler's, by the request's seed and how many tokens it had
generated, with a salt per purpose (draft draw, acceptance, residual draw). The bonus token uses
the sampler's own key and method, so a row with nothing proposed samples exactly what a step
without speculation samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.engine.sampler import SamplingInputs, distribution, sample

DRAFT_SALT, ACCEPT_SALT, RESIDUAL_SALT = 0x5EC1, 0x5EC2, 0x5EC3


def _key(seed: jax.Array, step: jax.Array, salt: int) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), salt)


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """The standard rule's distribution after a rejection: max(0, p - q) (normalized by the caller)."""
    return jnp.maximum(p - q, 0.0)


def propose(logits: jax.Array, params: SamplingInputs) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One draft position per row: (token [S], its distribution q [S, V], confidence [S]).

    The confidence is the draft's top probability under its plain softmax (greedy rows draw from a
    one-hot q, whose top is always 1). `params.step` is the number of tokens the request will have
    generated before this position.
    """
    q = distribution(logits, params)
    keys = jax.vmap(_key, in_axes=(0, 0, None))(params.seed, params.step, DRAFT_SALT)
    tokens = jax.vmap(lambda key, row: jax.random.categorical(key, jnp.log(row)))(keys, q)
    return tokens.astype(jnp.int32), q, jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)


def verify(
    logits: jax.Array,
    draft_probs: jax.Array,
    draft_tokens: jax.Array,
    num_proposed: jax.Array,
    params: SamplingInputs,
    residual_rule: Callable[[jax.Array, jax.Array], jax.Array] = residual,
    adjusted: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Accepts a prefix of each row's proposals and draws the next token.

    logits [S, K+1, V] (the target's raw logits at each proposed position and the one after),
    draft_probs [S, K, V], draft_tokens [S, K], num_proposed [S] (<= K; 0: plain sampling).
    Returns (tokens [S, K+1]: the accepted proposals then the drawn token, count [S] of valid
    tokens, logprob of each token under the target's raw logits [S, K+1]).
    `adjusted`: the logits the target's distributions come from where they differ from the raw ones
    (a guided row's refused ids at -inf); the logprobs stay the raw model's.
    """
    raw = logits
    logits = raw if adjusted is None else adjusted
    rows, width, vocab = logits.shape
    proposals = width - 1
    at_position = dataclasses.replace(
        jax.tree.map(lambda x: jnp.repeat(x, width, axis=0), params),
        step=(params.step[:, None] + jnp.arange(width)[None]).reshape(-1),
    )
    p = distribution(logits.reshape(rows * width, vocab), at_position).reshape(rows, width, vocab)
    index = jnp.arange(proposals)
    p_draft = jnp.take_along_axis(p[:, :proposals], draft_tokens[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    steps = params.step[:, None] + index[None]
    keys = jax.vmap(jax.vmap(_key, in_axes=(None, 0, None)), in_axes=(0, 0, None))(params.seed, steps, ACCEPT_SALT)
    uniform = jax.vmap(jax.vmap(lambda key: jax.random.uniform(key)))(keys)
    accepted = (uniform * q_draft < p_draft) & (index[None] < num_proposed[:, None])
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)

    row = jnp.arange(rows)
    p_next = p[row, num_accepted]
    q_next = draft_probs[row, jnp.minimum(num_accepted, proposals - 1)]
    leftover = residual_rule(p_next, q_next)
    total = jnp.sum(leftover, axis=-1, keepdims=True)
    leftover = jnp.where(total > 0, leftover / jnp.maximum(total, 1e-30), p_next)
    residual_keys = jax.vmap(_key, in_axes=(0, 0, None))(params.seed, params.step + num_accepted, RESIDUAL_SALT)
    drawn = jax.vmap(lambda key, dist: jax.random.categorical(key, jnp.log(dist)))(residual_keys, leftover)
    bonus, _ = sample(raw[row, num_accepted], dataclasses.replace(params, step=params.step + num_accepted),
                      logits[row, num_accepted])
    rejected = num_accepted < num_proposed
    next_token = jnp.where(rejected, drawn.astype(jnp.int32), bonus)

    padded = jnp.pad(draft_tokens, ((0, 0), (0, 1)))
    tokens = jnp.where(jnp.arange(width)[None] < num_accepted[:, None], padded, 0)
    tokens = tokens.at[row, num_accepted].set(next_token)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(raw, axis=-1), tokens[..., None], axis=-1)[..., 0]
    return tokens, num_accepted + 1, logprobs
