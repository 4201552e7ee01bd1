"""The page pool: which device KV pages are free. Page 0 is never handed out (the null page)."""

from __future__ import annotations

from collections import deque


class PagePool:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages, or None (and nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        return [self._free.popleft() for _ in range(count)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)
