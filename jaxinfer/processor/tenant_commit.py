"""A program's changed files committed as one transaction: all replaced, or none.

A commit runs under an exclusive ``flock`` of the tenant's folder, and every engine-side read of the
tenant's file contents takes the same lock (``tenant_lock``), so a reader sees the files before a
commit or after it, never a mix. Inside the lock, working from the locked folder's descriptor, a
commit:

1. writes a journal (``.jaxinfer-journal`` in the tenant's folder) naming, per file, its staged copy,
   its prior copy and whether it existed; every later step can be undone from it;
2. writes each new content to a synced staged file beside its target, and keeps each existing target
   under a prior name: a hard link (no copy), or a copy where the file system refuses the link (a file
   the engine does not own under ``fs.protected_hardlinks``, or no hard links at all);
3. renames every staged file over its target;
4. renames the journal to ``.jaxinfer-journal-done`` (the commit point), then drops the prior copies
   and that file.

An error before the commit point rolls every file back before it is raised; after it the commit has
happened, and a failed clean-up is logged and left to the next lock. A crash (the process killed, the
machine losing power) leaves the journal behind; the next lock of the folder rolls back a journal that
is not done and finishes one that is. A journal that does not describe a commit this module could have
written (a path outside the folder, a foreign name) stops every lock of the tenant with an error
instead of being followed. Folders a rolled-back commit created stay, empty. Names starting with
``RESERVED_PREFIX`` belong to this protocol; no mapped path may use them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from jaxinfer.processor.tenant_files import NEW_FILE_MODE, folder_of, open_below

log = logging.getLogger(__name__)

RESERVED_PREFIX = ".jaxinfer-"
JOURNAL = RESERVED_PREFIX + "journal"
DONE = RESERVED_PREFIX + "journal-done"
_JOURNAL_DRAFT = RESERVED_PREFIX + "journal-draft"
_JOURNAL_LIMIT = 1 << 20  # bytes: far more than a journal of any allowed mapping
_WORK_NAME = re.compile(re.escape(RESERVED_PREFIX) + r"(staged|prior)-[0-9a-f]{16}")
_NO_HARD_LINK = (errno.EPERM, errno.EACCES, errno.EMLINK, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS)


def path_parts(relative: str) -> tuple[str, ...]:
    """The components of a path a tenant may name; ValueError naming the rule it breaks."""
    parts = Path(relative).parts
    if not relative or not relative.isprintable() or Path(relative).is_absolute() or ".." in parts or not parts:
        raise ValueError("must be a relative path without '..'")
    if any(part.startswith(RESERVED_PREFIX) for part in parts):
        raise ValueError(f"names starting with {RESERVED_PREFIX!r} are reserved for the engine's commits")
    return parts


def check_paths(paths: Iterable[str]) -> None:
    """Every path allowed (``path_parts``), no two naming one file, and none a folder of another (a name
    cannot be a file and a folder in one commit). ValueError naming the paths."""
    seen: dict[tuple[str, ...], str] = {}
    for relative in paths:
        try:
            parts = path_parts(relative)
        except ValueError as error:
            raise ValueError(f"{relative!r}: {error}") from None
        if parts in seen:
            raise ValueError(f"{seen[parts]!r} and {relative!r} name the same file")
        seen[parts] = relative
    for parts, relative in seen.items():
        for depth in range(1, len(parts)):
            if parts[:depth] in seen:
                raise ValueError(f"{seen[parts[:depth]]!r} is a file and a folder of {relative!r}")


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
def tenant_lock(folder: Path) -> Iterator[int]:
    """Holds the tenant folder's exclusive lock, creating the folder if needed (so a first commit has a
    lock to take too), after finishing or undoing an interrupted commit; yields the folder's descriptor."""
    _make_folder(folder)
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        recover(descriptor)
        yield descriptor
    finally:
        os.close(descriptor)  # releases the lock


