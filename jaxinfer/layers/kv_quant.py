"""Quantized KV pages (`engine.kv_dtype`), both in the split layout:

- `int8`: each token's key and value of each head stored as int8 values and one float32 scale (its
  largest magnitude / 127);
- `fp8`: float8 e4m3 values and one float32 scale per page and head (its largest magnitude / 448,
  e4m3's largest finite value). A write that raises a page's scale re-rounds the page's earlier
  values to the new scale, and a write to a page's first slot starts the page afresh (the page was
  just handed out, or everything after that slot is being rewritten). The pools hold the e4m3 bits
  as uint8: XLA's CPU backend has no float8 scatter and widens the whole pool around each one
  (measured 5.7 ms per layer and step against int8's 0.04 ms), while a byte scatter is native
  everywhere; values are bitcast to e4m3 where they are read.

- On the device: `QuantizedKV` holds the int8 K and V pools `[kv_heads, num_pages, page_size,
  head_dim]` and their scales `[kv_heads, num_pages, page_size]`. The reference attention backend
  dequantizes each gathered block of keys and values (`layers.attention`).
- Leaving the device (KV tiers, the prefill/decode channel): one int8 array per page, as every
  layout's pages leave, `[pages, 2, kv_heads, page_size, head_dim + 4]`. The last 4 bytes of a row are
  its scale's float32 bits, so the tiers and the store move values and scales together, unchanged.
  fp8 pages leave as uint8 bytes, each row its fp8 values then the page's scale (repeated on every
  row). A store's model identity (int8 or uint8, head_dim + 4) keeps such pages apart from float ones
  and from each other.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer.layers.kv_layout import SPLIT_AXES, SplitPages, pool_zeros

SCALE_BYTES = 4  # a float32 scale, carried as int8 bytes in a page's stored form


FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


class QuantizedKV(NamedTuple):
    """One layer's quantized K and V pools and their scales: per token and head
    `[kv_heads, num_pages, page_size]` (int8), or per page and head `[kv_heads, num_pages]` (fp8)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> (int8 values, float32 scales [...]): symmetric, one scale per row."""
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    values = jnp.clip(jnp.round(xf / safe[..., None]), -127, 127).astype(jnp.int8)
    return values, scale


def stored_values(values: jax.Array) -> jax.Array:
    """Gathered pool values as numbers: int8 as they are, fp8 pools' uint8 bits as e4m3."""
    return jax.lax.bitcast_convert_type(values, FP8) if values.dtype == jnp.uint8 else values


def dequantize_block(values: jax.Array, scale: jax.Array) -> jax.Array:
    """Gathered values [..., page_size, head_dim] times their scales: [..., page_size] per row, or
    [...] per page."""
    scale = scale.reshape(scale.shape + (1,) * (values.ndim - scale.ndim))
    return stored_values(values).astype(jnp.float32) * scale


@dataclasses.dataclass(frozen=True)
class Int8SplitPages(SplitPages):
    """`SplitPages` in int8 with row scales: the same heads-first pools and head split over the model axis."""

    def empty(self, num_pages: int, page_size: int, dtype: jnp.dtype, mesh: Mesh | None = None) -> QuantizedKV:
        shape = (self.kv_heads, num_pages, page_size, self.head_dim)
        values = [pool_zeros(shape, SPLIT_AXES, jnp.int8, mesh) for _ in range(2)]
        scales = [pool_zeros(shape[:3], SPLIT_AXES[:3], jnp.float32, mesh) for _ in range(2)]
        return QuantizedKV(*values, *scales)

    def update(self, cache: QuantizedKV, k: jax.Array, v: jax.Array, slots: jax.Array) -> QuantizedKV:
        """Quantizes new k, v [T, kv_heads, head_dim] and scatters them to their slots."""
        page_size = cache.k.shape[2]
        pages, offsets = slots // page_size, slots % page_size
        (kq, ks), (vq, vs) = quantize_rows(jnp.swapaxes(k, 0, 1)), quantize_rows(jnp.swapaxes(v, 0, 1))
        return QuantizedKV(cache.k.at[:, pages, offsets, :].set(kq), cache.v.at[:, pages, offsets, :].set(vq),
                           cache.k_scale.at[:, pages, offsets].set(ks), cache.v_scale.at[:, pages, offsets].set(vs))

    def export(self, cache: QuantizedKV, pages: jax.Array) -> jax.Array:
        rows = []
        for values, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
            scale_bytes = jax.lax.bitcast_convert_type(scale[:, pages], jnp.int8)  # [..., 4]
            rows.append(jnp.concatenate([values[:, pages], scale_bytes], axis=-1))
        return jnp.moveaxis(jnp.stack(rows), 2, 0)  # [pages, 2, kv_heads, page_size, head_dim + 4]

    def import_pages(self, cache: QuantizedKV, pages: jax.Array, data: jax.Array) -> QuantizedKV:
        data = jnp.moveaxis(data, 0, 2)  # [2, kv_heads, pages, page_size, head_dim + 4]
        values = data[..., : self.head_dim]
        scales = jax.lax.bitcast_convert_type(data[..., self.head_dim:], jnp.float32)
        return QuantizedKV(cache.k.at[:, pages].set(values[0]), cache.v.at[:, pages].set(values[1]),
                           cache.k_scale.at[:, pages].set(scales[0]), cache.v_scale.at[:, pages].set(scales[1]))

    def stored_page(self, dtype: jnp.dtype) -> tuple[str, int]:
        """The dtype and last dimension of a page as it leaves the device (the store's identity)."""
        return "int8", self.head_dim + SCALE_BYTES


