"""KV tier moves driven by the engine: evicted prefix pages copied down to L2 (host) and L3 (the
tensorstore store), restored pages written back to the device, the prefix cache persisted.

A mixin of `Engine` (engine/engine.py); the tiers themselves are kv/tiers.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jaxinfer.kv.tiers import HostPage

if TYPE_CHECKING:
    from jaxinfer.engine.scheduler import Scheduler
    from jaxinfer.engine.step import ModelRunner
    from jaxinfer.kv.prefix_cache import PrefixCachingPool


class TierMoves:
    """Demotes evicted pages, writes restored ones, persists the prefix cache."""

    runner: ModelRunner
    scheduler: Scheduler
    pool: PrefixCachingPool

    def _tier_upkeep(self) -> None:
        """Pages evicted since the last step (by another engine, or a test) go down first; a due sweep runs."""
        if self.scheduler.tiers is not None:
            self._demote_evicted()
            self.scheduler.tiers.maybe_sweep()

    def flush_tiers(self) -> None:
        """Demotes every page evicted so far to the lower tiers now (waits for their copies and writes)."""
        self._demote_evicted()
        if self.scheduler.tiers is not None and self.scheduler.tiers.store is not None:
            self.scheduler.tiers.store.flush()

    def _demote_evicted(self) -> None:
        self.runner.copy_evicted_pages()
        self.runner.demote_copied_pages()

    def persist_prefix_cache(self) -> None:
        """Moves every cached page no request uses down to L3 (when there is one), e.g. before exit."""
        if self.scheduler.tiers is None or self.scheduler.tiers.store is None:
            return
        with self.pool.hold(keep_free=0):  # evicts every cached page that no sequence holds
            self.flush_tiers()
        self.scheduler.tiers.persist()

    def _write_restored_pages(self, pages: list[tuple[int, HostPage | np.ndarray]]) -> None:
        """Writes pages restored from L2/L3 into their device pages, after copying out what their
        allocation evicted (the copy is enqueued first, so it reads the old content)."""
        self.runner.copy_evicted_pages()
        self.runner.import_pages(pages)
