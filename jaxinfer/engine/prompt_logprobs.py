"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob given the tokens before it.

The step scores the positions a batch asks for: a position's target is the prompt id that follows it,
and the value is that id's logprob under the raw model, from the same logits the sampler would
read there, with the same arithmetic (`sampler.Normalizer`) as the sampled ids' logprobs. A position
can also ask for its most likely ids. The logits are computed in blocks of `PROMPT_BLOCK` tokens, so
a large bucket's [tokens, vocab] logits are never written whole, and each block runs under a cond:
a batch, or a block of it, that asks nothing computes nothing.

The host (engine/engine.py) asks for each prompt position once. A sequence still being scored takes
no cached prefix beyond the positions already asked for (scheduler.py): a cached page is not
computed, so it could not be scored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer.engine.sampler import Normalizer, most_likely

PROMPT_BLOCK = 128  # tokens whose logits one block writes: 64 MB of float32 at a 128,256-id vocabulary


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptScoring:
    """Which positions of the batch to score, each [T] int32."""

    targets: jax.Array  # the id whose logprob is wanted at each position (-1: not scored)
    alternatives: jax.Array  # > 0: the position's most likely ids are wanted as well


def score_prompt(logits_of: Callable[[jax.Array, jax.Array], jax.Array], hidden: jax.Array, adapters: jax.Array,
                 scoring: PromptScoring, count: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """hidden [T, D] (final norm), adapters [T] -> (target logprobs [T], most likely ids [T, count], their
    logprobs [T, count]); zeros where nothing was asked. `logits_of(hidden, adapters)` is the model's head."""
    tokens = hidden.shape[0]
    block = min(tokens, PROMPT_BLOCK)
    blocks = -(-tokens // block)

    def in_blocks(x: jax.Array, fill: int) -> jax.Array:
        padding = [(0, blocks * block - tokens)] + [(0, 0)] * (x.ndim - 1)
        return jnp.pad(x, padding, constant_values=fill).reshape(blocks, block, *x.shape[1:])

    def score_block(part: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
        h, a, targets, alternatives = part
        return lax.cond(jnp.any(targets >= 0), lambda: _score(logits_of(h, a), targets, alternatives, count),
                        lambda: _nothing(block, count))

    def score() -> tuple[jax.Array, jax.Array, jax.Array]:
        parts = (in_blocks(hidden, 0), in_blocks(adapters, 0), in_blocks(scoring.targets, -1),
                 in_blocks(scoring.alternatives, 0))
        values, ids, top = lax.map(score_block, parts)
        return values.reshape(-1)[:tokens], ids.reshape(-1, count)[:tokens], top.reshape(-1, count)[:tokens]

    return lax.cond(jnp.any(scoring.targets >= 0), score, lambda: _nothing(tokens, count))


def _score(logits: jax.Array, targets: jax.Array, alternatives: jax.Array, count: int
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    normalizer = Normalizer.of(logits)
    chosen = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[:, None], axis=-1)
    values = jnp.where(targets >= 0, normalizer.logprobs(chosen)[:, 0], 0.0)
    ids, top = lax.cond(jnp.any(alternatives > 0), lambda: most_likely(logits, normalizer, count),
                        lambda: _nothing(logits.shape[0], count)[1:])
    return values, ids, top


def _nothing(tokens: int, count: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    return (jnp.zeros(tokens, jnp.float32), jnp.zeros((tokens, count), jnp.int32),
            jnp.zeros((tokens, count), jnp.float32))
