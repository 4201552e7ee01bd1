"""KV tiers below the device pool: L2 in host memory (bounded, LRU) and L3 in a tensorstore `PageStore`.

A prefix-cache page evicted from the device pool is demoted instead of dropped: into L2, and
what L2 pushes out goes to L3 (or straight to L3 when there is no L2). A prefix lookup that runs
out of device pages continues down the tiers; a hit is restored into a fresh device page and
counted as a hit of its tier (the scheduler reads L3 asynchronously: `PageStore.read_async`).
Pages are `[layers, 2, kv_heads, page_size, head_dim]` arrays. A page already in L3 is not
written again when it falls out of L2 a second time.

L2 pages are `HostPage`s: a row of a host copy of a group of pages that the runner's copy program
wrote straight into pinned host memory (`memory_kind="pinned_host"`, where the platform has it:
the CPU, GPUs and TPUs under PJRT), so demotion and restore are DMA transfers with no staging copy.
A group stays allocated while any of its pages is in L2, so L2 evicts by bytes held as well as by
pages: at most `capacity` pages' worth of bytes (or one group, if that is more). Pages for L3 are
numpy arrays (`HostPage.numpy`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import jax
import numpy as np

from jaxinfer.kv.store import PageStore

log = logging.getLogger(__name__)


@dataclass
class TierStats:
    """Pages moved down; hits are counted by the engine (`prefix_hit_tokens_l2`, `_l3`)."""

    demoted_l2: int = 0
    demoted_l3: int = 0


@dataclass(frozen=True, eq=False)
class HostPage:
    """Page `row` of a host copy of several pages (`[pages, layers, 2, kv_heads, page_size, head_dim]`)."""

    group: jax.Array | np.ndarray  # a jax array in pinned host memory, or numpy where there is none
    row: int

    def numpy(self) -> np.ndarray:
        return jax.device_get(self.group)[self.row]


class HostTier:
    """L2: up to `capacity` pages in host memory, least recently used first out."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._pages: OrderedDict[bytes, HostPage] = OrderedDict()
        self._groups: Counter[int] = Counter()  # id(group) -> pages of it held
        self.num_bytes = 0  # bytes of the groups held

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def _hold(self, page: HostPage) -> None:
        if self._groups[id(page.group)] == 0:
            self.num_bytes += page.group.nbytes
        self._groups[id(page.group)] += 1

    def _release(self, page: HostPage) -> None:
        self._groups[id(page.group)] -= 1
        if self._groups[id(page.group)] == 0:
            del self._groups[id(page.group)]
            self.num_bytes -= page.group.nbytes

    def get(self, key: bytes) -> HostPage | None:
        page = self._pages.get(key)
        if page is not None:
            self._pages.move_to_end(key)
        return page

    def drain(self) -> list[tuple[bytes, HostPage]]:
        """Takes every page out, least recently used first."""
        pages, self._pages = list(self._pages.items()), OrderedDict()
        self._groups.clear()
        self.num_bytes = 0
        return pages

    def put(self, key: bytes, page: HostPage) -> list[tuple[bytes, HostPage]]:
        """Stores a page; returns the pages pushed out to make room (for the tier below)."""
        if key in self._pages:
            self._release(self._pages[key])
        self._pages[key] = page
        self._pages.move_to_end(key)
        self._hold(page)
        limit = max(self.capacity * page.group.nbytes // len(page.group), page.group.nbytes)
        pushed = []
        while len(self._pages) > self.capacity or self.num_bytes > limit:
            pushed.append(self._pages.popitem(last=False))
            self._release(pushed[-1][1])
        return pushed


class TieredPages:
    def __init__(self, host: HostTier | None = None, store: PageStore | None = None, sweep_seconds: float = 0.0):
        self.host, self.store = host, store
        self.stats = TierStats()
        self.sweep_seconds = sweep_seconds  # how often `maybe_sweep` sweeps the store (0: never)
        self._last_sweep = time.monotonic()

    def maybe_sweep(self) -> None:
        """Sweeps the store when `sweep_seconds` have passed since the last sweep (called between steps)."""
        if self.store is None or self.sweep_seconds <= 0 or time.monotonic() - self._last_sweep < self.sweep_seconds:
            return
        self._last_sweep = time.monotonic()
        try:
            removed = self.store.sweep()
        except Exception as exc:  # the store is unreachable now: serving goes on, the next sweep retries
            log.warning("KV store sweep failed: %s", exc)
            return
        log.info("KV store sweep: %d values removed, %d pages held", removed, self.store.num_pages)

    def demote(self, key: bytes, page: HostPage) -> None:
        pushed = [(key, page)]
        if self.host is not None:
            pushed = self.host.put(key, page)
            self.stats.demoted_l2 += 1
        self._to_store(pushed)

    def persist(self) -> int:
        """Moves every L2 page down to L3 (before exit, so a later process can use them); returns the count."""
        if self.store is None:
            return 0
        pages = self.host.drain() if self.host is not None else []
        self._to_store(pages)
        self.store.flush()
        return len(pages)

    def _to_store(self, pages: list[tuple[bytes, HostPage]]) -> None:
        if self.store is None:
            return  # no L3: pages pushed out of L2 are dropped
        for key, page in pages:
            if key not in self.store and self.store.put(key, page.numpy(), wait=False):  # else: the same copy
                self.stats.demoted_l3 += 1  # is stored (restored from L3 earlier), or writes rest

    def host_page(self, key: bytes) -> HostPage | None:
        return self.host.get(key) if self.host is not None else None

    def in_host(self, key: bytes) -> bool:
        return self.host is not None and key in self.host

    def gauges(self) -> dict[str, float]:
        """Pages and bytes held per tier, pages moved down, and the store's own counters."""
        host, store = self.host, self.store
        gauges = {
            "kv_l2_pages": len(host) if host else 0,
            "kv_l2_bytes": host.num_bytes if host else 0,
            "kv_l2_capacity_pages": host.capacity if host else 0,
            "kv_l3_pages": store.num_pages if store else 0,
            "kv_l3_bytes": store.num_bytes if store else 0,
            "kv_l3_capacity_bytes": store.max_bytes if store else 0,
            "kv_demoted_l2": self.stats.demoted_l2,
            "kv_demoted_l3": self.stats.demoted_l3,
        }
        if store is not None:
            gauges.update({f"kv_l3_{name}": value for name, value in vars(store.stats).items()})
        return gauges
