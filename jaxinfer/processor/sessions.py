"""Linear memory kept between turns: a program's final memory under (tenant, session).

A request with ``exec_session`` starts its program from the memory that the same tenant's last
program in that session ended with (the new module's data segments are written over it), and a
program that halts normally leaves its memory there for the next turn. The cache is bounded in
bytes (least recently used entries go first) and entries expire after a time to live. Keys
include the tenant, so one tenant can never read another's session.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Snapshot:
    memory: bytes  # the first ``pages`` pages
    pages: int
    stored_at: float


class SessionMemory:
    def __init__(self, capacity_bytes: int, ttl_seconds: float, clock=time.monotonic) -> None:
        self.capacity_bytes, self.ttl_seconds, self.clock = capacity_bytes, ttl_seconds, clock
        self._entries: OrderedDict[tuple[str, str], Snapshot] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def get(self, tenant: str, session: str) -> Snapshot | None:
        key = (tenant, session)
        snapshot = self._entries.get(key)
        if snapshot is not None and self.clock() - snapshot.stored_at > self.ttl_seconds:
            self._remove(key)
            snapshot = None
        if snapshot is not None:
            self._entries.move_to_end(key)
        return snapshot

    def put(self, tenant: str, session: str, memory: np.ndarray, pages: int) -> None:
        key = (tenant, session)
        if key in self._entries:
            self._remove(key)
        data = memory[: pages * 65536].tobytes()
        if len(data) > self.capacity_bytes:
            return
        while self._entries and self.bytes + len(data) > self.capacity_bytes:
            self._remove(next(iter(self._entries)))
            self.evictions += 1
        self._entries[key] = Snapshot(data, pages, self.clock())
        self.bytes += len(data)

    def _remove(self, key: tuple[str, str]) -> None:
        self.bytes -= len(self._entries.pop(key).memory)

    def __len__(self) -> int:
        return len(self._entries)
