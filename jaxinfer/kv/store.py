"""The L3 KV tier: whole KV pages in a tensorstore kvstore, checksummed, keyed by prefix chain and model identity.

A page is stored as one value: a header line (JSON: shape, dtype, blake2b checksum, creation
time) and the raw bytes of its K and V for every layer. The key is
`<model identity digest>/<prefix-cache key hex>`, so pages of another checkpoint, dtype, page size
or layout are never found. Where the value lives is any tensorstore kvstore: a local path (the
`file` driver), a URL such as `file:///srv/kv/`, `gs://bucket/kv/`, or a driver pipeline such as
`file:///srv/kv/|ocdbt:`. Values are written whole (the `file` driver writes a temporary file and
renames it; object stores publish whole objects), so a reader sees a page complete or not at all;
a value that fails its checksum or size (corruption, truncation) is deleted and reported as a
miss, so the caller recomputes it.
The value's format and the identity are `page_value.py`'s; a read in flight is a `PendingRead`
(`pending_read.py`).

Reads are asynchronous (`read_async`): tensorstore runs them on its own threads while the
scheduler keeps stepping other requests. Demotions write asynchronously too (`put(wait=False)`;
`flush` waits for them, and a failed write is logged and leaves the index); a prefill worker's
hand-off waits for its writes before it answers. The store keeps an index of this model's values (size
and creation time; built at open from a listing and each value's header, a byte-range read, then
kept current by this process's writes) for the capacity limit (`max_bytes`: the oldest values
go first), the gauges, and to skip rewriting a page that is already stored. Other processes'
writes enter the index at the next `sweep`.

Every wait on the store has a deadline (`timeout_seconds`): a read that has not completed by then
(a hung network filesystem, a FIFO planted at a page's path) is a miss, the page is recomputed and
leaves the index so later requests do not wait on it again; a header read at open or sweep that
times out leaves the value out of the index; a listing that times out fails the open (or skips
that sweep) with an error naming the setting. A background write not done by its deadline (found at
the next write or `flush`) is not stored, and background writes then rest for a while too: they
are skipped (counted), so the next hand-offs and demotions do not each wait the deadline on a hung
store, and no more of tensorstore's I/O threads are tied up by it. The engine never blocks longer
than the deadline.

Raw kvstore values rather than one zarr array per page: a page is written once and read whole, so
zarr's chunk grid and per-array metadata would only add a second object per page.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorstore as ts

from jaxinfer.kv.page_value import HEADER_BYTES, ModelIdentity, encode_value, parse_value, read_header
from jaxinfer.kv.pending_read import PendingRead

log = logging.getLogger(__name__)

REST_SECONDS = 60  # how long reads (writes) are skipped after one timed out (the store is hung or overloaded)
PAGE_KEY_NAME = re.compile("[0-9a-f]{32}")  # a prefix-cache key (16 bytes) in hex; other names are not pages


@dataclass
class StoreStats:
    writes: int = 0
    bytes_written: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # values dropped for a bad checksum, size or header
    expired: int = 0  # values removed by `sweep`
    evicted: int = 0  # values removed to stay under `max_bytes`
    write_errors: int = 0  # writes that failed or were not done within `timeout_seconds`
    timeouts: int = 0  # reads, header reads or writes not done within `timeout_seconds`
    writes_skipped: int = 0  # background writes not made while writes rest after a timeout


@dataclass(frozen=True)
class _Write:
    future: ts.Future
    deadline: float  # perf_counter time by which it must be done (`timeout_seconds` after it started)


@dataclass(frozen=True)
class _Entry:
    nbytes: int
    created: float


def kvstore_spec(location: str) -> str | dict:
    """A local path becomes a `file` kvstore; anything with `://` is passed to tensorstore as a URL."""
    if "://" in location:
        return location if location.endswith(("/", ":")) or "|" in location else location + "/"
    return {"driver": "file", "path": os.path.abspath(location) + "/"}


class PageStore:
    def __init__(self, location: str, identity: ModelIdentity, ttl_seconds: float = 0.0, max_bytes: int = 0,
                 timeout_seconds: float = 10.0):
        self.location, self.identity = location, identity
        self.ttl_seconds, self.max_bytes, self.timeout_seconds = ttl_seconds, max_bytes, timeout_seconds
        self._kv = ts.KvStore.open(kvstore_spec(location)).result(timeout=timeout_seconds)
        self.identity_digest = identity.digest()  # names this model's values; sent to prefill peers
        self._prefix = self.identity_digest + "/"
        self.stats = StoreStats()
        self._index: dict[bytes, _Entry] = {}
        self._bytes = 0  # of the index's entries (read by the metrics thread: no iteration there)
        self._writes: dict[bytes, _Write] = {}  # background writes not yet known to be done, by page
        self._folder = None if "://" in location else Path(os.path.abspath(location))  # the `file` driver's
        self._resting_until = 0.0  # after a read times out, reads are skipped (misses) until then
        self._writes_resting_until = 0.0  # after a write times out, background writes are skipped until then
        damaged = self._scan()
        if ttl_seconds > 0 or max_bytes > 0:
            self._remove_stale(damaged, time.time())

    # -- index -------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def _index_set(self, page_key: bytes, entry: _Entry) -> None:
        self._index_pop(page_key)
        self._index[page_key] = entry
        self._bytes += entry.nbytes

    def _index_pop(self, page_key: bytes) -> None:
        entry = self._index.pop(page_key, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    def __contains__(self, page_key: bytes) -> bool:
        return page_key in self._index

    def _scan(self) -> list[bytes]:
        """Rebuilds the index from a listing and the headers; returns the keys of unreadable values.

        A value whose header is not read by the deadline stays out of the index (not damaged: slow)."""
        keys = [key for key in self.keys() if self._readable(key)]
        deadline = time.perf_counter() + self.timeout_seconds
        futures = [self._kv.read(self._key(k), byte_range=slice(0, HEADER_BYTES)) for k in keys]
        index, damaged = {}, []
        for key, future in zip(keys, futures, strict=True):
            try:
                result = self._within(future, deadline)
            except TimeoutError:
                self._timed_out(key, future, "header read")
                continue
            except Exception:  # a value shorter than the range (tensorstore refuses it), or unreadable
                result = self._read_whole(key, deadline)
            header = read_header(result.value) if result is not None and result.state == "value" else None
            if header is None:
                damaged.append(key)
            else:
                index[key] = _Entry(header["nbytes"], header["created"])
        self._index, self._bytes = index, sum(entry.nbytes for entry in index.values())
        return damaged

    def _read_whole(self, page_key: bytes, deadline: float) -> ts.KvStore.ReadResult | None:
        future = self._kv.read(self._key(page_key))
        try:
            return self._within(future, deadline)
        except TimeoutError:  # slow, not damaged: left alone
            self._timed_out(page_key, future, "header read")
            return None
        except Exception as exc:  # unreadable: counted as damaged and removed
            log.warning("KV store read of %s failed: %s", page_key.hex(), exc)
            return None

    @staticmethod
    def _within(future: ts.Future, deadline: float) -> object:
        return future.result(timeout=max(0.0, deadline - time.perf_counter()))

    def resting(self) -> bool:
        return time.monotonic() < self._resting_until

    def writes_resting(self) -> bool:
        return time.monotonic() < self._writes_resting_until

    def _readable(self, page_key: bytes) -> bool:
        """False for something other than a regular file at a local page's path (a FIFO would block a
        tensorstore thread for good): it is removed and counted as damaged."""
        if self._folder is None:
            return True
        path = self._folder / self._key(page_key)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                return True
        except FileNotFoundError:
            return True  # tensorstore reports it missing
        log.warning("KV store: %s is not a regular file; removed", path)
        with contextlib.suppress(OSError):
            os.unlink(path)
        self._index_pop(page_key)
        self.stats.corrupt += 1
        return False

    def _timed_out(self, page_key: bytes, future: ts.Future, what: str) -> None:
        """A read or write not done by its deadline: a miss, or not stored; the page leaves the index so no
        request waits on it again, and reads (background writes) rest for REST_SECONDS, skipped at once,
        rather than each wait the deadline too."""
        future.cancel()
        writing = what == "write"
        rest = "writes" if writing else "reads"
        if not (self.writes_resting() if writing else self.resting()):
            log.warning("KV store %s of %s took over %g s (engine.kv_store_timeout_seconds): %s; %s rest for %d s",
                        what, page_key.hex(), self.timeout_seconds, "not stored" if writing else "treated as a miss",
                        rest, REST_SECONDS)
        if writing:
            self._writes_resting_until = time.monotonic() + REST_SECONDS
            self.stats.write_errors += 1
        else:
            self._resting_until = time.monotonic() + REST_SECONDS
        self._index_pop(page_key)
        self.stats.timeouts += 1
        if what == "read":
            self.stats.misses += 1

    # -- values ------------------------------------------------------------------------------
    def _key(self, page_key: bytes) -> str:
        return self._prefix + page_key.hex()

    def _delete(self, page_key: bytes) -> None:
        key = self._key(page_key)
        self._index_pop(page_key)
        try:
            self._kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result(timeout=self.timeout_seconds)
        except Exception as exc:  # left for a later sweep
            log.warning("KV store delete of %s failed: %s", page_key.hex(), exc)

    def put(self, page_key: bytes, page: np.ndarray, now: float | None = None, wait: bool = True) -> bool:
        """Stores one page ([layers, 2, kv_heads, page_size, head_dim]); replaces an earlier value.

        With `wait=False` the write runs in the background (see `flush`); it is skipped (False) while
        writes rest after one timed out."""
        if not self.identity.fits(page):
            raise ValueError(f"a KV page of shape {page.shape} and dtype {page.dtype} does not fit this store's "
                             f"model ({self.identity.page_shape}, {self.identity.dtype})")
        if not wait and self.writes_resting():
            self.stats.writes_skipped += 1
            return False
        created = time.time() if now is None else now
        value, nbytes = encode_value(page, created)
        future = self._kv.write(self._key(page_key), value)
        if wait:
            future.result(timeout=self.timeout_seconds)
        self._index_set(page_key, _Entry(nbytes, created))  # before a reap, which drops it if it failed
        if not wait:
            self._writes[page_key] = _Write(future, time.perf_counter() + self.timeout_seconds)
            self._reap_writes()
        self.stats.writes += 1
        self.stats.bytes_written += len(value)
        self._enforce_capacity()
        return True

    def _reap_writes(self, block: bool = False) -> None:
        """Settles the background writes that are done, or past their deadline (`block`: waits for the
        rest until theirs): a write that failed or timed out leaves the index."""
        pending, now = {}, time.perf_counter()
        for page_key, write in self._writes.items():
            if not (block or write.future.done() or now > write.deadline):
                pending[page_key] = write
                continue
            try:
                self._within(write.future, write.deadline)
            except TimeoutError:
                self._timed_out(page_key, write.future, "write")
            except Exception as exc:  # a full disk or a lost connection: the page is simply not stored
                log.warning("KV store write of %s failed: %s", page_key.hex(), exc)
                self._index_pop(page_key)
                self.stats.write_errors += 1
        self._writes = pending

    def flush(self) -> None:
        """Waits for every background write until its deadline (`timeout_seconds` after it started): a
        write not done by then counts as failed."""
        self._reap_writes(block=True)

    def _enforce_capacity(self) -> None:
        if self.max_bytes <= 0 or self.num_bytes <= self.max_bytes:
            return  # the common case, on every write: no sort of the index
        total = self.num_bytes
        for page_key, entry in sorted(self._index.items(), key=lambda item: item[1].created):
            if total <= self.max_bytes:
                break
            if page_key in self._writes:  # deleted once written, by a later enforcement
                continue
            self._delete(page_key)
            total -= entry.nbytes
            self.stats.evicted += 1

    def read_async(self, page_keys: list[bytes]) -> PendingRead:
        return PendingRead(self, page_keys)

    def get(self, page_key: bytes) -> np.ndarray | None:
        """The stored page, or None when absent, expired, or damaged (a damaged value is deleted)."""
        return self.read_async([page_key]).pages().get(page_key)

    def _accept(self, page_key: bytes, result: ts.KvStore.ReadResult) -> np.ndarray | None:
        """A read's page if it is intact and unexpired; counts the hit or miss, deletes a damaged value."""
        if result.state != "value":
            if page_key not in self._writes:  # not still being written here
                self._index_pop(page_key)  # removed by another process
            self.stats.misses += 1
            return None
        parsed = parse_value(result.value)
        if parsed is not None and not self.identity.fits(parsed[1]):  # a consistent value of another layout
            parsed = None
        if parsed is None:
            self.stats.corrupt += 1
            self._delete(page_key)
        elif self._expired(parsed[0]["created"], time.time()):  # removed now, so the page is written again
            self._delete(page_key)
            self.stats.expired += 1
            parsed = None
        if parsed is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return parsed[1]

    def _expired(self, created: float, now: float) -> bool:
        return self.ttl_seconds > 0 and created + self.ttl_seconds < now

    def keys(self) -> list[bytes]:
        """Prefix-cache keys of this model's stored pages (a listing of the store)."""
        listing = self._kv.list(ts.KvStore.KeyRange(self._prefix, self._prefix[:-1] + "0"))
        try:
            listed = listing.result(timeout=self.timeout_seconds)
        except TimeoutError:
            listing.cancel()
            raise TimeoutError(f"KV store {self.location}: listing took over {self.timeout_seconds:g} s "
                               "(engine.kv_store_timeout_seconds)") from None
        names = [k.decode(errors="replace")[len(self._prefix) :] for k in listed]
        return [bytes.fromhex(name) for name in names if PAGE_KEY_NAME.fullmatch(name)]  # not notes or temp files

    def sweep(self, now: float | None = None) -> int:
        """Re-reads the listing and headers (pages other processes wrote enter the index), removes
        expired and unreadable values, and enforces the capacity; returns how many were removed."""
        self.flush()
        return self._remove_stale(self._scan(), time.time() if now is None else now)

    def _remove_stale(self, damaged: list[bytes], now: float) -> int:
        expired = [k for k, e in self._index.items() if self._expired(e.created, now)]
        for page_key in damaged + expired:
            self._delete(page_key)
        self.stats.expired += len(damaged) + len(expired)
        evicted_before = self.stats.evicted
        self._enforce_capacity()
        return len(damaged) + len(expired) + self.stats.evicted - evicted_before
