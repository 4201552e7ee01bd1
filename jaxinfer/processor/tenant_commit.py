"""A program's changed files committed as one transaction: all replaced, or none.

A commit runs under an exclusive ``flock`` of the tenant's folder, and every engine-side read of the
tenant's files takes the same lock (``tenant_lock``), so a reader sees the files before a commit or
after it, never a mix. Inside the lock, a commit:

1. writes a journal (``.jaxinfer-journal`` in the tenant's folder) naming, per file, its staged copy,
   its prior link and whether it existed; every later step can be undone from it;
2. writes each new content to a synced staged file beside its target, and hard-links each existing
   target to a prior name (the old content stays reachable without a copy);
3. renames every staged file over its target;
4. renames the journal to ``.jaxinfer-journal-done`` (the commit point), then drops the prior links
   and that file.

An error before the commit point rolls every file back from the journal before it is raised. A crash
(the process killed, the machine losing power) leaves the journal behind; the next lock of the folder
rolls back a journal that is not done and finishes one that is. Folders a rolled-back commit created
stay, empty. Names starting with ``RESERVED_PREFIX`` belong to this protocol; a request may not map
them (``wasi.FileMapping``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from jaxinfer.processor.tenant_files import NEW_FILE_MODE, folder_of, open_below

RESERVED_PREFIX = ".jaxinfer-"
JOURNAL = RESERVED_PREFIX + "journal"
DONE = RESERVED_PREFIX + "journal-done"
_JOURNAL_DRAFT = RESERVED_PREFIX + "journal-draft"


@dataclass(frozen=True)
class _Entry:
    path: str  # the target, relative to the tenant's folder
    staged: str  # names in the target's own folder
    prior: str
    existed: bool

    @property
    def parents(self) -> tuple[str, ...]:
        return Path(self.path).parts[:-1]

    @property
    def name(self) -> str:
        return Path(self.path).parts[-1]


@contextlib.contextmanager
def tenant_lock(folder: Path, create: bool = False) -> Iterator[int | None]:
    """Holds the tenant folder's exclusive lock (finishing or undoing an interrupted commit first);
    yields the folder's descriptor, or None when the folder does not exist and ``create`` is False."""
    if create:
        folder.mkdir(parents=True, exist_ok=True)  # a tenant's first file creates its folder
    try:
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        yield None
        return
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        recover(folder, descriptor)
        yield descriptor
    finally:
        os.close(descriptor)  # releases the lock


def commit_files(folder: Path, files: dict[str, bytes]) -> None:
    """Replaces every ``files`` path (relative to ``folder``) with its bytes, all or none (see the module
    docstring). An existing regular file keeps its mode; a new one is private. Raises the first OSError
    after rolling back."""
    contents = {"/".join(Path(relative).parts): data for relative, data in files.items()}
    if not contents:
        return
    with tenant_lock(folder, create=True) as root:
        entries = [_plan(folder, relative) for relative in contents]
        _write_journal(root, entries)
        try:
            for entry in entries:
                _stage(folder, entry, contents[entry.path])
            for entry in entries:
                with folder_of(folder, entry.parents) as parent:
                    os.replace(entry.staged, entry.name, src_dir_fd=parent, dst_dir_fd=parent)
                    os.fsync(parent)
        except BaseException:
            _roll_back(folder, entries)
            os.unlink(JOURNAL, dir_fd=root)
            raise
        os.rename(JOURNAL, DONE, src_dir_fd=root, dst_dir_fd=root)  # the commit point
        os.fsync(root)
        _finish(folder, root, entries)


