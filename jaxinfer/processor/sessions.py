"""Linear memory kept between turns: a program's final memory under (tenant, session).

A request with ``exec_session`` starts its program from the memory that the same tenant's last
program in that session ended with (the new module's data segments are written over it), and a
program that halts normally leaves its memory there for the next turn. Keys include the tenant,
so one tenant can never read another's session.

The cache is bounded in bytes and entries expire after a time to live. When a new snapshot needs
room, expired entries go first, then the least recently used entry of the tenant that would hold
the most bytes (counting the new snapshot for its tenant; ties go to the least recently used). So
a tenant opening many sessions evicts its own, never a smaller tenant's: with the cache full,
every tenant keeps at least an equal share of it (max-min fairness).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
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
        self._tenant_bytes: Counter[str] = Counter()
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
        if self.bytes + len(data) > self.capacity_bytes:
            self._remove_expired()
        while self._entries and self.bytes + len(data) > self.capacity_bytes:
            self._remove(self._victim(tenant, len(data)))
            self.evictions += 1
        self._entries[key] = Snapshot(data, pages, self.clock())
        self.bytes += len(data)
        self._tenant_bytes[tenant] += len(data)

    def tenant_bytes(self, tenant: str) -> int:
        return self._tenant_bytes[tenant]

    def _victim(self, incoming_tenant: str, incoming_bytes: int) -> tuple[str, str]:
        """The least recently used entry of the tenant that would hold the most bytes."""
        held = self._tenant_bytes.copy()
        held[incoming_tenant] += incoming_bytes
        largest = max(held[tenant] for tenant, _ in self._entries)
        return next(key for key in self._entries if held[key[0]] == largest)

    def _remove_expired(self) -> None:
        now = self.clock()
        for key in [k for k, s in self._entries.items() if now - s.stored_at > self.ttl_seconds]:
            self._remove(key)

    def _remove(self, key: tuple[str, str]) -> None:
        size = len(self._entries.pop(key).memory)
        self.bytes -= size
        self._tenant_bytes[key[0]] -= size
        if not self._tenant_bytes[key[0]]:
            del self._tenant_bytes[key[0]]

    def __len__(self) -> int:
        return len(self._entries)
