"""Repetition, frequency and presence penalties from per-sequence token counts kept on the device.

The counts live in one table, [max_seqs, vocab] int32, that the step carries (donated) like the KV
pages: a running sequence that uses a penalty holds one row (its slot). A row is loaded once from the
host's ids when the sequence is scheduled (admission, or again after preemption); after that, each
step adds the token it sampled for the row, on the device. So overlapped scheduling needs no extra
copy: the newest id, still unknown to the host, is already counted when the next step samples.

Each entry holds how many times the token was generated, plus `PROMPT_BIT` if the prompt has it.
The penalties follow vLLM (and OpenAI's definitions), applied to the raw logits before anything else:
- repetition_penalty r (transformers' definition): a token seen in the prompt or the output has its
  logit divided by r where positive, multiplied by r otherwise;
- frequency_penalty f: minus f times the token's count in the output;
- presence_penalty p: minus p if the output has the token at all.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

PROMPT_BIT = 1 << 30  # above any output count: counts stay below max_model_len


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyInputs:
    """Per-row penalty settings, each [S]."""

    slot: jax.Array  # int32: the row's counts in the table (-1: no penalty, and nothing is counted)
    repetition: jax.Array  # float32, 1 = off
    frequency: jax.Array  # float32, 0 = off
    presence: jax.Array  # float32, 0 = off


def penalize(logits: jax.Array, table: jax.Array, inputs: PenaltyInputs) -> jax.Array:
    """logits [S, V] with each row's penalties applied (rows without a slot unchanged)."""

    def apply() -> jax.Array:
        has_slot = inputs.slot >= 0
        counts = jnp.where(has_slot[:, None], table[jnp.maximum(inputs.slot, 0)], 0)
        generated = (counts & (PROMPT_BIT - 1)).astype(jnp.float32)
        repetition = inputs.repetition[:, None]
        penalized = jnp.where(counts != 0, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
        return (penalized - inputs.frequency[:, None] * generated
                - inputs.presence[:, None] * (generated > 0).astype(jnp.float32))

    return lax.cond(jnp.any(inputs.slot >= 0), apply, lambda: logits)


def count_sampled(table: jax.Array, slot: jax.Array, tokens: jax.Array) -> jax.Array:
    """The table with each row's sampled token counted in its slot (rows with slot -1 change nothing)."""
    rows = jnp.where(slot >= 0, slot, table.shape[0])  # out of range: dropped
    return table.at[rows, tokens].add(1, mode="drop")


def load_row(table: jax.Array, slot: jax.Array, ids: jax.Array, num_prompt: jax.Array) -> jax.Array:
    """The table with row `slot` replaced by the counts of `ids` ([L] int32, -1 padding): the first
    `num_prompt` are the prompt, the rest the output generated so far."""
    vocab = table.shape[1]
    columns = jnp.where(ids >= 0, ids, vocab)
    in_prompt = jnp.arange(ids.shape[0]) < num_prompt
    row = jnp.zeros(vocab, table.dtype)
    row = row.at[jnp.where(in_prompt, columns, vocab)].max(PROMPT_BIT, mode="drop")
    row = row.at[jnp.where(in_prompt, vocab, columns)].add(1, mode="drop")
    return table.at[slot].set(row)
