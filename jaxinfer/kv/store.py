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

Raw kvstore values rather than one zarr array per page: a page is written once and read whole, so
zarr's chunk grid and per-array metadata would only add a second object per page.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import tensorstore as ts

MAGIC = b"jaxinfer-kv-page/1\n"


@dataclass(frozen=True)
class ModelIdentity:
    """What must match for a stored page to be usable: the checkpoint and the KV layout."""

    checkpoint: str  # a content hash of the checkpoint (or its name, size and mtime)
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def digest(self) -> str:
        return hashlib.blake2b(json.dumps(asdict(self), sort_keys=True).encode(), digest_size=12).hexdigest()


@dataclass
class StoreStats:
    writes: int = 0
    bytes_written: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # values dropped for a bad checksum, size or header
    expired: int = 0  # values removed by `sweep`


def kvstore_spec(location: str) -> str | dict:
    """A local path becomes a `file` kvstore; anything with `://` is passed to tensorstore as a URL."""
    if "://" in location:
        return location if location.endswith(("/", ":")) or "|" in location else location + "/"
    return {"driver": "file", "path": os.path.abspath(location) + "/"}


class PageStore:
    def __init__(self, location: str, identity: ModelIdentity, ttl_seconds: float = 0.0):
        self.location, self.identity, self.ttl_seconds = location, identity, ttl_seconds
        self._kv = ts.KvStore.open(kvstore_spec(location)).result()
        self._prefix = identity.digest() + "/"
        self.stats = StoreStats()

    def _key(self, page_key: bytes) -> str:
        return self._prefix + page_key.hex()

    def put(self, page_key: bytes, page: np.ndarray, now: float | None = None) -> None:
        """Stores one page ([layers, 2, kv_heads, page_size, head_dim]); replaces an earlier value."""
        data = np.ascontiguousarray(page).tobytes()
        header = {"shape": list(page.shape), "dtype": str(page.dtype), "nbytes": len(data),
                  "blake2b": hashlib.blake2b(data, digest_size=16).hexdigest(),
                  "created": time.time() if now is None else now}
        value = MAGIC + json.dumps(header).encode() + b"\n" + data
        self._kv.write(self._key(page_key), value).result()
        self.stats.writes += 1
        self.stats.bytes_written += len(value)

    def get(self, page_key: bytes) -> np.ndarray | None:
        """The stored page, or None when absent, expired, or damaged (a damaged value is deleted)."""
        key = self._key(page_key)
        result = self._kv.read(key).result()
        if result.state != "value":
            self.stats.misses += 1
            return None
        parsed = self._parse(result.value)
        if parsed is None:
            self.stats.corrupt += 1
            self._kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
            self.stats.misses += 1
            return None
        header, page = parsed
        if self._expired(header, time.time()):
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return page

    @staticmethod
    def _parse(value: bytes) -> tuple[dict, np.ndarray] | None:
        if not value.startswith(MAGIC):
            return None
        end = value.find(b"\n", len(MAGIC))
        try:
            header = json.loads(value[len(MAGIC) : end])
            data = value[end + 1 :]
            if end < 0 or len(data) != header["nbytes"]:
                return None
            if hashlib.blake2b(data, digest_size=16).hexdigest() != header["blake2b"]:
                return None
            return header, np.frombuffer(data, dtype=np.dtype(header["dtype"])).reshape(header["shape"])
        except (ValueError, KeyError, TypeError):
            return None

    def _expired(self, header: dict, now: float) -> bool:
        return self.ttl_seconds > 0 and header["created"] + self.ttl_seconds < now

    def keys(self) -> list[bytes]:
        """Prefix-cache keys of this model's stored pages."""
        listed = self._kv.list(ts.KvStore.KeyRange(self._prefix, self._prefix[:-1] + "0")).result()
        return [bytes.fromhex(k.decode()[len(self._prefix) :]) for k in listed]

    def sweep(self, now: float | None = None) -> int:
        """Removes this model's expired (and damaged) values; returns how many were removed."""
        now = time.time() if now is None else now
        removed = 0
        for page_key in self.keys():
            key = self._key(page_key)
            result = self._kv.read(key).result()
            parsed = self._parse(result.value) if result.state == "value" else None
            if parsed is None or self._expired(parsed[0], now):
                self._kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
                removed += 1
        self.stats.expired += removed
        return removed
