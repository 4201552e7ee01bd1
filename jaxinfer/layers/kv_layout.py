"""How one layer's paged KV cache is laid out on the device, and moving pages into and out of it.

- `SplitPages`: a K pool and a V pool, each `[kv_heads, num_pages, page_size, head_dim]`, heads first
  (see `layers.attention`). The reference and the Pallas GPU backends read this layout.
- `CombinedPages`: one pool `[num_pages, page_size, 2 * kv_heads, head_dim]` with the key of head h at
  combined head 2h and its value at 2h + 1: the layout of JAX's TPU ragged paged attention kernel.
  Mosaic tiles the last two dimensions, so the kernel needs a head count and a head_dim it can
  tile; the layout pads them (zero heads, zero lanes) and strips the padding when pages leave.
  Split over the model axis, each device's block of heads is padded on its own.

Page 0 is the null page in both. Pages leave and enter a layout in one neutral form,
`[pages, 2, kv_heads, page_size, head_dim]` with the model's own heads and head_dim, so the KV tiers,
the prefill-to-decode channel and host copies do not depend on the attention backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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

    def heads_spec(self, model_parallel: int) -> PartitionSpec | None:
        """How a cache's kv heads are split over a model axis of `model_parallel` devices (None: kept
        whole on every device), the same rule `empty` shards by."""
        ...

    def stored_page(self, dtype: jnp.dtype) -> tuple[str, int]:
        """The dtype name and last dimension of a page as it leaves the device, for a model of `dtype`."""
        ...


def pool_zeros(shape: tuple[int, ...], axes: tuple[str, ...], dtype: jnp.dtype, mesh: Mesh | None) -> jax.Array:
    if mesh is None:
        return jnp.zeros(shape, dtype)
    return _zeros_program(shape, jnp.dtype(dtype), named_sharding(shape, axes, mesh))()


@functools.lru_cache(maxsize=16)
def _zeros_program(shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding) -> Callable[[], jax.Array]:
    """One jitted program per pool shape: every layer's pools reuse it (a new function per pool was a
    new trace and executable each, 60 of them for SmolLM2, about 3 s of every engine start)."""
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


@dataclasses.dataclass(frozen=True)
class SplitPages:
    kv_heads: int
    head_dim: int

    def empty(self, num_pages: int, page_size: int, dtype: jnp.dtype, mesh: Mesh | None = None) -> KVCache:
        shape = (self.kv_heads, num_pages, page_size, self.head_dim)
        return KVCache(pool_zeros(shape, SPLIT_AXES, dtype, mesh), pool_zeros(shape, SPLIT_AXES, dtype, mesh))

    def update(self, cache: KVCache, k: jax.Array, v: jax.Array, slots: jax.Array) -> KVCache:
        """Scatters new k, v [T, kv_heads, head_dim] to their slots (page * page_size + offset)."""
        return KVCache(_scatter_split(cache.k, k, slots), _scatter_split(cache.v, v, slots))

    def heads_spec(self, model_parallel: int) -> PartitionSpec | None:
        return PartitionSpec("model") if self.kv_heads % model_parallel == 0 else None  # `spec_for`'s rule

    def export(self, cache: KVCache, pages: jax.Array) -> jax.Array:
        return jnp.moveaxis(jnp.stack([cache.k[:, pages], cache.v[:, pages]]), 2, 0)

    def stored_page(self, dtype: jnp.dtype) -> tuple[str, int]:
        return jnp.dtype(dtype).name, self.head_dim

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
    """`padded_kv_heads` and the padding are per shard: with the kv heads split over `shards` devices
    of the model axis, each device's block of combined heads is a tileable pool of its own."""

    kv_heads: int
    head_dim: int
    padded_kv_heads: int  # per shard
    padded_head_dim: int
    shards: int = 1

    @classmethod
    def for_mosaic(cls, kv_heads: int, head_dim: int, dtype: jnp.dtype, model_parallel: int = 1) -> CombinedPages:
        """Splits the kv heads over the model axis where it divides them (else every device holds all),
        then pads each shard's heads until Mosaic tiles 2 * heads in `dtype`, and head_dim to whole lanes."""
        shards = model_parallel if kv_heads % model_parallel == 0 else 1
        packing = max(1, 4 // jnp.dtype(dtype).itemsize)
        padded = kv_heads // shards
        while not _tileable(2 * padded, packing):
            padded += 1
        lanes = -(-head_dim // MOSAIC_LANES) * MOSAIC_LANES
        return cls(kv_heads, head_dim, padded, lanes, shards)

    @property
    def combined_heads(self) -> int:
        return 2 * self.padded_kv_heads * self.shards

    def local(self) -> CombinedPages:
        """The layout of one device's block of heads, as the kernel on that device sees it."""
        if self.shards == 1:
            return self
        return CombinedPages(self.kv_heads // self.shards, self.head_dim, self.padded_kv_heads, self.padded_head_dim)

    def heads_spec(self, model_parallel: int) -> PartitionSpec | None:
        return PartitionSpec(None, None, "model", None) if self.shards > 1 else None

    def empty(self, num_pages: int, page_size: int, dtype: jnp.dtype, mesh: Mesh | None = None) -> jax.Array:
        shape = (num_pages, page_size, self.combined_heads, self.padded_head_dim)
        # unsplit, the combined heads stay whole on every device (a split could part a key from its value)
        axes = COMBINED_AXES if self.shards > 1 else ("pages", "page_slot", None, "head_dim")
        return pool_zeros(shape, axes, dtype, mesh)

    def pad_heads(self, x: jax.Array) -> jax.Array:
        """[..., kv_heads, n, head_dim] -> [..., shards * padded_kv_heads, n, padded_head_dim], zeros in the
        padding (n is 2 for a key and its value, or a GQA group of queries)."""
        *lead, _, n, _ = x.shape
        local = self.kv_heads // self.shards
        x = x.reshape(*lead, self.shards, local, n, self.head_dim)
        pad = [(0, 0)] * x.ndim
        pad[-3] = (0, self.padded_kv_heads - local)
        pad[-1] = (0, self.padded_head_dim - self.head_dim)
        return jnp.pad(x, pad).reshape(*lead, self.shards * self.padded_kv_heads, n, self.padded_head_dim)

    def strip_heads(self, x: jax.Array) -> jax.Array:
        """The inverse of `pad_heads`."""
        *lead, _, n, _ = x.shape
        x = x.reshape(*lead, self.shards, self.padded_kv_heads, n, self.padded_head_dim)
        x = x[..., : self.kv_heads // self.shards, :, : self.head_dim]
        return x.reshape(*lead, self.kv_heads, n, self.head_dim)

    def update(self, cache: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
        """Writes k, v [T, kv_heads, head_dim] interleaved: [T, combined_heads, padded_head_dim]."""
        new = self.pad_heads(jnp.stack([k, v], axis=2)).reshape(k.shape[0], self.combined_heads, self.padded_head_dim)
        page_size = cache.shape[1]
        return cache.at[slots // page_size, slots % page_size].set(new.astype(cache.dtype))

    def export(self, cache: jax.Array, pages: jax.Array) -> jax.Array:
        picked = cache[pages]  # [n, page_size, combined_heads, padded_head_dim]
        n, page_size = picked.shape[:2]
        pairs = self.strip_heads(picked.reshape(n, page_size, self.shards * self.padded_kv_heads, 2,
                                                self.padded_head_dim))
        return jnp.transpose(pairs, (0, 3, 2, 1, 4))  # [n, 2, kv_heads, page_size, head_dim]

    def stored_page(self, dtype: jnp.dtype) -> tuple[str, int]:
        return jnp.dtype(dtype).name, self.head_dim

    def import_pages(self, cache: jax.Array, pages: jax.Array, data: jax.Array) -> jax.Array:
        pairs = self.pad_heads(jnp.transpose(data, (0, 3, 2, 1, 4)))  # [n, page_size, heads, 2, lanes]
        n, page_size = pairs.shape[:2]
        combined = pairs.reshape(n, page_size, self.combined_heads, self.padded_head_dim)
        return cache.at[pages].set(combined.astype(cache.dtype))
