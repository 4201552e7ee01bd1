"""Fault injection for the L3 KV store: a process writing pages is killed (-9) at a random moment, again
and again on the same store; after each kill a fresh process's store must be whole.

    python tools/kv_fault.py --trials 50                    # the file driver
    python tools/kv_fault.py --trials 50 --driver ocdbt     # file|ocdbt: one database over files

The writer stores pages the way the engine demotes them (`PageStore.put(wait=False)` in groups, then
`flush`), each page's content derived from its number; it appends "start N" before a group and
"done N" once the group is flushed to a journal it fsyncs. After each kill the store is opened anew
and checked:
- it opens (the store is readable), and every page it lists reads back bit for bit as written: a
  cut write is never served (`served_corrupt` must be 0);
- every page journaled done is there (`lost_done` must be 0);
- the pages lost are only those of the group in flight at each kill (at most a group per kill).
Prints one JSON line with the totals; the exit status is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxinfer.kv.store import ModelIdentity, PageStore

IDENTITY = ModelIdentity("kv-fault:sha-test", "float32", page_size=8, num_layers=4, num_kv_heads=3, head_dim=64)
SHAPE = (IDENTITY.num_layers, 2, IDENTITY.num_kv_heads, IDENTITY.page_size, IDENTITY.head_dim)
GROUP = 8  # pages per background-write group (a demotion's worth)
CONTENTS = 4 * GROUP  # distinct page contents: page N holds content N % CONTENTS


def page_key(number: int) -> bytes:
    return hashlib.blake2b(number.to_bytes(8, "little"), digest_size=16).digest()


def page_of(number: int) -> np.ndarray:
    return np.random.default_rng(number).standard_normal(SHAPE).astype(np.float32)


def location(root: Path, driver: str) -> str:
    return str(root) if driver == "file" else f"file://{root}/|ocdbt:"


def writer(root: Path, driver: str, journal: Path, first: int) -> None:
    """Writes groups of pages from number `first` on, journaling each group, until killed."""
    store = PageStore(location(root, driver), IDENTITY)
    contents = [page_of(i) for i in range(CONTENTS)]  # made before "ready": from then on writes are all I/O
    with open(journal, "a") as log:
        print("ready", flush=True)
        number = first
        while True:
            _journal(log, f"start {number}")
            for n in range(number, number + GROUP):
                store.put(page_key(n), contents[n % CONTENTS], wait=False)
            store.flush()
            _journal(log, f"done {number}")
            number += GROUP


def _journal(log, line: str) -> None:
    log.write(line + "\n")
    log.flush()
    os.fsync(log.fileno())


def read_journal(journal: Path) -> tuple[set[int], set[int]]:
    started, done = set(), set()
    for line in journal.read_text().splitlines():
        word, _, number = line.partition(" ")
        if word in ("start", "done") and number.isdigit():
            (started if word == "start" else done).add(int(number))
    return started, done


def check(root: Path, driver: str, journals: list[Path]) -> dict[str, int]:
    """Opens the store anew and compares it with what the journals say was written; `lost_last`: the
    pages of the last journal's started groups that are missing."""
    store = PageStore(location(root, driver), IDENTITY)
    number_of = {}
    counts = {"pages_listed": 0, "served_corrupt": 0, "dropped_unreadable": 0, "lost_done": 0, "lost_in_flight": 0,
              "lost_last": 0}
    for journal in journals:
        started, done = read_journal(journal)
        for group in started:
            for n in range(group, group + GROUP):
                number_of[page_key(n)] = n
                if page_key(n) not in store:
                    counts["lost_done" if group in done else "lost_in_flight"] += 1
                    counts["lost_last"] += journal == journals[-1]
    listed = store.keys()  # a PageStore, not a dict
    for key in listed:
        counts["pages_listed"] += 1
        got = store.get(key)
        if got is None:
            counts["dropped_unreadable"] += 1  # damaged: deleted and a miss, never served
        elif key not in number_of or not np.array_equal(got, page_of(number_of[key] % CONTENTS)):
            counts["served_corrupt"] += 1
    return counts


def kill_one(root: Path, driver: str, journal: Path, first: int, rng: random.Random) -> float:
    command = [sys.executable, __file__, "--writer", str(root), "--driver", driver, "--journal", str(journal),
               "--first", str(first)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the writer did not start (exit {proc.wait()})")
        delay = rng.uniform(0.05, 1.5)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    return delay


def campaign(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kv-fault-"))
    root, journals, failures, counts = work / "store", [], [], {}
    try:
        for trial in range(args.trials):
            journals.append(work / f"journal-{trial}")
            kill_one(root, args.driver, journals[-1], trial * 1_000_000, rng)
            counts = check(root, args.driver, journals)
            if counts["served_corrupt"] or counts["lost_done"] or counts["lost_last"] > GROUP:
                failures.append({"trial": trial, **counts})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    counts.pop("lost_last", None)
    return {"what": "kv_fault", "driver": args.driver, "kills": args.trials, "group": GROUP, **counts,
            "failures": failures[:5], "ok": not failures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20, help="kills, each of a fresh writer on the same store")
    p.add_argument("--driver", choices=("file", "ocdbt"), default="file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--writer", help=argparse.SUPPRESS)  # the child: write pages into this folder until killed
    p.add_argument("--journal", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.writer:
        writer(Path(args.writer), args.driver, Path(args.journal), args.first)
        return 0
    result = campaign(args)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
