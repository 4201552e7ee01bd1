"""Ragged attention batches for the kernel tests: sequences with cached context and new tokens, their
pages handed out in a shuffled order (a sequence's pages are scattered through the pool; page 0 stays
the null page), in the split layout that the reference backend reads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.layers.attention import AttentionMetadata, ReferenceAttention
from jaxinfer.layers.kv_layout import KVCache, KVLayout, SplitPages

HEAD_DIM = 32


def ragged_batch(sequences: list[tuple[int, int]], *, kv_heads: int, group: int, page_size: int,
                 table_width: int, seed: int = 0, head_dim: int = HEAD_DIM):
    """sequences: (tokens already cached, new tokens) per sequence; returns q, caches and metadata."""
    rng = np.random.default_rng(seed)
    needed = sum(-(-(cached + new) // page_size) for cached, new in sequences)
    num_pages = needed + 3
    free = list(rng.permutation(np.arange(1, num_pages)))
    page_table = np.zeros((len(sequences), table_width), np.int32)
    positions, rows = [], []
    k_cache = np.zeros((kv_heads, num_pages, page_size, head_dim), np.float32)
    v_cache = np.zeros_like(k_cache)
    for row, (cached, new) in enumerate(sequences):
        length = cached + new
        for index in range(-(-length // page_size)):
            page_table[row, index] = free.pop()
        for position in range(length):
            page, offset = page_table[row, position // page_size], position % page_size
            k_cache[:, page, offset] = rng.standard_normal((kv_heads, head_dim))
            v_cache[:, page, offset] = rng.standard_normal((kv_heads, head_dim))
        positions += range(cached, length)
        rows += [row] * new
    q = rng.standard_normal((len(positions), kv_heads * group, head_dim)).astype(np.float32)
    meta = AttentionMetadata(jnp.asarray(positions, jnp.int32), jnp.asarray(rows, jnp.int32),
                             jnp.asarray(page_table), jnp.zeros(len(positions), jnp.int32))
    return jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), meta


def with_padding(meta: AttentionMetadata, extra: int) -> AttentionMetadata:
    """The step's padding: `extra` tokens with the last row, position 0, writing to the null page."""
    pad = jnp.full(extra, meta.seq_rows[-1], jnp.int32)
    return AttentionMetadata(jnp.concatenate([meta.positions, jnp.zeros(extra, jnp.int32)]),
                             jnp.concatenate([meta.seq_rows, pad]), meta.page_table,
                             jnp.concatenate([meta.write_slots, jnp.zeros(extra, jnp.int32)]))


CASES = {
    "prefill_only": [(0, 24), (0, 9)],
    "decode_only": [(40, 1), (7, 1), (63, 1), (1, 1)],
    "mixed": [(30, 1), (0, 17), (12, 1), (5, 6)],
    "many_pages": [(200, 1), (150, 10)],
}


def moved_into(layout: KVLayout, k_cache: jax.Array, v_cache: jax.Array, mesh=None):
    """The split-layout pools' pages in `layout` (sharded on `mesh` when given), moved through the
    layouts' neutral form."""
    kv_heads, num_pages, page_size, head_dim = k_cache.shape
    every_page = jnp.arange(num_pages)
    neutral = jax.jit(SplitPages(kv_heads, head_dim).export)(KVCache(k_cache, v_cache), every_page)
    empty = layout.empty(num_pages, page_size, k_cache.dtype, mesh)
    return jax.jit(layout.import_pages)(empty, every_page, neutral)


def reference_output(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: AttentionMetadata, scale: float,
                     **options) -> jax.Array:
    """The split-layout reference backend's output, run as one program (op by op, each case's shapes
    would compile every op anew)."""
    backend = ReferenceAttention(**options)
    return jax.jit(lambda q, cache, meta: backend.attend(q, cache, meta, scale))(q, KVCache(k_cache, v_cache), meta)
