"""Whole KV pages copied out of and into the device pools, for the KV tiers (L2 host pages, L3
store) and the prefill/decode channel: fixed-size groups of pages, one compile each way, written
straight into pinned host memory where every device has it.

`PageCopies` is a mixin of `ModelRunner` (engine/step.py), which owns the caches it copies."""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kv.tiers import HostPage, TieredPages
from jaxinfer.layers.kv_layout import KVLayout
from jaxinfer.parallel.transfer import to_devices

if TYPE_CHECKING:
    from jax.sharding import Mesh, NamedSharding

    from jaxinfer.kv.prefix_cache import PrefixCachingPool
    from jaxinfer.models import CausalLM

log = logging.getLogger(__name__)

TIER_CHUNK = 8  # pages per export/import call: one shape, so one compile each


def export_all_layers(layout: KVLayout, caches, pages: jax.Array) -> jax.Array:
    """Pages of every layer -> [pages, layers, 2, kv_heads, page_size, head_dim] (the layouts' neutral form)."""
    return jnp.stack([layout.export(c, pages) for c in caches], axis=1)


def import_all_layers(layout: KVLayout, caches, pages: jax.Array, data: jax.Array):
    """Writes [pages, layers, 2, kv_heads, page_size, head_dim] into the caches (padding rows hit page 0)."""
    return tuple(layout.import_pages(c, pages, data[:, i]) for i, c in enumerate(caches))


def import_host_rows(layout: KVLayout, device_sharding, caches, group: jax.Array, rows: jax.Array, pages: jax.Array):
    """Writes rows of a host group (pinned host memory) into device pages: one host-to-device copy."""
    return import_all_layers(layout, caches, pages, jax.device_put(group, device_sharding)[rows])


def host_pages(groups: list[jax.Array]) -> list[HostPage]:
    """The pages of `export_pages`' groups, in order (padding rows included), as host pages.

    Without pinned host memory the copies are device arrays: they become numpy copies here."""
    groups = [g if g.sharding.memory_kind == "pinned_host" else jax.device_get(g) for g in groups]
    return [HostPage(group, row) for group in groups for row in range(TIER_CHUNK)]


class PageCopies:
    """Exports evicted pages (`copy_evicted_pages`, `export_pages`), hands them to the tiers
    (`demote_copied_pages`) and writes restored ones back (`import_pages`)."""

    model: CausalLM
    mesh: Mesh
    caches: tuple
    cache_shardings: object
    replicated: NamedSharding
    pool: PrefixCachingPool
    tiers: TieredPages | None
    _exports: list[tuple[list[bytes], list[jax.Array]]]

    def warmup_tiers(self) -> None:
        """Compiles the page copy programs now rather than on the first eviction or restore.

        Where every device has pinned host memory, the copy out writes into it directly (so L2
        holds pinned buffers) and the copy back reads from it.
        """
        start = time.perf_counter()
        if self._import_rows_fn is None and self._has_pinned_host():
            probe = self._export_fn(self.caches, to_devices(np.zeros(TIER_CHUNK, np.int32), self.replicated))
            device = probe.sharding
            self._export_fn = jax.jit(self._export_pages, out_shardings=device.with_memory_kind("pinned_host"))
            self._import_rows_fn = jax.jit(functools.partial(import_host_rows, self.model.kv_layout, device),
                                           donate_argnums=(0,), out_shardings=self.cache_shardings)
        if self.spec is not None:  # restored pages lack the draft's KV: it is computed on restore
            self.spec.warmup_refill()
        for group in self.export_pages([0]):  # the null page: reading and rewriting it is harmless
            self.import_pages([(0, HostPage(group, 0))])
            self.import_pages([(0, np.zeros(group.shape[1:], group.dtype))])
        log.info("compiled the KV tier page copies in %.1fs (L2 in %s memory)", time.perf_counter() - start,
                 "pinned host" if self._import_rows_fn else "pageable host")

    def _has_pinned_host(self) -> bool:
        return all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in self.mesh.devices.flat)

    def copy_evicted_pages(self) -> None:
        """Enqueues copies of the pages the pool evicted since the last call (their content is intact)."""
        evicted = self.pool.take_evicted()
        if evicted and self.tiers is not None:
            self._exports.append(([key for _, key in evicted], self.export_pages([page for page, _ in evicted])))

    def demote_copied_pages(self) -> None:
        """Hands the copied pages to the lower tiers (L2 keeps the host groups; L3 waits for their bytes)."""
        exports, self._exports = self._exports, []
        for keys, groups in exports:
            for key, page in zip(keys, host_pages(groups), strict=False):  # padding rows have no key
                self.tiers.demote(key, page)

    def export_pages(self, pages: list[int]) -> list[jax.Array]:
        """Enqueues copies of `pages` (in TIER_CHUNK groups, padded with page 0); host copies start at once.

        Enqueued before the next step, they read the pages before that step can overwrite them.
        """
        chunks = []
        for i in range(0, len(pages), TIER_CHUNK):
            group = np.zeros(TIER_CHUNK, np.int32)
            group[: len(pages[i : i + TIER_CHUNK])] = pages[i : i + TIER_CHUNK]
            out = self._export_fn(self.caches, to_devices(group, self.replicated))
            if out.sharding.memory_kind != "pinned_host":
                out.copy_to_host_async()
            chunks.append(out)
        return chunks

    def import_pages(self, entries: list[tuple[int, HostPage | np.ndarray]]) -> None:
        """Writes host pages (`HostPage`s, or numpy [layers, 2, kv_heads, page_size, head_dim]) into device pages."""
        by_group: dict[int, list[tuple[int, HostPage]]] = {}
        arrays = []
        for page, data in entries:
            if isinstance(data, HostPage) and self._import_rows_fn is not None:
                by_group.setdefault(id(data.group), []).append((page, data))
            else:
                arrays.append((page, data.numpy() if isinstance(data, HostPage) else data))
        for rows in by_group.values():
            self._import_group(rows)
        if arrays:
            self._import_arrays([page for page, _ in arrays], np.stack([data for _, data in arrays]))

    def _import_group(self, rows: list[tuple[int, HostPage]]) -> None:
        pages, picks = np.zeros(TIER_CHUNK, np.int32), np.zeros(TIER_CHUNK, np.int32)
        pages[: len(rows)] = [page for page, _ in rows]  # padding writes row 0 into the null page
        picks[: len(rows)] = [data.row for _, data in rows]
        self.caches = self._import_rows_fn(self.caches, rows[0][1].group, to_devices(picks, self.replicated),
                                           to_devices(pages, self.replicated))

    def _import_arrays(self, pages: list[int], data: np.ndarray) -> None:
        for i in range(0, len(pages), TIER_CHUNK):
            group = np.zeros(TIER_CHUNK, np.int32)
            rows = data[i : i + TIER_CHUNK]
            group[: len(rows)] = pages[i : i + TIER_CHUNK]
            padded = np.zeros((TIER_CHUNK, *data.shape[1:]), data.dtype)
            padded[: len(rows)] = rows
            self.caches = self._import_fn(self.caches, to_devices(group, self.replicated),
                                          to_devices(padded, self.replicated))
