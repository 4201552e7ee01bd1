"""A tenant's files, opened without following symbolic links below the tenant's folder.

Every component of a mapped path is opened relative to its parent's descriptor with ``O_NOFOLLOW``,
so a component swapped for a link (or a FIFO, or a folder) between the request's check and the
program's read or commit is refused instead of followed: no path can reach outside the folder at
any moment. The tenant's folder itself (``<root>/<tenant>``) is the operator's layout and may be a
link. Reads are capped (``limit`` bytes) before anything is read. Commits (``tenant_commit``) use these
openers too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NEW_FILE_MODE = 0o600  # like tempfile.mkstemp's: a file a program creates is its owner's only


class LinkRefused(OSError):
    """A mapped path passes through something other than folders to a regular file."""


@contextlib.contextmanager
def folder_of(folder: Path | int, parts: tuple[str, ...], create: bool = False) -> Iterator[int]:
    """A descriptor of ``folder/parts...`` (``folder``: a path, or an open folder's descriptor), each part
    opened without following links; missing parts are created if asked, and synced into their parent."""
    if isinstance(folder, int):
        descriptor = os.dup(folder)
    else:
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=descriptor)
                    os.fsync(descriptor)
            child = open_below(name, _DIRECTORY, descriptor)
            os.close(descriptor)
            descriptor = child
        yield descriptor
    finally:
        os.close(descriptor)


def open_below(name: str, flags: int, folder: int, mode: int = 0o777) -> int:
    try:
        return os.open(name, flags, mode, dir_fd=folder)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):  # a link (O_NOFOLLOW) or a file where a folder should be
            raise LinkRefused(error.errno, f"{name!r} is a symbolic link, or a file where a folder should be") from None
        raise


def file_size(folder: Path, relative: str) -> int | None:
    """The size of the regular file at ``relative``, or None if it does not exist yet."""
    *parents, name = Path(relative).parts
    try:
        with folder_of(folder, tuple(parents), create=False) as parent:
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None
    _require_regular(info.st_mode)
    return info.st_size


def _require_regular(mode: int) -> None:
    if stat.S_ISLNK(mode):
        raise LinkRefused(errno.ELOOP, "is a symbolic link")
    if not stat.S_ISREG(mode):
        raise LinkRefused(errno.EINVAL, "is not a regular file")


def read_file(folder: Path, relative: str, limit: int) -> bytearray:
    """The contents of ``relative`` (empty if it does not exist yet); more than ``limit`` bytes is refused."""
    *parents, name = Path(relative).parts
    try:
        with folder_of(folder, tuple(parents), create=False) as parent:
            # O_NONBLOCK: a FIFO planted at the name must not block the open; it is refused below.
            descriptor = open_below(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, parent)
    except FileNotFoundError:
        return bytearray()
    try:
        info = os.fstat(descriptor)
        _require_regular(info.st_mode)  # before fdopen, which refuses a folder without closing it
    except BaseException:
        os.close(descriptor)
        raise
    with os.fdopen(descriptor, "rb") as handle:
        if info.st_size > limit:
            raise FileTooLarge(relative, info.st_size, limit)
        data = bytearray(handle.read(limit + 1))
    if len(data) > limit:  # it grew after the check
        raise FileTooLarge(relative, len(data), limit)
    return data


class FileTooLarge(OSError):
    """A mapped file holds more bytes than a program may map."""

    def __init__(self, relative: str, size: int, limit: int) -> None:
        super().__init__(errno.EFBIG, f"holds {size} bytes, over the {limit} this request may still map "
                                      "(engine.exec_quota_bytes)")
        self.size = size
