"""Paged attention as a Pallas GPU (Triton) kernel that reads KV pages in place.

The flat ragged batch is cut into query tiles: up to ``query_tile`` consecutive tokens of one
sequence (`query_tiles`, computed on the device from the step's metadata). One program per
(tile, kv head) loads the tile's query heads of that kv head (tokens x GQA group, at least 16 rows
for the tensor-core dot), walks the sequence through the page table in blocks of ``block_pages``
pages, loads each block's pages straight from the page pools (``k_ref[page_ids]``, no gather copy in
HBM) and keeps an online softmax in float32. A prefill chunk thus reads its keys once per tile, not
once per token; a decode token is a tile of its own. A step with no more tokens than page-table rows
(a decode batch fits that) takes narrow tiles, of just enough tokens for the dot's 16 rows.
Causality comes from positions: a token sees the keys at positions up to its own, so prefill
chunks, decode tokens and speculative verification tokens all take the same path. The step's
padding tokens form tiles of their own that write zeros.

The cache layout is the reference backend's, ``[kv_heads, num_pages, page_size, head_dim]`` per
layer (``kv_layout.SplitPages``), so the two backends are interchangeable. Quantized pages
(``kv_dtype = "int8" | "fp8"``, ``layers/kv_quant.py``) are read as they are stored: a block's values
are widened to the query's dtype (exact for int8 and e4m3) and their scales multiply the scores'
columns and the softmax weights, so no dequantized block is formed. With
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

from jaxinfer.layers.attention import NEG_INF, AttentionMetadata, SplitLayout, on_each_model_device, real_tokens
from jaxinfer.layers.kv_layout import KVCache, SplitPages
from jaxinfer.layers.kv_quant import QuantizedKV, stored_values

MIN_DOT_ROWS = 16  # Triton's tensor-core dot needs at least 16 rows
# Register budget on sm_90 (ptxas -v on the kernel's Triton IR, bf16, head_dim 128): 64 query rows
# against 128-key blocks spill, as do 256 rows against any block; 128 rows against 64-key blocks fit.
MAX_TILE_ROWS = 128
WIDE_TILE_ROWS, WIDE_TILE_KEYS = 64, 64  # from 64 rows on, key blocks of at most 64 tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryTiles:
    """The batch cut into tiles of consecutive tokens of one sequence, padded to a static count.

    Tiles past the used ones have ``length`` 0; they and the padding tokens' tiles have ``row`` -1."""

    start: jax.Array  # [M] first token of the tile in the flat batch
    length: jax.Array  # [M] tokens in the tile (at most the tile size)
    row: jax.Array  # [M] the tile's page-table row, -1 for padding
    first_position: jax.Array  # [M] position of the tile's first token (the rest follow it)


