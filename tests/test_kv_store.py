"""The L3 page store on real tensorstore kvstores: round trips, model identity, damage, TTL, restart, ocdbt."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxinfer.kv.prefix_cache import chain_keys
from jaxinfer.kv.store import ModelIdentity, PageStore

IDENTITY = ModelIdentity("smollm2-135m:sha-test", "float32", page_size=8, num_layers=30, num_kv_heads=3, head_dim=64)
SHAPE = (IDENTITY.num_layers, 2, IDENTITY.num_kv_heads, IDENTITY.page_size, IDENTITY.head_dim)


def page(seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(dtype)


KEYS = chain_keys(list(range(40)), 8)  # five real prefix-cache keys


def value_file(root: Path, store: PageStore, key: bytes) -> Path:
    return root / IDENTITY.digest() / key.hex()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_pages_round_trip_exactly(tmp_path, dtype):
    store = PageStore(str(tmp_path), ModelIdentity(**{**IDENTITY.__dict__, "dtype": np.dtype(dtype).name}))
    for i, key in enumerate(KEYS):
        store.put(key, page(i, dtype))
    for i, key in enumerate(KEYS):
        got = store.get(key)
        assert got.dtype == np.dtype(dtype) and np.array_equal(got.view(np.uint8), page(i, dtype).view(np.uint8))
    assert sorted(store.keys()) == sorted(KEYS)
    assert store.get(chain_keys(list(range(8)), 8, salt="other")[0]) is None
    assert (store.stats.hits, store.stats.misses, store.stats.writes) == (5, 1, 5)


def test_another_model_or_layout_never_sees_the_pages(tmp_path):
    PageStore(str(tmp_path), IDENTITY).put(KEYS[0], page(0))
    for change in (dict(checkpoint="other"), dict(dtype="bfloat16"), dict(page_size=16)):
        other = ModelIdentity(**{**IDENTITY.__dict__, **change})
        assert PageStore(str(tmp_path), other).get(KEYS[0]) is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty", "header types"])
def test_damaged_values_are_dropped_and_reported_as_misses(tmp_path, damage):
    store = PageStore(str(tmp_path), IDENTITY)
    store.put(KEYS[1], page(1))
    path = value_file(tmp_path, store, KEYS[1])
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0x01
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "garbage":
        raw = bytearray(b"not a page at all")  # shorter than the header read of a scan
    elif damage == "empty":
        raw = bytearray()
    else:  # the checksum covers the data only: a header's fields must be checked by type
        quoted = bytes(raw).replace(b'"nbytes": ', b'"nbytes": "', 1).replace(b', "blake2b"', b'", "blake2b"', 1)
        raw = bytearray(quoted)  # "nbytes": "12288"
    path.write_bytes(bytes(raw))
    if damage in ("garbage", "empty", "header types"):  # a scan reads every header: a bad one must not stop it
        reopened = PageStore(str(tmp_path), IDENTITY)
        assert KEYS[1] not in reopened and reopened.sweep() == 1 and not path.exists()
        store.put(KEYS[1], page(1))
        path.write_bytes(bytes(raw))
    assert store.get(KEYS[1]) is None
    assert store.stats.corrupt == 1 and not path.exists()  # deleted, so it is recomputed and rewritten


def test_a_consistent_value_of_another_layout_is_refused(tmp_path):
    """A value with an intact header and checksum, but another model's page shape or dtype, under this
    model's name (another writer's bug or a hand-made file), is never imported: its values would be
    cast or fail to fit the device pages."""
    store = PageStore(str(tmp_path), IDENTITY)
    for other in (dict(dtype="bfloat16"), dict(head_dim=32)):
        identity = ModelIdentity(**{**IDENTITY.__dict__, **other})
        data = np.zeros(identity.page_shape, ml_dtypes.bfloat16 if other.get("dtype") else np.float32)
        PageStore(str(tmp_path), identity).put(KEYS[2], data)
        value_file(tmp_path, store, KEYS[2]).parent.mkdir(exist_ok=True)
        (tmp_path / identity.digest() / KEYS[2].hex()).rename(value_file(tmp_path, store, KEYS[2]))
        store.sweep()  # enters the index, as another process's write would
        assert KEYS[2] in store and store.get(KEYS[2]) is None
        assert not value_file(tmp_path, store, KEYS[2]).exists()
    assert store.stats.corrupt == 2
    with pytest.raises(ValueError, match=r"does not fit this store's model \(\(30, 2, 3, 8, 64\), float32\)"):
        store.put(KEYS[3], page(3).astype(ml_dtypes.bfloat16))


def test_files_that_are_not_pages_are_left_alone(tmp_path):
    store = PageStore(str(tmp_path), IDENTITY)
    store.put(KEYS[0], page(0))
    notes = tmp_path / IDENTITY.digest() / "notes.txt"
    notes.write_text("an operator's note, or an NFS leftover")
    reopened = PageStore(str(tmp_path), IDENTITY, max_bytes=1 << 30)
    assert reopened.keys() == [KEYS[0]] and reopened.sweep() == 0 and notes.exists()


def test_ttl_expires_and_sweep_removes(tmp_path):
    store = PageStore(str(tmp_path), IDENTITY, ttl_seconds=60)
    store.put(KEYS[0], page(0), now=1_000.0)  # long ago
    store.put(KEYS[1], page(1))
    store.put(KEYS[2], page(2), now=1_000.0)  # long ago, and never read
    assert store.get(KEYS[0]) is None and store.get(KEYS[1]) is not None
    assert KEYS[0] not in store  # an expired read removes it at once: the page is stored again when evicted
    assert store.sweep() == 1  # the unread expired page
    assert store.keys() == [KEYS[1]] and store.stats.expired == 2


def test_a_new_process_reads_pages_written_by_an_earlier_one(tmp_path):
    PageStore(str(tmp_path), IDENTITY).put(KEYS[2], page(2))
    child = f"""