def commit_files(folder: Path, files: dict[str, bytes]) -> None:
    """Replaces every ``files`` path (relative to ``folder``) with its bytes, all or none (see the module
    docstring). An existing regular file keeps its mode; a new one is private. An OSError raised here
    means no file changed."""
    try:
        check_paths(files)
    except ValueError as error:
        raise OSError(errno.EINVAL, str(error)) from None
    if not files:
        return
    with tenant_lock(folder) as root:
        entries = [_plan(root, relative) for relative in files]
        try:
            _write_journal(root, entries)
            for entry in entries:
                _stage(root, entry, files[entry.path])
            for entry in entries:
                with folder_of(root, entry.parents) as parent:
                    os.replace(entry.staged, entry.name, src_dir_fd=parent, dst_dir_fd=parent)
                    os.fsync(parent)
            os.rename(JOURNAL, DONE, src_dir_fd=root, dst_dir_fd=root)  # the commit point
        except BaseException:
            _undo(folder, root, entries)
            raise
        try:
            os.fsync(root)
            _finish(root, entries)
        except OSError as error:  # committed: what is left is found and removed by the next lock
            log.warning("%s: committed, but its clean-up failed (%s); the next lock finishes it", folder, error)


def recover(root: int) -> None:
    """Finishes a commit that reached its commit point, or rolls back one that did not (the caller
    holds the lock, so no commit is running)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_JOURNAL_DRAFT, dir_fd=root)  # a crash while writing the journal: nothing was staged yet
    if _lstat(DONE, root) is not None:
        _finish(root, _read_journal(DONE, root))
    elif _lstat(JOURNAL, root) is not None:
        _roll_back(root, _read_journal(JOURNAL, root))
        os.unlink(JOURNAL, dir_fd=root)
        os.fsync(root)


def _make_folder(folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(folder, 0o755)
    except FileExistsError:
        return
    parent = os.open(folder.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(parent)  # the new folder's own name survives a power loss
    finally:
        os.close(parent)


def _plan(root: int, relative: str) -> _Entry:
    token = secrets.token_hex(8)
    parts = Path(relative).parts
    with folder_of(root, parts[:-1], create=True) as parent:
        info = _lstat(parts[-1], parent)
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, f"{relative!r} is a folder")
    return _Entry(relative, f"{RESERVED_PREFIX}staged-{token}", f"{RESERVED_PREFIX}prior-{token}", info is not None)


def _stage(root: int, entry: _Entry, data: bytes) -> None:
    """The staged file, synced, with the target's mode if it is a regular file; the prior copy of the target."""
    with folder_of(root, entry.parents) as parent:
        info = _lstat(entry.name, parent)
        # Only a regular file's mode is kept: a link's (0777) or a FIFO's must not become the file's.
        mode = stat.S_IMODE(info.st_mode) if info is not None and stat.S_ISREG(info.st_mode) else NEW_FILE_MODE
        _write_synced(entry.staged, parent, data, mode)
        if entry.existed:
            _keep_prior(entry, parent)
        os.fsync(parent)


def _keep_prior(entry: _Entry, parent: int) -> None:
    try:  # a link at the name is linked itself, not followed
        os.link(entry.name, entry.prior, src_dir_fd=parent, dst_dir_fd=parent, follow_symlinks=False)
        return
    except OSError as error:
        if error.errno not in _NO_HARD_LINK:
            raise
        refused = error
    info = os.stat(entry.name, dir_fd=parent, follow_symlinks=False)
    if stat.S_ISLNK(info.st_mode):
        os.symlink(os.readlink(entry.name, dir_fd=parent), entry.prior, dir_fd=parent)
    elif stat.S_ISREG(info.st_mode):
        source = open_below(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, parent)
        with os.fdopen(source, "rb") as handle:
            _write_synced(entry.prior, parent, handle.read(), stat.S_IMODE(info.st_mode))
    else:
        raise refused


