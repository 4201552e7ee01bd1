"""Reference-counted KV pages with a prefix cache: full pages are content-addressed by a hash chain.

A page's key is blake2b(parent key, its token ids, salt): the salt carries the tenant (and later the
adapter), so requests of different tenants never share pages unless they are given the same salt.
Pages whose last user finished stay cached (LRU) until the pool needs them; a new request takes the
longest chain of cached pages and computes only the rest.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np


def chain_keys(tokens: Sequence[int], page_size: int, salt: str = "", start: bytes = b"") -> list[bytes]:
    """Keys of every full page of `tokens`; `start` continues a chain whose earlier keys are known."""
    keys: list[bytes] = []
    parent = start or hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for first in range(0, len(tokens) - page_size + 1, page_size):
        page = np.asarray(tokens[first : first + page_size], np.int32).tobytes()
        parent = hashlib.blake2b(parent + page, digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCachingPool:
    """The device page pool's host bookkeeping; page 0 (the null page) is never handed out."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._cached_free: OrderedDict[int, bytes] = OrderedDict()  # refcount 0, content kept, LRU first
        self._refs = [0] * num_pages
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self.track_evictions = False  # record evicted cached pages, for demotion to a lower KV tier
        self._evicted: list[tuple[int, bytes]] = []
        # Pages written from a lower KV tier since they were allocated: the tiers carry the target
        # model's KV only, so a draft model's KV of these pages is still to be computed.
        self.restored: set[int] = set()

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (never used, or cached with no user)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages, evicting least recently used cached pages if needed; None if too few."""
        if count > self.num_free:
            return None
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, key = self._cached_free.popitem(last=False)
                del self._page_of[key], self._key_of[page]
                if self.track_evictions:
                    self._evicted.append((page, key))
            self._refs[page] = 1
            self.restored.discard(page)
            pages.append(page)
        return pages

    @property
    def has_evicted(self) -> bool:
        return bool(self._evicted)

    def take_evicted(self) -> list[tuple[int, bytes]]:
        """(page, key) of the cached pages evicted since the last call; their content is still on the device."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def free(self, pages: Sequence[int]) -> None:
        """Drops a reference to each of a sequence's `pages` (in order). The last page is released
        first, so eviction takes a cached prefix from its end: its head stays reachable by `lookup`
        (a prefix that lost its first page could never be hit again, yet would keep its other pages)."""
        for page in reversed(pages):
            self._refs[page] -= 1
            assert self._refs[page] >= 0, f"page {page} freed twice"
            if self._refs[page] == 0:
                key = self._key_of.get(page)
                if key is None:
                    self._free.append(page)
                else:
                    self._cached_free[page] = key

    def __contains__(self, key: bytes) -> bool:
        return key in self._page_of

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached prefix of `keys`, each now referenced once more."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            self._cached_free.pop(page, None)
            self._refs[page] += 1
            pages.append(page)
        return pages

    def register(self, page: int, key: bytes) -> None:
        """Publishes a full page under its key (a page already published under the key wins)."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def forget(self, page: int) -> None:
        """Unpublishes a page (its content never arrived): no lookup finds it, and freed it is plain free."""
        key = self._key_of.pop(page, None)
        if key is not None and self._page_of.get(key) == page:
            del self._page_of[key]

    def accounting_errors(self, holders: Mapping[int, int]) -> list[str]:
        """Where the books disagree with `holders` (page -> how many users hold it); empty when sound:
        each page's count equals its holders, a page nobody holds is free or cached exactly once, and
        a held page is neither."""
        errors = []
        free, cached = set(self._free), set(self._cached_free)
        if len(free) != len(self._free):
            errors.append("a page is on the free list twice")
        for page in range(1, self.num_pages):
            refs, held = self._refs[page], holders.get(page, 0)
            if refs != held:
                errors.append(f"page {page}: {refs} references, {held} holders")
            places = (page in free) + (page in cached)
            if places != (0 if held else 1):
                errors.append(f"page {page}: held {held} times, in {places} free lists")
        return errors

    @contextmanager
    def hold(self, keep_free: int) -> Iterator[list[int]]:
        """Takes all but `keep_free` free pages out of use for a while (to exercise a small pool);
        yields the pages it holds."""
        held = self.allocate(max(0, self.num_free - keep_free)) or []
        try:
            yield held
        finally:
            self.free(held)
