"""A program's changed files commit as one transaction (jaxinfer/processor/tenant_commit.py).

Real files in a temporary folder. The crash tests kill a real process at a chosen point of its commit
(it replaces one ``os`` function with one that calls ``os._exit``) and then let this process recover
the folder the way the engine does: by taking the tenant's lock before it reads.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from jaxinfer.processor.tenant_commit import RESERVED_PREFIX, commit_files, tenant_lock
from jaxinfer.processor.wasi import FileAccessError, FileMapping, Syscalls

REPO = Path(__file__).resolve().parent.parent
OLD = {"a.txt": b"old a", "b.txt": b"old b"}
NEW = {"a.txt": b"new a!", "b.txt": b"new b!", "new/c.txt": b"new c!"}


@pytest.fixture()
def tenant(tmp_path: Path) -> Path:
    folder = tmp_path / "acme"
    folder.mkdir()
    for name, data in OLD.items():
        (folder / name).write_bytes(data)
    return folder


def contents(folder: Path) -> dict[str, bytes]:
    """Every regular file below ``folder`` by relative path (reserved names included, to catch leftovers)."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def leftovers(folder: Path) -> list[str]:
    return [str(path.relative_to(folder)) for path in folder.rglob("*") if path.name.startswith(RESERVED_PREFIX)]


def test_a_commit_replaces_every_file_and_leaves_nothing_of_its_own(tenant: Path) -> None:
    (tenant / "a.txt").chmod(0o640)
    commit_files(tenant, NEW)
    assert contents(tenant) == NEW
    assert (tenant / "a.txt").stat().st_mode & 0o777 == 0o640
    assert (tenant / "new" / "c.txt").stat().st_mode & 0o777 == 0o600


def test_a_file_that_cannot_be_replaced_leaves_all_of_them_as_they_were(tenant: Path) -> None:
    """The third file's name became a folder while the program ran: nothing is written, nothing staged."""
    syscalls = Syscalls(FileMapping(tenant.parent, "acme", ("a.txt", "new/c.txt", "d.txt")))
    for handle in syscalls.files.values():
        handle.data[:] = b"changed"
        handle.dirty = True
    (tenant / "d.txt").mkdir()
    with pytest.raises(IsADirectoryError, match=r"'d\.txt' is a folder"):
        syscalls.commit()
    assert contents(tenant) == OLD and not leftovers(tenant)
    (tenant / "d.txt").rmdir()
    assert syscalls.commit() == {"a.txt": b"changed", "new/c.txt": b"changed", "d.txt": b"changed"}
    assert contents(tenant) == {**OLD, "a.txt": b"changed", "new/c.txt": b"changed", "d.txt": b"changed"}


CRASHING_COMMIT = """
import os, sys
from pathlib import Path
from jaxinfer.processor.tenant_commit import commit_files

function, prefix, nth = sys.argv[2], sys.argv[3], int(sys.argv[4])
original, calls = getattr(os, function), []

def crash_at_the_nth_call(name, *args, **kwargs):
    if str(name).startswith(prefix):
        calls.append(name)
        if len(calls) == nth:
            os._exit(9)  # no cleanup of any kind: what a SIGKILL or a power cut leaves
    return original(name, *args, **kwargs)

setattr(os, function, crash_at_the_nth_call)
commit_files(Path(sys.argv[1]), {NEW!r})
os._exit(0)
"""

# what dies: (os function, a prefix of its first argument, which such call), and what a reader then finds
CRASH_POINTS = {
    "while staging the second file": ("link", "b.txt", 1, OLD),
    "after the first rename into place": ("replace", f"{RESERVED_PREFIX}staged", 2, OLD),
    "after the last rename into place": ("rename", RESERVED_PREFIX + "journal", 2, OLD),
    "after the commit point": ("unlink", f"{RESERVED_PREFIX}prior", 1, NEW),
}


def test_a_commit_killed_anywhere_is_undone_or_finished_by_the_next_reader(tenant: Path, tmp_path: Path) -> None:
    """Each crash point in its own copy of the folder, the processes run at once. Before the commit point
    a reader finds the old files; after it, all the new ones; never a mix, and no staged file is left."""
    folders, processes = {}, {}
    for index, (point, (function, prefix, nth, _)) in enumerate(CRASH_POINTS.items()):
        folders[point] = tmp_path / f"crash{index}" / "acme"
        folders[point].mkdir(parents=True)
        for name, data in OLD.items():
            (folders[point] / name).write_bytes(data)
        script = textwrap.dedent(CRASHING_COMMIT).replace("{NEW!r}", repr(NEW))
        processes[point] = subprocess.Popen([sys.executable, "-c", script, str(folders[point]), function, prefix,
                                             str(nth)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    for point, process in processes.items():
        _, err = process.communicate(timeout=120)
        assert process.returncode == 9, f"{point}: the commit was not cut where the test meant ({err[-2000:]})"
        assert leftovers(folders[point]), f"{point}: the crash left no journal to recover from"
    for point, (_, _, _, expected) in CRASH_POINTS.items():
        folder = folders[point]
        mapping = FileMapping(folder.parent, "acme", tuple(NEW))
        syscalls = Syscalls(mapping)  # maps under the tenant's lock, recovering first
        seen = {handle.relative: bytes(handle.data) for handle in syscalls.files.values() if handle.data}
        assert seen == expected, point
        assert contents(folder) == expected and not leftovers(folder), point


def test_a_reader_waits_for_a_commit_in_progress(tenant: Path) -> None:
    """The lock is what keeps a reader from seeing half of a commit: a commit started while the lock is
    held waits, and the reader under it still sees the old files."""
    committed = threading.Event()
    with tenant_lock(tenant):
        writer = threading.Thread(target=lambda: (commit_files(tenant, NEW), committed.set()))
        writer.start()
        time.sleep(0.3)
        assert not committed.is_set() and contents(tenant) == OLD
    writer.join(timeout=30)
    assert committed.is_set() and contents(tenant) == NEW


@pytest.mark.parametrize("path", [f"{RESERVED_PREFIX}journal", f"notes/{RESERVED_PREFIX}staged-0"])
def test_names_reserved_for_commits_cannot_be_mapped(tenant: Path, path: str) -> None:
    with pytest.raises(FileAccessError, match=rf"'{path}': names starting with '\.jaxinfer-' are reserved"):
        FileMapping(tenant.parent, "acme", (path,)).check()