def _write_synced(name: str, parent: int, data: bytes, mode: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(open_below(name, flags, parent, NEW_FILE_MODE), "wb") as out:
        os.fchmod(out.fileno(), mode)
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _undo(folder: Path, root: int, entries: list[_Entry]) -> None:
    """Rolls a failed commit back in place; if that fails too, the journal stays for the next lock."""
    try:
        _roll_back(root, entries)
        for name in (JOURNAL, _JOURNAL_DRAFT):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=root)
        os.fsync(root)
    except OSError as error:
        log.warning("%s: rolling back a failed commit failed too (%s); the next lock retries", folder, error)


def _roll_back(root: int, entries: list[_Entry]) -> None:
    """Puts every target back as the journal found it; safe to repeat after a crash in the middle. Every
    entry is tried; the first error is raised after the rest."""
    first_error: OSError | None = None
    for entry in entries:
        try:
            with folder_of(root, entry.parents) as parent:
                _roll_back_one(entry, parent)
        except FileNotFoundError:  # its folder is gone: nothing of this entry is left to undo
            continue
        except OSError as error:
            first_error = first_error or error
    if first_error is not None:
        raise first_error


def _roll_back_one(entry: _Entry, parent: int) -> None:
    staged_left = _lstat(entry.staged, parent) is not None
    prior = _lstat(entry.prior, parent)
    if entry.existed and prior is not None:
        current = _lstat(entry.name, parent)
        if current is not None and (current.st_dev, current.st_ino) == (prior.st_dev, prior.st_ino):
            os.unlink(entry.prior, dir_fd=parent)  # not replaced yet (a rename onto itself would do nothing)
        else:
            os.replace(entry.prior, entry.name, src_dir_fd=parent, dst_dir_fd=parent)
    elif not entry.existed and not staged_left:  # renamed into place already, or never staged
        current = _lstat(entry.name, parent)
        if current is not None and not stat.S_ISDIR(current.st_mode):
            os.unlink(entry.name, dir_fd=parent)
    if staged_left:
        os.unlink(entry.staged, dir_fd=parent)
    os.fsync(parent)


def _finish(root: int, entries: list[_Entry]) -> None:
    for entry in entries:
        with contextlib.suppress(FileNotFoundError), folder_of(root, entry.parents) as parent:
            for name in (entry.prior, entry.staged):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=parent)
            os.fsync(parent)
    os.unlink(DONE, dir_fd=root)
    os.fsync(root)


def _write_journal(root: int, entries: list[_Entry]) -> None:
    text = json.dumps([asdict(entry) for entry in entries]).encode()
    _write_synced(_JOURNAL_DRAFT, root, text, NEW_FILE_MODE)
    os.rename(_JOURNAL_DRAFT, JOURNAL, src_dir_fd=root, dst_dir_fd=root)
    os.fsync(root)


def _read_journal(name: str, root: int) -> list[_Entry]:
    """The journal's entries, each checked to be one this module writes: a journal is written whole and
    renamed into place, so anything else is tampering, and following it could reach outside the folder."""
    descriptor = open_below(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, root)
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise _not_a_journal(name, "not a regular file")
        text = handle.read(_JOURNAL_LIMIT + 1)
    try:
        entries = [_Entry(**entry) for entry in json.loads(text)]
        check_paths(entry.path for entry in entries)
    except (ValueError, TypeError) as error:
        raise _not_a_journal(name, str(error)) from None
    for entry in entries:
        if not (isinstance(entry.existed, bool)  # the paths were checked above, as strings
                and _WORK_NAME.fullmatch(str(entry.staged)) and _WORK_NAME.fullmatch(str(entry.prior))):
            raise _not_a_journal(name, f"entry {entry!r}")
    return entries


def _not_a_journal(name: str, why: str) -> OSError:
    return OSError(errno.EIO, f"{name}: not a commit journal ({why:.200}); the tenant's files stay locked until "
                              "it is moved away")


def _lstat(name: str, parent: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None
