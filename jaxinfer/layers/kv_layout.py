"""How one layer's paged KV cache is laid out on the device, and moving pages into and out of it.

- `SplitPages`: a K pool and a V pool, each `[kv_heads, num_pages, page_size, head_dim]`, heads first
  (see `layers.attention`). The reference and the Pallas GPU backends read this layout.
- `CombinedPages`: one pool `[num_pages, page_size, 2 * kv_heads, head_dim]` with the key of head h at
  combined head 2h and its value at 2h + 1: the layout of JAX's TPU ragged paged attention kernel.
  Mosaic tiles the last two dimensions, so the kernel needs a head count and a head_dim it can
  tile; the layout pads them (zero heads, zero lanes) and strips the padding when pages leave.

Page 0 is the null page in both. Pages leave and enter a layout in one neutral form,
`[pages, 2, kv_heads, page_size, head_dim]` with the model's own heads and head_dim, so the KV tiers,
the prefill-to-decode channel and host copies do not depend on the attention backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer.parallel import named_sharding

SPLIT_AXES = ("kv_heads", "pages", "page_slot", "head_dim")
COMBINED_AXES = ("pages", "page_slot", "kv_heads", "head_dim")
MOSAIC_LANES = 128  # Mosaic's minor tile: head_dim is padded to a multiple of it


class KVCache(NamedTuple):
    """One layer's K and V page pools in the split layout, each [kv_heads, num_pages, page_size, head_dim]."""

    k: jax.Array
    v: jax.Array


LayerCache = Any  # one layer's cache as a layout keeps it: a KVCache (split) or one combined array


class KVLayout(Protocol):
    """One layer's cache (any pytree of arrays) for one model's kv heads and head_dim."""

    def empty(self, num_pages: int, page_size: int, dtype: jnp.dtype, mesh: Mesh | None = None) -> Any: ...

    def update(self, cache: Any, k: jax.Array, v: jax.Array, slots: jax.Array) -> Any: ...

    def export(self, cache: Any, pages: jax.Array) -> jax.Array: ...

    def import_pages(self, cache: Any, pages: jax.Array, data: jax.Array) -> Any: ...


def _zeros(shape: tuple[int, ...], axes: tuple[str, ...], dtype: jnp.dtype, mesh: Mesh | None) -> jax.Array:
    if mesh is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=named_sharding(shape, axes, mesh))()


@dataclasses.dataclass(frozen=True)
class SplitPages:
    kv_heads: int
    head_dim: int

    def empty(self, num_pages: int, page_size: int, dtype: jnp.dtype, mesh: Mesh | None = None) -> KVCache:
        shape = (self.kv_heads, num_pages, page_size, self.head_dim)
        return KVCache(_zeros(shape, SPLIT_AXES, dtype, mesh), _zeros(shape, SPLIT_AXES, dtype, mesh))

    def update(self, cache: KVCache, k: jax.Array, v: jax.Array, slots: jax.Array) -> KVCache:
        """Scatters new k, v [T, kv_heads, head_dim] to their slots (page * page_size + offset)."""
        return KVCache(_scatter_split(cache.k, k, slots), _scatter_split(cache.v, v, slots))

    def export(self, cache: KVCache, pages: jax.Array) -> jax.Array:
        return jnp.moveaxis(jnp.stack([cache.k[:, pages], cache.v[:, pages]]), 2, 0)

    def import_pages(self, cache: KVCache, pages: jax.Array, data: jax.Array) -> KVCache:
        data = jnp.moveaxis(data, 0, 2).astype(cache.k.dtype)  # [2, kv_heads, pages, page_size, head_dim]
        return KVCache(cache.k.at[:, pages].set(data[0]), cache.v.at[:, pages].set(data[1]))


def _scatter_split(pool: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    page_size = pool.shape[2]
    return pool.at[:, slots // page_size, slots % page_size, :].set(jnp.swapaxes(new, 0, 1).astype(pool.dtype))


def _tileable(combined_heads: int, packing: int) -> bool:
    """Whether Mosaic tiles this many combined heads as the second-minor dimension (the TPU kernel's rule)."""
    if combined_heads % packing:
        return False
    rows = combined_heads // packing
    return rows in (1, 2, 4, 8) or rows % 8 == 0


@dataclasses.dataclass(frozen=True)
class CombinedPages:
    kv_heads: int
    head_dim: int
    padded_kv_heads: int
    padded_head_dim: int

    @classmethod
    def for_mosaic(cls, kv_heads: int, head_dim: int, dtype: jnp.dtype) -> CombinedPages:
        """Pads kv heads until Mosaic tiles 2 * heads in `dtype`, and head_dim to whole lanes."""
        packing = max(1, 4 // jnp.dtype(dtype).itemsize)
        padded = kv_heads
        while not _tileable(2 * padded, packing):
            padded += 1
        lanes = -(-head_dim // MOSAIC_LANES) * MOSAIC_LANES
        return cls(kv_heads, head_dim, padded, lanes)

    def empty(self, num_pages: int, page_size: int, dtype: jnp.dtype, mesh: Mesh | None = None) -> jax.Array:
        shape = (num_pages, page_size, 2 * self.padded_kv_heads, self.padded_head_dim)
        return _zeros(shape, COMBINED_AXES, dtype, mesh)

    def pad_heads(self, x: jax.Array) -> jax.Array:
        """[..., kv_heads, 2, head_dim] -> [..., padded_kv_heads, 2, padded_head_dim], zeros in the padding."""
        pad = [(0, 0)] * x.ndim
        pad[-3] = (0, self.padded_kv_heads - self.kv_heads)
        pad[-1] = (0, self.padded_head_dim - self.head_dim)
        return jnp.pad(x, pad)

    def update(self, cache: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
        """Writes k, v [T, kv_heads, head_dim] interleaved: [T, 2 * padded_kv_heads, padded_head_dim]."""
        pairs = self.pad_heads(jnp.stack([k, v], axis=2))  # [T, padded_kv_heads, 2, padded_head_dim]
        new = pairs.reshape(pairs.shape[0], 2 * self.padded_kv_heads, self.padded_head_dim)
        page_size = cache.shape[1]
        return cache.at[slots // page_size, slots % page_size].set(new.astype(cache.dtype))

    def export(self, cache: jax.Array, pages: jax.Array) -> jax.Array:
        picked = cache[pages]  # [n, page_size, 2 * padded_kv_heads, padded_head_dim]
        n, page_size = picked.shape[:2]
        pairs = picked.reshape(n, page_size, self.padded_kv_heads, 2, self.padded_head_dim)
        pairs = pairs[:, :, : self.kv_heads, :, : self.head_dim]
        return jnp.transpose(pairs, (0, 3, 2, 1, 4))  # [n, 2, kv_heads, page_size, head_dim]

    def import_pages(self, cache: jax.Array, pages: jax.Array, data: jax.Array) -> jax.Array:
        pairs = self.pad_heads(jnp.transpose(data, (0, 3, 2, 1, 4)))  # [n, page_size, padded_kv_heads, 2, lanes]
        n, page_size = pairs.shape[:2]
        combined = pairs.reshape(n, page_size, 2 * self.padded_kv_heads, self.padded_head_dim)
        return cache.at[pages].set(combined.astype(cache.dtype))
