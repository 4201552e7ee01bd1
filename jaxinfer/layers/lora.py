"""Multi-adapter LoRA on the model's projections, with per-adapter rows for added tokens.

Every adapted `Linear` holds its adapters stacked over *slots*: ``lora_a [in, slots, rank]`` and
``lora_b [slots, rank, out]`` (the scale ``alpha / rank`` is folded into ``lora_b`` at load). Slot 0
is "no adapter" and stays zero. A batch names one slot per token, so requests with different
adapters (or none) share one step; the shapes never depend on which adapters are loaded, so
loading and unloading replaces array contents and never recompiles.

The delta is computed for every slot at once and masked with the tokens' one-hot slot, as two
plain matmuls: ``x @ A`` with A seen as ``[in, slots * rank]`` (the layout makes that reshape
free), the mask, then ``@ B`` seen as ``[slots * rank, out]``. That is ``T x slots x rank x (in +
out)`` multiply-adds, small next to the base projection for the few resident adapters an engine
keeps (the cost grows linearly with `max_adapters`).

Added tokens (the processor's control tokens, ids ``>= added_start``) may be trained by an adapter
(PEFT's ``trainable_token_indices``): their embedding rows are kept per slot, and with tied
embeddings the same rows score those ids in the output.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


ZerosFn = Callable[[tuple[int, ...], tuple[str | None, ...]], jax.Array]  # (shape, logical axes) -> placed zeros


class LoraParam(nnx.Variable):
    """Adapter weights stacked over slots: not a checkpoint parameter, and not trained with the base."""


def slot_one_hot(slots: jax.Array, num_slots: int, dtype: jnp.dtype) -> jax.Array:
    """Per-token slot ids [T] -> one-hot [T, num_slots]."""
    return jax.nn.one_hot(slots, num_slots, dtype=dtype)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, one_hot: jax.Array) -> jax.Array:
    """x [T, in], a [in, S, r], b [S, r, out], one_hot [T, S] -> the adapters' delta [T, out] in float32."""
    fan_in, slots, rank = a.shape
    down = jnp.dot(x, a.reshape(fan_in, slots * rank), preferred_element_type=jnp.float32)
    down = (down.reshape(-1, slots, rank) * one_hot.astype(jnp.float32)[:, :, None]).reshape(-1, slots * rank)
    return jnp.dot(down.astype(b.dtype), b.reshape(slots * rank, -1), preferred_element_type=jnp.float32)


def added_rows_lookup(base: jax.Array, rows: jax.Array, start: int, ids: jax.Array, slots: jax.Array) -> jax.Array:
    """Embeddings of ``ids`` given the base table's rows ``base`` [T, E]: ids >= start of tokens with an
    adapter (slot > 0) are read from their slot's rows [S, n, E] instead (slot 0 keeps the base's)."""
    added = rows[slots, jnp.clip(ids - start, 0, rows.shape[1] - 1)]
    return jnp.where(((ids >= start) & (slots > 0))[:, None], added.astype(base.dtype), base)


def added_rows_logits(logits: jax.Array, hidden: jax.Array, rows: jax.Array, start: int, slots: jax.Array
                      ) -> jax.Array:
    """Replaces the added ids' logits [R, start:start+n] of rows with an adapter by the scores of their
    slot's rows (tied output head); hidden [R, E], slots [R]."""
    end = start + rows.shape[1]
    scores = jnp.einsum("re,rne->rn", hidden, rows[slots], preferred_element_type=jnp.float32)
    return logits.at[:, start:end].set(jnp.where((slots > 0)[:, None], scores, logits[:, start:end]))
