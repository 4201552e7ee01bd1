"""OpenAI's `logit_bias`: per-request (token id, bias) pairs added to the raw logits in the step.

The bias comes first, before the repetition, frequency and presence penalties and the sampler's
filters (vLLM's and transformers' order); the logprobs a request gets back stay the raw model's.
Each row carries up to `params.MAX_LOGIT_BIAS` pairs in every step's input ([rows, 64] ids and values: 128 KB
at 256 rows), and a batch in which no row has a bias skips the scatter under a `lax.cond`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BiasInputs:
    """Per-row pairs, each [S, MAX_LOGIT_BIAS]."""

    ids: jax.Array  # int32 token ids (-1: no pair)
    values: jax.Array  # float32 biases


def add_bias(logits: jax.Array, bias: BiasInputs) -> jax.Array:
    """logits [S, V] with each row's biases added (rows without pairs unchanged)."""

    def biased() -> jax.Array:
        rows, vocab = logits.shape
        columns = jnp.where(bias.ids >= 0, bias.ids, vocab)  # out of range: dropped
        return logits.at[jnp.arange(rows)[:, None], columns].add(bias.values, mode="drop")

    return lax.cond(jnp.any(bias.ids >= 0), biased, lambda: logits)