def _to_fp8_bits(x: jax.Array) -> jax.Array:
    fp8 = jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8)  # e4m3fn has no infinity: past 448 would be NaN
    return jax.lax.bitcast_convert_type(fp8, jnp.uint8)


def write_page_scaled(pool: jax.Array, scale: jax.Array, new: jax.Array, pages: jax.Array, offsets: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
    """Writes new rows [T, kv_heads, head_dim] to (pages, offsets) of an fp8 pool (uint8 bits) [kv_heads, P,
    page_size, head_dim] with page scales [kv_heads, P]: raises each written page's scale to cover its new rows and
    re-rounds the page's other rows to it (every copy of a page written twice gets the same values)."""
    x = jnp.swapaxes(new, 0, 1).astype(jnp.float32)  # [kv_heads, T, head_dim]
    fresh = jnp.zeros(scale.shape[1], jnp.int32).at[pages].max((offsets == 0).astype(jnp.int32)) > 0
    kept = jnp.where(fresh[None], 0.0, scale)
    grown = kept.at[:, pages].max(jnp.max(jnp.abs(x), axis=-1) / FP8_MAX)
    safe = jnp.where(grown > 0, grown, 1.0)
    ratio = (kept / safe)[:, pages][..., None, None]  # a fresh page's stale rows become zeros
    pool = pool.at[:, pages].set(_to_fp8_bits(stored_values(pool[:, pages]).astype(jnp.float32) * ratio))
    return pool.at[:, pages, offsets].set(_to_fp8_bits(x / safe[:, pages][..., None])), grown


@dataclasses.dataclass(frozen=True)
class Fp8SplitPages(SplitPages):
    """`SplitPages` in float8 e4m3 with one scale per page and head."""

    def empty(self, num_pages: int, page_size: int, dtype: jnp.dtype, mesh: Mesh | None = None) -> QuantizedKV:
        shape = (self.kv_heads, num_pages, page_size, self.head_dim)
        values = [pool_zeros(shape, SPLIT_AXES, jnp.uint8, mesh) for _ in range(2)]
        scales = [pool_zeros(shape[:2], SPLIT_AXES[:2], jnp.float32, mesh) for _ in range(2)]
        return QuantizedKV(*values, *scales)

    def update(self, cache: QuantizedKV, k: jax.Array, v: jax.Array, slots: jax.Array) -> QuantizedKV:
        page_size = cache.k.shape[2]
        pages, offsets = slots // page_size, slots % page_size
        k_pool, k_scale = write_page_scaled(cache.k, cache.k_scale, k, pages, offsets)
        v_pool, v_scale = write_page_scaled(cache.v, cache.v_scale, v, pages, offsets)
        return QuantizedKV(k_pool, v_pool, k_scale, v_scale)

    def export(self, cache: QuantizedKV, pages: jax.Array) -> jax.Array:
        rows = []
        for values, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
            page_values = values[:, pages]
            scale_bytes = jax.lax.bitcast_convert_type(scale[:, pages], jnp.uint8)  # [kv_heads, pages, 4]
            scale_rows = jnp.broadcast_to(scale_bytes[:, :, None], (*page_values.shape[:3], SCALE_BYTES))
            rows.append(jnp.concatenate([page_values, scale_rows], axis=-1))
        return jnp.moveaxis(jnp.stack(rows), 2, 0)

    def import_pages(self, cache: QuantizedKV, pages: jax.Array, data: jax.Array) -> QuantizedKV:
        data = jnp.moveaxis(data, 0, 2)  # [2, kv_heads, pages, page_size, head_dim + 4]
        values = data[..., : self.head_dim]
        scales = jax.lax.bitcast_convert_type(data[..., 0, self.head_dim:], jnp.float32)  # the first row's
        return QuantizedKV(cache.k.at[:, pages].set(values[0]), cache.v.at[:, pages].set(values[1]),
                           cache.k_scale.at[:, pages].set(scales[0]), cache.v_scale.at[:, pages].set(scales[1]))

    def stored_page(self, dtype: jnp.dtype) -> tuple[str, int]:
        return "uint8", self.head_dim + SCALE_BYTES
