"""Paged attention as a Pallas GPU (Triton) kernel that reads KV pages in place.

One program per (token, kv head) of the flat ragged batch: it loads the token's query heads of that
kv head (the GQA group, padded to at least 16 rows for the tensor-core dot), walks the token's own
sequence through the page table in blocks of ``block_pages`` pages, loads each block's pages
straight from the page pools (``k_ref[page_ids]``, no gather copy in HBM), and keeps an online
softmax in float32. Causality comes from positions: a token sees the keys at positions up to its
own, so prefill chunks, decode tokens and speculative verification tokens all take the same path.

The cache layout is the reference backend's, ``[kv_heads, num_pages, page_size, head_dim]`` per
layer (``kv_layout.SplitPages``), so the two backends are interchangeable. With
``interpret=True`` the kernel runs on the CPU through Pallas's interpreter (the tests do that).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxinfer.layers.attention import NEG_INF, AttentionMetadata, SplitLayout, on_each_model_device
from jaxinfer.layers.kv_layout import KVCache, SplitPages

MIN_DOT_ROWS = 16  # Triton's tensor-core dot needs at least 16 rows


def _kernel(rows_ref, positions_ref, page_table_ref, q_ref, k_ref, v_ref, o_ref, *, block_pages: int,
            scale: float) -> None:
    row, position = rows_ref[0], positions_ref[0]
    page_size, head_dim = k_ref.shape[-2], k_ref.shape[-1]
    block_len = block_pages * page_size
    q = q_ref[...]
    group = q.shape[0]

    def visit(block: jax.Array, carry):
        best, total, acc = carry
        page_ids = page_table_ref[row, pl.ds(block * block_pages, block_pages)]
        keys = k_ref[page_ids].reshape(block_len, head_dim)
        values = v_ref[page_ids].reshape(block_len, head_dim)
        scores = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        key_positions = block * block_len + lax.broadcasted_iota(jnp.int32, (group, block_len), 1)
        scores = jnp.where(key_positions <= position, scores, NEG_INF)
        new_best = jnp.maximum(best, scores.max(axis=-1))
        weights = jnp.exp(scores - new_best[:, None])
        correction = jnp.exp(best - new_best)
        total = total * correction + weights.sum(axis=-1)
        acc = acc * correction[:, None] + lax.dot_general(
            weights.astype(values.dtype), values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return new_best, total, acc

    init = (jnp.full((group,), NEG_INF, jnp.float32), jnp.zeros((group,), jnp.float32),
            jnp.zeros((group, head_dim), jnp.float32))
    _, total, acc = lax.fori_loop(0, position // block_len + 1, visit, init)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)


@dataclasses.dataclass(frozen=True)
class PallasGpuAttention(SplitLayout):
    """The ``AttentionBackend`` of GPUs: ragged paged attention in one Pallas kernel per layer."""

    block_tokens: int = 128
    interpret: bool = False  # run through Pallas's interpreter (CPU tests)
    model_parallel: int = 1  # devices on the replica mesh's model axis

    def attend(self, q: jax.Array, cache: KVCache, meta: AttentionMetadata, scale: float,
               layout: SplitPages | None = None) -> jax.Array:
        """`layout` (the model passes it) is needed only to split the kernel over a model axis."""
        if self.model_parallel == 1:
            return self._attend_local(q, cache, meta, scale)
        return on_each_model_device(functools.partial(self._attend_local, scale=scale), q, cache, meta,
                                    model_parallel=self.model_parallel, layout=layout)

    def _attend_local(self, q: jax.Array, cache: KVCache, meta: AttentionMetadata, scale: float) -> jax.Array:
        k_cache, v_cache = cache
        num_tokens, num_heads, head_dim = q.shape
        kv_heads, num_pages, page_size, _ = k_cache.shape
        group = num_heads // kv_heads
        rows = max(MIN_DOT_ROWS, pl.next_power_of_2(group))
        grouped = q.reshape(num_tokens, kv_heads, group, head_dim).astype(k_cache.dtype)
        grouped = jnp.pad(grouped, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
        block_pages = self._block_pages(page_size, meta.page_table.shape[1])
        pool = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda t, h: (h, 0, 0, 0))
        per_token = pl.BlockSpec((1,), lambda t, h: (t,))
        out = pl.pallas_call(
            functools.partial(_kernel, block_pages=block_pages, scale=scale),
            grid=(num_tokens, kv_heads),
            in_specs=[
                per_token,
                per_token,
                pl.BlockSpec(meta.page_table.shape, lambda t, h: (0, 0)),
                pl.BlockSpec((None, None, rows, head_dim), lambda t, h: (t, h, 0, 0)),
                pool,
                pool,
            ],
            out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda t, h: (t, h, 0, 0)),
            out_shape=jax.ShapeDtypeStruct((num_tokens, kv_heads, rows, head_dim), q.dtype),
            interpret=self.interpret,
            compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
            name="jaxinfer_paged_attention",
        )(meta.seq_rows, meta.positions, meta.page_table, grouped, k_cache, v_cache)
        return out[:, :, :group].reshape(num_tokens, num_heads, head_dim)

    def _block_pages(self, page_size: int, table_width: int) -> int:
        """Pages per loop iteration: a power of two (Triton's loads) that tiles the page table."""
        pages = max(1, self.block_tokens // page_size)
        while pages > 1 and (table_width % pages or pages & (pages - 1)):
            pages //= 2
        return pages
