"""Attention through JAX's ragged paged attention contract: the TPU kernel, and the same contract in plain JAX.

JAX ships a TPU kernel, `jax.experimental.pallas.ops.tpu.ragged_paged_attention`, that reads KV pages
in place and handles prefill, decode and mixed batches in one call. Its contract:

- `kv_pages [num_pages, page_size, 2 * kv_heads, head_dim]`, keys at even combined heads and values
  at odd ones (`kv_layout.CombinedPages`, which also pads heads and head_dim for Mosaic's tiling);
- sequence i owns queries `cu_q_lens[i]:cu_q_lens[i + 1]` of the flat batch, has `kv_lens[i]` tokens
  in the cache (its queries included, as the last of them) on pages `page_indices[i]`;
- only the first `num_seqs[0]` sequences are real; the outputs of queries past them are undefined.

`ragged_segments` derives those arrays from the step's `AttentionMetadata` on the device.
`RaggedPagedAttention.tpu_kernel()` is the `pallas_tpu` backend. `RaggedPagedAttention.plain_jax()`
(`ragged_reference`) runs the same contract through `contract_reference`, a gather-based version
that jits anywhere: it lets the CPU tests run the TPU path's layout, metadata and KV tier moves end to
end, which the shipped kernel cannot do here (JAX 0.10's TPU interpreter fails on the kernel's ref
reshape, and the auto-tuned block sizes need a TPU).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.layers.attention import (
    NEG_INF,
    AttentionMetadata,
    largest_divisor_at_most,
    on_each_model_device,
    real_tokens,
)
from jaxinfer.layers.kv_layout import CombinedPages

# (queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, block sizes) -> out
RaggedKernel = Callable[..., jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedSegments:
    """The kernel's per-sequence arrays over the page table's rows, and which tokens are real."""

    kv_lens: jax.Array  # [S]
    page_indices: jax.Array  # [S, P]
    cu_q_lens: jax.Array  # [S + 1]
    num_seqs: jax.Array  # [1]
    real: jax.Array  # [T] bool: False for the padding after the last real token


def ragged_segments(meta: AttentionMetadata, page_size: int) -> RaggedSegments:
    """Rows of the page table become the kernel's sequences (the step keeps each row's tokens
    contiguous, rows in order, and gives every row at least one token); padding is found by
    `attention.real_tokens`."""
    rows, positions = meta.seq_rows, meta.positions
    num_rows = meta.page_table.shape[0]
    real = real_tokens(meta)
    counts = jnp.zeros(num_rows, jnp.int32).at[rows].add(real.astype(jnp.int32))
    kv_lens = jnp.zeros(num_rows, jnp.int32).at[rows].max(jnp.where(real, positions + 1, 0))
    # A draft row past its budget keeps counting positions in later propose calls (its output is
    # dropped); the kernel may not read past the row's page table, so its keys stop there.
    kv_lens = jnp.minimum(kv_lens, meta.page_table.shape[1] * page_size)
    cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    num_seqs = jnp.max(jnp.where(real, rows, -1), keepdims=True).astype(jnp.int32) + 1
    return RaggedSegments(kv_lens, meta.page_table, cu_q_lens, num_seqs, real)


def contract_reference(q: jax.Array, kv_pages: jax.Array, kv_lens: jax.Array, page_indices: jax.Array,
                       cu_q_lens: jax.Array, num_seqs: jax.Array, *, sm_scale: float, **_block_sizes) -> jax.Array:
    """The kernel's contract in plain JAX: each query gathers its sequence's whole page list (no
    blocking, so memory grows with the page table: for tests and small batches). Outputs past the
    real queries are zero."""
    num_tokens, num_heads, head_dim = q.shape
    num_pages_per_seq, page_size = page_indices.shape[1], kv_pages.shape[1]
    kv_heads = kv_pages.shape[2] // 2
    token = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, token, side="right") - 1, 0, page_indices.shape[0] - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    position = kv_lens[seq] - q_len + (token - cu_q_lens[seq])
    pages = kv_pages[page_indices[seq]]  # [T, P, page_size, 2 * kv_heads, head_dim]
    pages = pages.reshape(num_tokens, num_pages_per_seq * page_size, kv_heads, 2, head_dim).astype(jnp.float32)
    keys, values = pages[..., 0, :], pages[..., 1, :]
    grouped = q.reshape(num_tokens, kv_heads, num_heads // kv_heads, head_dim).astype(jnp.float32)
    scores = jnp.einsum("thgd,tkhd->thgk", grouped, keys) * sm_scale
    visible = jnp.arange(keys.shape[1])[None, :] <= position[:, None]
    scores = jnp.where(visible[:, None, None, :], scores, NEG_INF)
    out = jnp.einsum("thgk,tkhd->thgd", jax.nn.softmax(scores, axis=-1), values)
    real = token < cu_q_lens[num_seqs[0]]
    return jnp.where(real[:, None, None, None], out, 0.0).reshape(q.shape).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class RaggedPagedAttention:
    """An `AttentionBackend` over `CombinedPages` that calls a ragged paged attention kernel."""

    kernel: RaggedKernel
    block_tokens: int = 128  # keys per kernel block (engine.attention_block_tokens), in whole pages
    query_tile: int = 16  # queries per kernel block (engine.attention_query_tile)
    model_parallel: int = 1  # devices on the replica mesh's model axis

    @classmethod
    def tpu_kernel(cls, **settings) -> RaggedPagedAttention:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

        return cls(ragged_paged_attention, **settings)

    @classmethod
    def plain_jax(cls, **settings) -> RaggedPagedAttention:
        return cls(contract_reference, **settings)

    def layout_for(self, kv_heads: int, head_dim: int, dtype: jnp.dtype) -> CombinedPages:
        return CombinedPages.for_mosaic(kv_heads, head_dim, dtype, self.model_parallel)

    def _block_sizes(self, num_tokens: int, page_size: int, pages_per_seq: int) -> dict[str, int]:
        """The engine's block settings, not the kernel's auto-tuned table: JAX's table covers short
        contexts only and otherwise falls back to 128 pages a block, a double buffer that can exceed
        the VMEM of a v5e with Llama-3-8B's heads. A block tiles the page table exactly."""
        pages = largest_divisor_at_most(pages_per_seq, max(1, self.block_tokens // page_size))
        return dict(num_kv_pages_per_block=pages, num_queries_per_block=min(self.query_tile, num_tokens))

    def attend(self, q: jax.Array, cache: jax.Array, meta: AttentionMetadata, scale: float,
               layout: CombinedPages) -> jax.Array:
        if self.model_parallel == 1:
            return self._attend_local(q, cache, meta, scale, layout)
        local = functools.partial(self._attend_local, scale=scale, layout=layout.local())
        return on_each_model_device(local, q, cache, meta, model_parallel=self.model_parallel, layout=layout)

    def _attend_local(self, q: jax.Array, cache: jax.Array, meta: AttentionMetadata, scale: float,
                      layout: CombinedPages) -> jax.Array:
        num_tokens, num_heads, head_dim = q.shape
        group = num_heads // layout.kv_heads
        grouped = layout.pad_heads(q.reshape(num_tokens, layout.kv_heads, group, head_dim).astype(cache.dtype))
        segments = ragged_segments(meta, cache.shape[1])
        out = self.kernel(
            grouped.reshape(num_tokens, -1, layout.padded_head_dim), cache, segments.kv_lens,
            segments.page_indices, segments.cu_q_lens, segments.num_seqs, sm_scale=scale,
            **self._block_sizes(num_tokens, cache.shape[1], meta.page_table.shape[1]),
        )
        out = layout.strip_heads(out.reshape(grouped.shape))
        return jnp.where(segments.real[:, None, None, None], out, 0).reshape(q.shape).astype(q.dtype)