def max_query_tiles(num_tokens: int, num_rows: int, tile_tokens: int) -> int:
    """A bound on the tiles of any batch: each of the rows and the padding adds at most one partial tile."""
    return -(-num_tokens // tile_tokens) + num_rows + 1


def query_tiles(meta: AttentionMetadata, tile_tokens: int) -> QueryTiles:
    """Cuts each row's tokens, and the padding after them, into tiles of at most `tile_tokens` tokens."""
    rows, positions = meta.seq_rows, meta.positions
    num_tokens = rows.shape[0]
    token = jnp.arange(num_tokens)
    real = real_tokens(meta)
    # A run is one row's tokens, or all the padding; a run's first token is where the row changes or
    # where the padding begins.
    previous_real = jnp.concatenate([jnp.ones(1, bool), real[:-1]])
    changes = jnp.concatenate([jnp.ones(1, bool), rows[1:] != rows[:-1]])
    run_begins = (real & changes) | (~real & previous_real)
    run_first = lax.cummax(jnp.where(run_begins, token, 0))
    run_last = lax.cummin(jnp.where(jnp.append(run_begins[1:], True), token, num_tokens), reverse=True)
    begins_tile = (token - run_first) % tile_tokens == 0
    bound = max_query_tiles(num_tokens, meta.page_table.shape[0], tile_tokens)
    (start,) = jnp.nonzero(begins_tile, size=bound, fill_value=num_tokens)
    used = start < num_tokens
    first = jnp.minimum(start, num_tokens - 1)
    length = jnp.where(used, jnp.minimum(tile_tokens, run_last[first] + 1 - start), 0)
    row = jnp.where(used & real[first], rows[first], -1)
    return QueryTiles(start.astype(jnp.int32), length.astype(jnp.int32), row.astype(jnp.int32),
                      positions[first])


def _key_scales(scale_ref, page_ids: jax.Array, page_size: int) -> jax.Array:
    """The scales of a block's keys [block_pages * page_size]: stored per row, or per page (repeated)."""
    scales = scale_ref[page_ids]
    if scales.ndim == 1:
        scales = jnp.broadcast_to(scales[:, None], (scales.shape[0], page_size))
    return scales.reshape(-1)


def _kernel(start_ref, length_ref, row_ref, first_ref, page_table_ref, q_ref, k_ref, v_ref, *refs,
            tile_tokens: int, block_pages: int, scale: float) -> None:
    *scale_refs, o_ref = refs  # quantized pages: the K and V scales
    start, length, row, first = start_ref[0], length_ref[0], row_ref[0], first_ref[0]
    group, head_dim = q_ref.shape[1:]
    page_size = k_ref.shape[-2]
    block_len, rows = block_pages * page_size, tile_tokens * group
    in_tile = lax.broadcasted_iota(jnp.int32, (tile_tokens, group, head_dim), 0) < length
    q = pl_triton.load(q_ref.at[pl.ds(start, tile_tokens)], mask=in_tile, other=0).reshape(rows, head_dim)
    query_positions = first + lax.broadcasted_iota(jnp.int32, (rows, block_len), 0) // group

    def visit(block: jax.Array, carry):
        best, total, acc = carry
        page_ids = page_table_ref[row, pl.ds(block * block_pages, block_pages)]
        keys = stored_values(k_ref[page_ids]).reshape(block_len, head_dim).astype(q.dtype)
        values = stored_values(v_ref[page_ids]).reshape(block_len, head_dim).astype(q.dtype)
        scores = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        if scale_refs:
            key_scales, value_scales = (_key_scales(r, page_ids, page_size) for r in scale_refs)
            scores = scores * key_scales[None, :]
        key_positions = block * block_len + lax.broadcasted_iota(jnp.int32, (rows, block_len), 1)
        scores = jnp.where(key_positions <= query_positions, scores, NEG_INF)
        new_best = jnp.maximum(best, scores.max(axis=-1))
        weights = jnp.exp(scores - new_best[:, None])
        correction = jnp.exp(best - new_best)
        total = total * correction + weights.sum(axis=-1)
        if scale_refs:
            weights = weights * value_scales[None, :]  # after the sum: the scales weigh values, not keys
        acc = acc * correction[:, None] + lax.dot_general(
            weights.astype(values.dtype), values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return new_best, total, acc

    # A row's blocks end with its page table: a draft row past its budget keeps counting positions
    # (its output is dropped), and reading past the table would leave the row.
    table_blocks = page_table_ref.shape[1] // block_pages
    last_position = first + length - 1
    num_blocks = jnp.where(row >= 0, jnp.minimum(last_position // block_len + 1, table_blocks), 0)
    init = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    _, total, acc = lax.fori_loop(0, num_blocks, visit, init)
    out = acc / jnp.where(total > 0, total, 1.0)[:, None]  # padding tiles visit nothing and write zeros
    pl_triton.store(o_ref.at[pl.ds(start, tile_tokens)], out.reshape(tile_tokens, group, head_dim).astype(o_ref.dtype),
                    mask=in_tile)


def warps_for(rows: int) -> int:
    """Warps of a program with `rows` query rows."""
    return 4 if rows <= 64 else 8


@dataclasses.dataclass(frozen=True)
class PallasGpuAttention(SplitLayout):
    """The ``AttentionBackend`` of GPUs: ragged paged attention in one Pallas kernel per layer."""

    block_tokens: int = 128
    query_tile: int = 16  # tokens of one sequence per program (engine.attention_query_tile)
    interpret: bool = False  # run through Pallas's interpreter (CPU tests)
    model_parallel: int = 1  # devices on the replica mesh's model axis
    kv_dtype: str = "auto"  # auto | int8 | fp8 (SplitLayout picks the pages' layout)

    def attend(self, q: jax.Array, cache: KVCache, meta: AttentionMetadata, scale: float,
               layout: SplitPages | None = None) -> jax.Array:
        """`layout` (the model passes it) is needed only to split the kernel over a model axis."""
        if self.model_parallel == 1:
            return self._attend_local(q, cache, meta, scale)
        return on_each_model_device(functools.partial(self._attend_local, scale=scale), q, cache, meta,
                                    model_parallel=self.model_parallel, layout=layout)

    def _attend_local(self, q: jax.Array, cache: KVCache | QuantizedKV, meta: AttentionMetadata, scale: float
                      ) -> jax.Array:
        k_cache, v_cache = cache[0], cache[1]
        scales = tuple(cache[2:])
        num_tokens, num_heads, head_dim = q.shape
        kv_heads, num_pages, page_size, _ = k_cache.shape
        group = num_heads // kv_heads
        padded_group = pl.next_power_of_2(group)
        # A bucket with no more tokens than rows may be all decode tokens (one per row): narrow tiles.
        tile_tokens = self.tile_tokens(group, wide=num_tokens > meta.page_table.shape[0])
        grouped = q.reshape(num_tokens, kv_heads, group, head_dim).astype(q.dtype if scales else k_cache.dtype)
        grouped = jnp.pad(grouped, ((0, 0), (0, 0), (0, padded_group - group), (0, 0)))
        block_pages = self._block_pages(page_size, meta.page_table.shape[1], tile_tokens * padded_group)
        tiles = query_tiles(meta, tile_tokens)
        pool = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda t, h: (h, 0, 0, 0))
        per_tile = pl.BlockSpec((1,), lambda t, h: (t,))
        every_token = pl.BlockSpec((num_tokens, None, padded_group, head_dim), lambda t, h: (0, h, 0, 0))
        scale_pools = [pl.BlockSpec((None, *s.shape[1:]), lambda t, h, n=s.ndim: (h,) + (0,) * (n - 1)) for s in scales]
        out = pl.pallas_call(
            functools.partial(_kernel, tile_tokens=tile_tokens, block_pages=block_pages, scale=scale),
            grid=(tiles.start.shape[0], kv_heads),
            in_specs=[per_tile] * 4 + [pl.BlockSpec(meta.page_table.shape, lambda t, h: (0, 0)), every_token,
                                       pool, pool, *scale_pools],
            out_specs=every_token,
            out_shape=jax.ShapeDtypeStruct(grouped.shape, q.dtype),
            interpret=self.interpret,
            compiler_params=pl_triton.CompilerParams(num_warps=warps_for(tile_tokens * padded_group), num_stages=2),
            name="jaxinfer_paged_attention",
        )(tiles.start, tiles.length, tiles.row, tiles.first_position, meta.page_table, grouped, k_cache, v_cache,
          *scales)
        return out[:, :, :group].reshape(num_tokens, num_heads, head_dim)

    def tile_tokens(self, group: int, wide: bool = True) -> int:
        """Tokens per query tile: a power of two (Triton's blocks), with enough rows for the tensor-core dot
        and no more than fit in registers (`MAX_TILE_ROWS`). Narrow tiles (`wide=False`) hold just enough
        tokens for the dot's 16 rows, so a decode token, alone in its tile, does not carry 16 tokens' rows."""
        padded_group = pl.next_power_of_2(group)
        narrow = pl.next_power_of_2(-(-MIN_DOT_ROWS // padded_group))
        tokens = pl.next_power_of_2(max(self.query_tile, narrow)) if wide else narrow
        return max(1, min(tokens, MAX_TILE_ROWS // padded_group))

    def _block_pages(self, page_size: int, table_width: int, rows: int) -> int:
        """Pages per loop iteration for a tile of `rows` query rows: a power of two (Triton's loads) that
        tiles the page table, of at most 64 keys for wide tiles."""
        block_tokens = self.block_tokens if rows < WIDE_TILE_ROWS else min(self.block_tokens, WIDE_TILE_KEYS)
        pages = max(1, block_tokens // page_size)
        while pages > 1 and (table_width % pages or pages & (pages - 1)):
            pages //= 2
        return pages
