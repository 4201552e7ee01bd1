"""Paged attention over a ragged batch: the metadata the step passes, and the backends.

Each backend names the layout of a layer's KV cache (`layers.kv_layout`). The reference and GPU
backends use a pair of page pools `[kv_heads, num_pages, page_size, head_dim]` (`SplitPages`).
Heads come first so that a gathered block, `[kv_heads, (tokens,) pages, page_size, head_dim]`, is
already in the layout of the batched attention matmuls (batch dims leading) and is not transposed
after the gather. On the CPU this made prefill attention 1.6-1.8x faster than pages-first (decode
15-25% slower) and the offline benchmark 25% faster; positions before heads was about 9x slower.
Page 0 is the null page: padding tokens write there and nothing real is ever read from it.

A batch is a flat array of T tokens from up to S sequences; each sequence's tokens are contiguous,
at consecutive positions, in row order. Padding tokens follow the real ones: they carry the last
real row and position 0 and write to the null page.
`ReferenceAttention` works on the CPU (and anywhere): it walks the tokens in tiles, and the keys of
each tile in blocks of pages with an online softmax, so memory stays bounded for long contexts. A
tile whose tokens all belong to one sequence (a prefill chunk) gathers each key block once; a mixed
tile (decode tokens of different sequences) gathers per token. Accelerator kernels implement the
same `AttentionBackend` protocol and plug in without touching the model; `layers/backends.py`, above
them all, picks one by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from jaxinfer.layers.kv_layout import KVCache, KVLayout, SplitPages
from jaxinfer.layers.kv_quant import Fp8SplitPages, Int8SplitPages, QuantizedKV, dequantize_block
from jaxinfer.parallel.mesh import MESH_AXES

NEG_INF = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-step device arrays describing the ragged batch (all int32)."""

    positions: jax.Array  # [T] position of each token in its sequence
    seq_rows: jax.Array  # [T] row of `page_table` each token belongs to
    page_table: jax.Array  # [S, P] page ids per sequence row (0 = null page)
    write_slots: jax.Array  # [T] page * page_size + offset where each token's K/V goes (0 for padding)


class AttentionBackend(Protocol):
    """Attention over one layer's paged cache; the backend decides the cache's layout (`layers.kv_layout`)."""

    def layout_for(self, kv_heads: int, head_dim: int, dtype: jnp.dtype) -> KVLayout: ...

    def attend(self, q: jax.Array, cache: Any, meta: AttentionMetadata, scale: float, layout: KVLayout) -> jax.Array:
        """Attention of the batch's queries [T, heads, head_dim] over `cache` (laid out by `layout`)."""


def largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def real_tokens(meta: AttentionMetadata) -> jax.Array:
    """[T] bool, False for the step's padding. The first padding token is the first that repeats the
    previous token's row without continuing its positions (padding carries the last row and position 0;
    a row's real tokens are contiguous at consecutive positions)."""
    rows, positions = meta.seq_rows, meta.positions
    breaks = (rows[1:] == rows[:-1]) & (positions[1:] != positions[:-1] + 1)
    num_real = jnp.argmax(jnp.append(breaks, True)) + 1  # the appended break: no padding, all T are real
    return jnp.arange(rows.shape[0]) < num_real


