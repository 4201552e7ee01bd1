"""A program's changed files commit as one transaction (jaxinfer/processor/tenant_commit.py).

Real files in a temporary folder. The crash tests kill a real process at a chosen point of its commit
(it replaces one ``os`` function with one that calls ``os._exit``) and then let this process recover
the folder the way the engine does: by taking the tenant's lock before it reads.
"""

from __future__ import annotations

import errno
import json
import os
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


@pytest.mark.parametrize(("paths", "rule"), [
    (("x", "x/y"), r"'x' is a file and a folder of 'x/y'"),
    (("a.txt", "./a.txt"), r"'a\.txt' and '\./a\.txt' name the same file"),
])
def test_paths_no_commit_could_take_are_refused_before_the_program_runs(tenant: Path, paths, rule) -> None:
    with pytest.raises(FileAccessError, match=rule):
        FileMapping(tenant.parent, "acme", paths).check()
    with pytest.raises(OSError, match=rule):
        commit_files(tenant, dict.fromkeys(paths, b"x"))
    assert contents(tenant) == OLD and not leftovers(tenant)


def test_a_journal_that_points_outside_the_folder_is_refused_not_followed(tenant: Path, tmp_path: Path) -> None:
    """A journal is written whole by the engine, so one naming a path out of the folder was planted: the
    tenant's files stay locked with an error naming it, and nothing outside is touched."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not the tenant's")
    entry = dict(path=str(victim), staged=f"{RESERVED_PREFIX}staged-{'0' * 16}",
                 prior=f"{RESERVED_PREFIX}prior-{'0' * 16}", existed=False)
    (tenant / f"{RESERVED_PREFIX}journal").write_text(json.dumps([entry]))
    with pytest.raises(FileAccessError, match=r"\.jaxinfer-journal: not a commit journal .*must be a relative path"):
        FileMapping(tenant.parent, "acme", ("a.txt",)).check()
    assert victim.read_bytes() == b"not the tenant's" and contents(tenant)["a.txt"] == OLD["a.txt"]


def test_a_clean_up_failure_after_the_commit_point_is_not_a_failed_commit(tenant: Path, monkeypatch) -> None:
    """Every file is new once the journal is marked done: removing the prior copies may fail (here, by an
    injected error), and the commit still returns; the next lock removes what is left."""
    real_unlink = os.unlink

    def refuse_priors(name, *args, **kwargs):
        if str(name).startswith(f"{RESERVED_PREFIX}prior"):
            raise OSError(errno.EIO, "injected")
        return real_unlink(name, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse_priors)
    commit_files(tenant, NEW)
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert leftovers(tenant)
    with tenant_lock(tenant):
        pass
    assert contents(tenant) == NEW and not leftovers(tenant)


def test_without_hard_links_the_prior_files_are_copies(tenant: Path, monkeypatch) -> None:
    """Where the file system refuses a hard link (a file the engine does not own under
    fs.protected_hardlinks, or no hard links at all), the old bytes are copied instead, and a failed
    commit still puts them back."""
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    (tenant / "a.txt").chmod(0o640)
    commit_files(tenant, NEW)
    assert contents(tenant) == NEW and (tenant / "a.txt").stat().st_mode & 0o777 == 0o640
    real_replace, renamed = os.replace, []

    def fail_the_second_rename(source, *args, **kwargs):
        if str(source).startswith(f"{RESERVED_PREFIX}staged"):
            renamed.append(source)
            if len(renamed) == 2:
                raise OSError(errno.EIO, "injected")
        return real_replace(source, *args, **kwargs)

    monkeypatch.setattr(os, "replace", fail_the_second_rename)
    with pytest.raises(OSError, match="injected"):  # a.txt was replaced already, then put back from its copy
        commit_files(tenant, {"a.txt": b"again", "b.txt": b"again"})
    assert contents(tenant) == NEW and not leftovers(tenant)
    assert (tenant / "a.txt").stat().st_mode & 0o777 == 0o640
