"""A fault sweep (not a test): a tenant commit cut at each of its system calls must come out whole.

    python tools/commit_fault_sweep.py               # crash at every call, then an injected error at every call
    python tools/commit_fault_sweep.py --nested      # also crash each recovery at each of its own calls (minutes)

The folder holds an existing file with mode 0640, a symbolic link, a file in a subfolder; the commit
replaces them and adds a file two new folders deep and one at the top (jaxinfer/processor/tenant_commit.py).

- crash: a forked child runs the commit and calls ``os._exit`` at the n-th call of the ``os`` functions
  the protocol uses (no clean-up of any kind); this process then takes the tenant's lock, which
  recovers, and the files must be all old or all new, with no ``.jaxinfer-`` name left.
- error: the n-th call raises EIO in this process; ``commit_files`` must raise with the files all old,
  or return with them all new, and the next lock must leave nothing behind.

Prints one JSON line per mode: the calls of one commit, the last call after which a crash leaves the old
files, and the count of bad outcomes (0 when the protocol holds).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxinfer.processor import tenant_commit  # noqa: E402
from jaxinfer.processor.tenant_commit import RESERVED_PREFIX, commit_files, tenant_lock  # noqa: E402

WATCHED = ("open", "close", "fsync", "link", "symlink", "replace", "rename", "unlink", "stat", "mkdir", "fchmod")
NEW = {"a.txt": b"new a", "b.txt": b"new b", "link": b"new link", "new/deep/c.txt": b"new c",
       "sub/d.txt": b"new d", "e.txt": b"new e"}


def fill(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "sub").mkdir(parents=True)
    for name, data in (("a.txt", b"old a"), ("b.txt", b"old b"), ("sub/d.txt", b"old d")):
        (folder / name).write_bytes(data)
    (folder / "a.txt").chmod(0o640)
    os.symlink("a.txt", folder / "link")


def snapshot(folder: Path) -> dict[str, tuple]:
    """Files and links by relative path, with contents and modes (folders are left out: a rolled-back
    commit may leave the empty ones it created)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            found[str(path.relative_to(folder))] = ("link", os.readlink(path))
        elif stat.S_ISREG(info.st_mode):
            found[str(path.relative_to(folder))] = ("file", path.read_bytes(), stat.S_IMODE(info.st_mode))
    return found


class CallCounter:
    """Wraps the watched ``os`` functions (and ``flock``); calls ``action(name)`` at the n-th call."""

    def __init__(self, at: int, action: Callable[[str], None] | None) -> None:
        self.at, self.action, self.calls, self.originals = at, action, 0, {}

    def __enter__(self) -> CallCounter:
        for name in WATCHED:
            self.originals[(os, name)] = getattr(os, name)
        self.originals[(fcntl, "flock")] = fcntl.flock
        for (module, name), original in self.originals.items():
            setattr(module, name, self._wrap(name, original))
        return self

    def _wrap(self, name: str, original: Callable) -> Callable:
        def counted(*args, **kwargs):
            self.calls += 1
            if self.calls == self.at and self.action is not None:
                self.action(name)
            return original(*args, **kwargs)
        return counted

    def __exit__(self, *exc) -> None:
        for (module, name), original in self.originals.items():
            setattr(module, name, original)


def calls_of(work: Callable[[], None]) -> int:
    with CallCounter(0, None) as counter:
        work()
    return counter.calls


def crash_at(at: int, work: Callable[[], None]) -> None:
    child = os.fork()
    if child == 0:
        def die(_: str) -> None:
            os._exit(9)
        try:
            with CallCounter(at, die):
                work()
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def outcome(folder: Path, old: dict, new: dict) -> str:
    with tenant_lock(folder):
        pass
    now = snapshot(folder)
    if any(RESERVED_PREFIX in name for name in now):
        return "leftovers"
    return "old" if now == old else "new" if now == new else "mixed"


def sweep_crashes(folder: Path, old: dict, new: dict, nested: bool) -> dict:
    def commit() -> None:
        commit_files(folder, NEW)

    def recovery() -> None:
        with tenant_lock(folder):
            pass

    fill(folder)
    total, bad, last_old = calls_of(commit), 0, 0
    kept = folder.parent / "kept"
    for at in range(1, total + 1):
        fill(folder)
        crash_at(at, commit)
        if nested:
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(folder, kept, symlinks=True)
        result = outcome(folder, old, new)
        bad += result not in ("old", "new")
        last_old = at if result == "old" else last_old
        if nested:
            shutil.rmtree(folder)
            shutil.copytree(kept, folder, symlinks=True)
            for inner in range(1, calls_of(recovery) + 1):
                shutil.rmtree(folder)
                shutil.copytree(kept, folder, symlinks=True)
                crash_at(inner, recovery)
                bad += outcome(folder, old, new) != result
    return dict(mode="crash", nested=nested, calls=total, last_call_leaving_old=last_old, bad=bad)


def sweep_errors(folder: Path, old: dict, new: dict) -> dict:
    def fail(name: str) -> None:
        if name != "close":  # a failing close changes nothing on disk
            raise OSError(errno.EIO, f"injected at {name}")

    fill(folder)
    total, bad = calls_of(lambda: commit_files(folder, NEW)), 0
    tenant_commit.log.disabled = True  # clean-up warnings after the commit point are expected here
    for at in range(1, total + 1):
        fill(folder)
        raised = False
        try:
            with CallCounter(at, fail):
                commit_files(folder, NEW)
        except OSError:
            raised = True
        core = {name: value for name, value in snapshot(folder).items() if RESERVED_PREFIX not in name}
        bad += core != (old if raised else new)
        bad += outcome(folder, old, new) != ("old" if raised else "new")
    return dict(mode="error", calls=total, bad=bad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nested", action="store_true", help="also crash each recovery at each of its calls")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "acme"
        fill(folder)
        old = snapshot(folder)
        commit_files(folder, NEW)
        new = snapshot(folder)
        print(json.dumps(sweep_crashes(folder, old, new, args.nested)))
        print(json.dumps(sweep_errors(folder, old, new)))


if __name__ == "__main__":
    main()