def recover(folder: Path, root: int) -> None:
    """Finishes a commit that reached its commit point, or rolls back one that did not (the caller
    holds the lock, so no commit is running)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_JOURNAL_DRAFT, dir_fd=root)  # a crash while writing the journal: nothing was staged yet
    if _exists(DONE, root):
        _finish(folder, root, _read_journal(DONE, root))
    elif _exists(JOURNAL, root):
        _roll_back(folder, _read_journal(JOURNAL, root))
        os.unlink(JOURNAL, dir_fd=root)
        os.fsync(root)


def _plan(folder: Path, relative: str) -> _Entry:
    token = secrets.token_hex(8)
    entry = _Entry(relative, f"{RESERVED_PREFIX}staged-{token}", f"{RESERVED_PREFIX}prior-{token}", False)
    with folder_of(folder, entry.parents, create=True) as parent:
        info = _lstat(entry.name, parent)
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, f"{relative!r} is a folder")
    return _Entry(entry.path, entry.staged, entry.prior, info is not None)


def _stage(folder: Path, entry: _Entry, data: bytes) -> None:
    """The staged file, synced, with the target's mode if it is a regular file; a prior link to the target."""
    with folder_of(folder, entry.parents) as parent:
        info = _lstat(entry.name, parent)
        # Only a regular file's mode is kept: a link's (0777) or a FIFO's must not become the file's.
        mode = stat.S_IMODE(info.st_mode) if info is not None and stat.S_ISREG(info.st_mode) else NEW_FILE_MODE
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(open_below(entry.staged, flags, parent, NEW_FILE_MODE), "wb") as out:
            os.fchmod(out.fileno(), mode)
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        if entry.existed:  # a link at the name is linked itself, not followed
            os.link(entry.name, entry.prior, src_dir_fd=parent, dst_dir_fd=parent, follow_symlinks=False)
        os.fsync(parent)


def _roll_back(folder: Path, entries: list[_Entry]) -> None:
    """Puts every target back as the journal found it; safe to repeat after a crash in the middle."""
    for entry in entries:
        try:
            with folder_of(folder, entry.parents) as parent:
                staged_left = _exists(entry.staged, parent)
                if entry.existed and _exists(entry.prior, parent):
                    if _same_file(entry.prior, entry.name, parent):  # not replaced yet (rename would be a no-op)
                        os.unlink(entry.prior, dir_fd=parent)
                    else:
                        os.replace(entry.prior, entry.name, src_dir_fd=parent, dst_dir_fd=parent)
                elif not entry.existed and not staged_left:  # renamed into place already, or never staged
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=parent)
                if staged_left:
                    os.unlink(entry.staged, dir_fd=parent)
                os.fsync(parent)
        except FileNotFoundError:  # its folder is gone: nothing of this entry is left to undo
            continue


def _finish(folder: Path, root: int, entries: list[_Entry]) -> None:
    for entry in entries:
        with contextlib.suppress(FileNotFoundError), folder_of(folder, entry.parents) as parent:
            for name in (entry.prior, entry.staged):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=parent)
    os.unlink(DONE, dir_fd=root)


def _write_journal(root: int, entries: list[_Entry]) -> None:
    text = json.dumps([asdict(entry) for entry in entries]).encode()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(open_below(_JOURNAL_DRAFT, flags, root, NEW_FILE_MODE), "wb") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.rename(_JOURNAL_DRAFT, JOURNAL, src_dir_fd=root, dst_dir_fd=root)
    os.fsync(root)


def _read_journal(name: str, root: int) -> list[_Entry]:
    with os.fdopen(open_below(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, root), "rb") as handle:
        text = handle.read()
    try:
        return [_Entry(**entry) for entry in json.loads(text)]
    except (ValueError, TypeError) as error:  # written whole and renamed into place, so this is tampering
        raise OSError(errno.EIO, f"{name}: not a commit journal ({error}); move it away to go on") from None


def _lstat(name: str, parent: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _exists(name: str, parent: int) -> bool:
    return _lstat(name, parent) is not None


def _same_file(first: str, second: str, parent: int) -> bool:
    one, other = _lstat(first, parent), _lstat(second, parent)
    return other is not None and (one.st_dev, one.st_ino) == (other.st_dev, other.st_ino)