def on_each_model_device(local_attend: Callable[..., jax.Array], q: jax.Array, cache: Any, meta: AttentionMetadata,
                         *, model_parallel: int, layout: KVLayout) -> jax.Array:
    """Runs a kernel's attention in `shard_map` over the model axis of a replica's mesh (data x expert x
    model, data 1; expert 1, since `LLM` refuses these kernels beside expert parallelism). A Pallas
    call is opaque to XLA's partitioner, which would gather whole KV pools onto every device to run it.
    Where the layout splits the kv heads over the axis, each device attends with its own kv heads and
    the query heads of their groups; where it keeps them whole (the axis does not divide them), every
    device attends with all of them."""
    cache_spec = layout.heads_spec(model_parallel)
    mesh = AbstractMesh((1, 1, model_parallel), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    heads = PartitionSpec(None, "model", None) if cache_spec is not None else PartitionSpec()
    cache_specs = jax.tree.map(lambda _: cache_spec or PartitionSpec(), cache)
    return jax.shard_map(local_attend, mesh=mesh, in_specs=(heads, cache_specs, PartitionSpec()), out_specs=heads,
                         check_vma=False)(q, cache, meta)


class SplitLayout:
    """For backends that read separate K and V pools, heads first (`kv_layout.SplitPages`), in the
    backend's `kv_dtype` (`layers/kv_quant.py` for int8 and fp8)."""

    kv_dtype: str = "auto"

    def layout_for(self, kv_heads: int, head_dim: int, dtype: jnp.dtype) -> SplitPages:
        layout = {"int8": Int8SplitPages, "fp8": Fp8SplitPages}.get(self.kv_dtype, SplitPages)
        return layout(kv_heads, head_dim)


@dataclasses.dataclass(frozen=True)
class ReferenceAttention(SplitLayout):
    """Gather-based paged attention in plain JAX; exact (float32 softmax) and backend-neutral. With
    `kv_dtype = "int8" | "fp8"` its pages are quantized (`layers/kv_quant.py`), dequantized a block at
    a time."""

    block_tokens: int = 128
    query_tile: int = 16
    kv_dtype: str = "auto"

    def attend(self, q: jax.Array, cache: KVCache | QuantizedKV, meta: AttentionMetadata, scale: float,
               layout: KVLayout | None = None) -> jax.Array:
        k_cache, v_cache = cache[0], cache[1]
        scales = (cache.k_scale, cache.v_scale) if isinstance(cache, QuantizedKV) else (None, None)
        num_tokens, num_heads, head_dim = q.shape
        kv_heads, page_size = k_cache.shape[0], k_cache.shape[2]
        group = num_heads // kv_heads
        # A block must tile the page table exactly: dynamic_slice would clamp a ragged last block.
        block_pages = largest_divisor_at_most(meta.page_table.shape[1], max(1, self.block_tokens // page_size))
        tile = largest_divisor_at_most(num_tokens, self.query_tile)
        num_tiles = num_tokens // tile
        q_tiles = q.reshape(num_tiles, tile, kv_heads, group, head_dim)
        pos_tiles = meta.positions.reshape(num_tiles, tile)
        row_tiles = meta.seq_rows.reshape(num_tiles, tile)
        block = _BlockAttention(k_cache, v_cache, meta.page_table, block_pages, page_size, scale, *scales)

        def one_tile(i: jax.Array) -> jax.Array:
            q_i, pos_i, rows_i = q_tiles[i], pos_tiles[i], row_tiles[i]
            if tile == 1:  # one token is always one sequence
                return block.shared_sequence(q_i, pos_i, rows_i)
            single = jnp.all(rows_i == rows_i[0])
            return lax.cond(single, block.shared_sequence, block.per_token, q_i, pos_i, rows_i)

        out = one_tile(0)[None] if num_tiles == 1 else lax.map(one_tile, jnp.arange(num_tiles))
        return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class _BlockAttention:
    """Online-softmax attention of one query tile over its keys, one block of pages at a time."""

    k_cache: jax.Array
    v_cache: jax.Array
    page_table: jax.Array
    block_pages: int
    page_size: int
    scale: float
    k_scale: jax.Array | None = None  # quantized pages: each row's or page's scale (layers/kv_quant.py)
    v_scale: jax.Array | None = None

    def shared_sequence(self, q: jax.Array, pos: jax.Array, rows: jax.Array) -> jax.Array:
        pages_of_row = self.page_table[rows[0]]

        def keys(b: jax.Array) -> tuple[jax.Array, jax.Array]:
            ids = lax.dynamic_slice_in_dim(pages_of_row, b * self.block_pages, self.block_pages)
            return self._gather(ids[None]), self._gather(ids[None], values=True)

        return self._run(q, pos, keys, "ktgd,kld->ktgl", "ktgl,kld->ktgd")

    def per_token(self, q: jax.Array, pos: jax.Array, rows: jax.Array) -> jax.Array:
        pages = self.page_table[rows]

        def keys(b: jax.Array) -> tuple[jax.Array, jax.Array]:
            ids = lax.dynamic_slice_in_dim(pages, b * self.block_pages, self.block_pages, axis=1)
            return self._gather(ids[None]), self._gather(ids[None], values=True)

        return self._run(q, pos, keys, "ktgd,ktld->ktgl", "ktgl,ktld->ktgd")

    def _gather(self, ids: jax.Array, values: bool = False) -> jax.Array:
        """Pages `ids` [1, ..., block_pages] of every head -> [kv_heads, ..., keys, head_dim].

        Indexing heads and pages together makes the gather's own output layout heads-first, so
        nothing is transposed after it (`cache[:, ids]` would gather pages-first and transpose).
        """
        cache = self.v_cache if values else self.k_cache
        heads = jnp.arange(cache.shape[0]).reshape((-1,) + (1,) * (ids.ndim - 1))
        block = cache[heads, ids]
        row_scales = self.v_scale if values else self.k_scale
        if row_scales is not None:
            block = dequantize_block(block, row_scales[heads, ids])
        *lead, nb, ps, d = block.shape
        return block.reshape(*lead, nb * ps, d)

    def _run(self, q, pos, keys, score_eq: str, value_eq: str) -> jax.Array:
        """Online softmax over key blocks, kv heads leading (the layout of the gathered keys)."""
        tile, kv_heads, group, head_dim = q.shape
        block_len = self.block_pages * self.page_size
        num_blocks = jnp.max(pos) // block_len + 1
        qf = jnp.swapaxes(q.astype(jnp.float32) * self.scale, 0, 1)  # [kv_heads, tile, group, head_dim]

        def body(b, carry):
            m, denom, acc = carry
            k, v = keys(b)
            s = jnp.einsum(score_eq, qf, k.astype(jnp.float32))
            key_pos = b * block_len + jnp.arange(block_len)
            visible = (key_pos[None, :] <= pos[:, None])[None, :, None, :]
            s = jnp.where(visible, s, NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            denom = denom * correction + jnp.sum(p, axis=-1)
            acc = acc * correction[..., None] + jnp.einsum(value_eq, p, v.astype(jnp.float32))
            return m_new, denom, acc

        init = (
            jnp.full((kv_heads, tile, group), NEG_INF, jnp.float32),
            jnp.zeros((kv_heads, tile, group), jnp.float32),
            jnp.zeros((kv_heads, tile, group, head_dim), jnp.float32),
        )
        _, denom, acc = lax.fori_loop(0, num_blocks, body, init)
        return jnp.swapaxes(acc / denom[..., None], 0, 1)


@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """Causal attention over each sequence's own tokens with no KV cache, for training (tools/train_draft.py).

    Its "cache" is the step's own keys and values (`PassThrough`); `attend` treats the flat tokens as
    `batch` contiguous sequences of `seq_len` tokens."""

    seq_len: int

    def layout_for(self, kv_heads: int, head_dim: int, dtype: jnp.dtype) -> PassThrough:
        return PassThrough()

    def attend(self, q: jax.Array, cache: KVCache, meta: AttentionMetadata, scale: float,
               layout: KVLayout | None = None) -> jax.Array:
        k, v = cache
        tokens, heads, dim = q.shape
        kv_heads, length = k.shape[1], self.seq_len
        q = q.reshape(tokens // length, length, kv_heads, heads // kv_heads, dim)
        k = k.reshape(tokens // length, length, kv_heads, dim)
        v = v.reshape(tokens // length, length, kv_heads, dim)
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
        causal = jnp.tril(jnp.ones((length, length), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", weights.astype(v.dtype), v)
        return out.reshape(tokens, heads, dim)


@dataclasses.dataclass(frozen=True)
class PassThrough:
    """The layout of `DenseAttention`: no pages, the new keys and values are the cache."""

    def update(self, cache: Any, k: jax.Array, v: jax.Array, slots: jax.Array) -> KVCache:
        return KVCache(k, v)
