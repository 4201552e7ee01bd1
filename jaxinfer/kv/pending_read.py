"""A read of pages from the L3 KV store in flight: polled by the scheduler between steps, waited on until the
store's deadline, its values checked (through the store) when the pages are taken.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxinfer.kv.store import PageStore

log = logging.getLogger(__name__)


class PendingRead:
    """Pages being read by tensorstore; `done()` polls (true once all are read or the deadline passed),
    `pages()` waits and checks them."""

    def __init__(self, store: PageStore, keys: list[bytes]):
        self._store = store
        self.keys = [] if store.resting() else [key for key in keys if store._readable(key)]
        store.stats.misses += len(keys) - len(self.keys)
        self._futures = [store._kv.read(store._key(key)) for key in self.keys]
        self.started = time.perf_counter()
        self.deadline = self.started + store.timeout_seconds
        self.finished: float | None = None  # when `done` first found it done
        self._pages: dict[bytes, np.ndarray] | None = None

    def done(self) -> bool:
        if self.finished is None and (all(future.done() for future in self._futures)
                                      or time.perf_counter() >= self.deadline):
            self.finished = time.perf_counter()
        return self.finished is not None

    @property
    def seconds(self) -> float:
        """From the start until `done` saw it done (the latency its request waited)."""
        return (self.finished or time.perf_counter()) - self.started

    def wait(self) -> None:
        """Waits until every read is done or the deadline passes."""
        for future in self._futures:
            remaining = self.deadline - time.perf_counter()
            if remaining <= 0:
                break
            try:
                future.exception(timeout=remaining)  # an error is reported by `pages`
            except TimeoutError:
                break
        self.done()

    def pages(self) -> dict[bytes, np.ndarray]:
        """The pages found intact and unexpired, by key (damaged or unreadable ones are left out)."""
        if self._pages is None:
            self.wait()
            self._pages = {}
            for key, future in zip(self.keys, self._futures, strict=True):
                if not future.done():
                    self._store._timed_out(key, future, "read")
                    continue
                try:
                    page = self._store._accept(key, future.result())
                except Exception as exc:  # an I/O or network error: a miss, recomputed; the engine goes on
                    log.warning("KV store read of %s failed: %s", key.hex(), exc)
                    self._store.stats.misses += 1
                    page = None
                if page is not None:
                    self._pages[key] = page
        return self._pages