import numpy as np, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_kv_store import IDENTITY, KEYS, page
from jaxinfer.kv.store import PageStore
got = PageStore({str(tmp_path)!r}, IDENTITY).get(KEYS[2])
print(np.array_equal(got, page(2)))
"""
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "True", proc.stderr


def test_ocdbt_over_file_works_through_a_url(tmp_path):
    store = PageStore(f"file://{tmp_path}/kv/|ocdbt:", IDENTITY)
    store.put(KEYS[3], page(3))
    again = PageStore(f"file://{tmp_path}/kv/|ocdbt:", IDENTITY)
    assert np.array_equal(again.get(KEYS[3]), page(3)) and again.keys() == [KEYS[3]]


def test_capacity_removes_the_oldest_values_first(tmp_path):
    one = len(page(0).tobytes())
    store = PageStore(str(tmp_path), IDENTITY, max_bytes=3 * one)
    for i, key in enumerate(KEYS):
        store.put(key, page(i), now=1_000.0 + i)
    assert store.num_pages == 3 and store.num_bytes == 3 * one and store.stats.evicted == 2
    assert sorted(store.keys()) == sorted(KEYS[2:])  # the two oldest are gone from the store itself
    assert store.get(KEYS[0]) is None and np.array_equal(store.get(KEYS[4]), page(4))


def test_the_index_is_rebuilt_from_headers_and_sweep_sees_other_writers(tmp_path):
    writer = PageStore(str(tmp_path), IDENTITY)
    writer.put(KEYS[0], page(0))
    reader = PageStore(str(tmp_path), IDENTITY)  # opened later: its index is read from the store
    assert KEYS[0] in reader and reader.num_bytes == len(page(0).tobytes())
    writer.put(KEYS[1], page(1))
    assert KEYS[1] not in reader  # another process's write enters the index at the next sweep
    assert reader.sweep() == 0 and KEYS[1] in reader and reader.num_pages == 2


def test_reads_run_asynchronously_and_check_every_page(tmp_path):
    store = PageStore(str(tmp_path), IDENTITY)
    for i, key in enumerate(KEYS[:3]):
        store.put(key, page(i))
    path = value_file(tmp_path, store, KEYS[1])
    path.write_bytes(path.read_bytes()[:-10])  # truncated
    pending = store.read_async(KEYS)
    pending.wait()
    assert pending.done()
    got = pending.pages()
    assert sorted(got) == sorted([KEYS[0], KEYS[2]]) and np.array_equal(got[KEYS[2]], page(2))
    assert (store.stats.hits, store.stats.corrupt, store.stats.misses) == (2, 1, 3)
    assert KEYS[1] not in store and not path.exists()


def test_background_writes_are_complete_after_flush(tmp_path):
    store = PageStore(str(tmp_path), IDENTITY)
    for i, key in enumerate(KEYS):
        store.put(key, page(i), wait=False)
    store.flush()
    reopened = PageStore(str(tmp_path), IDENTITY)
    assert reopened.num_pages == len(KEYS) and np.array_equal(reopened.get(KEYS[3]), page(3))


def test_opening_with_a_ttl_or_capacity_removes_what_is_stale(tmp_path):
    writer = PageStore(str(tmp_path), IDENTITY)
    writer.put(KEYS[0], page(0), now=1_000.0)
    writer.put(KEYS[1], page(1))
    writer.put(KEYS[2], page(2))
    one = len(page(0).tobytes())
    opened = PageStore(str(tmp_path), IDENTITY, ttl_seconds=3600, max_bytes=one)
    assert opened.stats.expired == 1 and opened.stats.evicted == 1 and opened.num_pages == 1
    assert PageStore(str(tmp_path), IDENTITY).keys() == [KEYS[2]]  # the newest stays


def test_tiers_sweep_the_store_periodically(tmp_path):
    from jaxinfer.kv.tiers import TieredPages

    store = PageStore(str(tmp_path), IDENTITY)
    tiers = TieredPages(None, store, sweep_seconds=0.05)
    PageStore(str(tmp_path), IDENTITY).put(KEYS[4], page(4))  # another process's write
    tiers.maybe_sweep()
    assert KEYS[4] not in store  # not due yet
    time.sleep(0.06)
    tiers.maybe_sweep()
    assert KEYS[4] in store


def release_fifo(path: Path) -> None:
    """Opens the FIFO as a writer and closes it: reads still blocked in open() see an empty value and end."""
    os.close(os.open(path, os.O_RDWR))


def test_a_read_that_never_completes_is_a_miss_after_the_deadline(tmp_path):
    """A FIFO at a page's path blocks tensorstore's read forever, as a hung network filesystem does
    (through a `file://` URL the store does not look at the path itself): the read ends as a miss at
    the deadline, the page leaves the index, reads rest for a while (misses at once, not a wait
    each), and opening the store again leaves the page out instead of waiting on its header."""
    store = PageStore(f"file://{tmp_path}/", IDENTITY, timeout_seconds=2.0)
    for i, key in enumerate(KEYS[:3]):
        store.put(key, page(i))
    # The hung value is read last: tensorstore may queue reads issued after a blocked one behind it
    # (they too would be misses at the deadline), so the healthy ones go first.
    fifo = value_file(tmp_path, store, KEYS[2])
    fifo.unlink()
    os.mkfifo(fifo)
    try:
        started = time.perf_counter()
        pending = store.read_async(KEYS[:3])
        pending.wait()
        assert pending.done() and time.perf_counter() - started < 20
        got = pending.pages()
        assert sorted(got) == sorted(KEYS[:2]) and np.array_equal(got[KEYS[1]], page(1))
        assert (store.stats.timeouts, store.stats.misses, store.stats.corrupt) == (1, 1, 0)
        assert KEYS[2] not in store and KEYS[0] in store
        assert store.resting() and store.get(KEYS[0]) is None and store.stats.misses == 2  # no wait
        started = time.perf_counter()
        reopened = PageStore(f"file://{tmp_path}/", IDENTITY, timeout_seconds=2.0)
        assert time.perf_counter() - started < 20 and KEYS[2] not in reopened and reopened.stats.timeouts >= 1
        assert fifo.exists()  # slow is not damaged: nothing is deleted for it
    finally:
        release_fifo(fifo)


def test_a_write_that_never_completes_is_dropped_and_writes_rest(tmp_path):
    """A FIFO where tensorstore's file driver writes a value before renaming it (`<key>.__lock`) blocks
    that write for good (its open waits for a reader), as a hung store does: `flush` gives up at the
    deadline and the page is not stored. Background writes then rest (skipped at once) instead of
    every later flush waiting the deadline again on the same hung store, and also when no flush
    comes: a later write finds the hung one past its deadline."""
    store = PageStore(f"file://{tmp_path}/", IDENTITY, timeout_seconds=2.0)
    store.put(KEYS[0], page(0))
    locks = [value_file(tmp_path, store, key).with_name(key.hex() + ".__lock") for key in KEYS[1:3]]
    for lock in locks:
        os.mkfifo(lock)
    try:
        store.put(KEYS[1], page(1), wait=False)
        started = time.perf_counter()
        store.flush()
        assert 1.5 < time.perf_counter() - started < 20 and KEYS[1] not in store and KEYS[0] in store
        started = time.perf_counter()
        store.put(KEYS[2], page(2), wait=False)
        store.flush()
        assert time.perf_counter() - started < 1.5 and KEYS[2] not in store  # it waited 2 s again
        assert (store.stats.timeouts, store.stats.write_errors, store.stats.writes_skipped) == (1, 1, 1)
        assert store.writes_resting() and not store.resting()  # reads are not affected
        assert store.get(KEYS[0]) is not None
        # Without a flush (an engine that only demotes), the next write finds the hung one past its deadline.
        demoting = PageStore(f"file://{tmp_path}/", IDENTITY, timeout_seconds=1.0)
        demoting.put(KEYS[2], page(2), wait=False)
        time.sleep(1.5)
        demoting.put(KEYS[3], page(3), wait=False)
        assert demoting.writes_resting() and KEYS[2] not in demoting and demoting.stats.timeouts == 1
    finally:
        for lock in locks:
            release_fifo(lock)  # the blocked open finds a reader, then tensorstore refuses the FIFO


def test_a_fifo_at_a_local_page_path_is_removed_without_reading_it(tmp_path):
    """With a local path the store checks what is there first: a FIFO would hold a tensorstore I/O
    thread for good even after the deadline, and enough of them stall every later read and write."""
    store = PageStore(str(tmp_path), IDENTITY, timeout_seconds=30)
    for i, key in enumerate(KEYS[:2]):
        store.put(key, page(i))
    fifo = value_file(tmp_path, store, KEYS[1])
    fifo.unlink()
    os.mkfifo(fifo)
    started = time.perf_counter()
    got = store.read_async(KEYS[:2]).pages()
    assert time.perf_counter() - started < 5 and sorted(got) == [KEYS[0]]
    assert (store.stats.corrupt, store.stats.timeouts) == (1, 0) and not fifo.exists() and KEYS[1] not in store
    os.mkfifo(fifo)  # one planted before a (re)open: the scan skips and removes it too
    assert PageStore(str(tmp_path), IDENTITY, timeout_seconds=30).num_pages == 1 and not fifo.exists()
