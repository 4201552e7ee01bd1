"""int8 KV pages (`engine.kv_dtype = "int8"`): the split layout with each token's key and value
of each head stored as int8 values and one float32 scale (its largest magnitude / 127).

- On the device: `QuantizedKV` holds the int8 K and V pools `[kv_heads, num_pages, page_size,
  head_dim]` and their scales `[kv_heads, num_pages, page_size]`. The reference attention backend
  dequantizes each gathered block of keys and values (`layers.attention`).
- Leaving the device (KV tiers, the prefill/decode channel): one int8 array per page, as every
  layout's pages leave, `[pages, 2, kv_heads, page_size, head_dim + 4]`. The last 4 bytes of a row are
  its scale's float32 bits, so the tiers and the store move values and scales together, unchanged,
  and a store's model identity (int8, head_dim + 4) keeps such pages apart from float ones.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer.layers.kv_layout import SPLIT_AXES, SplitPages, pool_zeros

SCALE_BYTES = 4  # a float32 scale, carried as int8 bytes in a page's stored form


class QuantizedKV(NamedTuple):
    """One layer's int8 K and V pools and their per-token, per-head scales."""

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


def dequantize_rows(values: jax.Array, scale: jax.Array) -> jax.Array:
    return values.astype(jnp.float32) * scale[..., None]


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
