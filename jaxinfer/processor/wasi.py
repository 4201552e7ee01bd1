"""The WASI preview1 subset: stdout/stderr capture and a tenant's files as preopened descriptors.

A call to an imported ``wasi_snapshot_preview1`` function is a HOSTCALL record: the slot stops with
status SYSCALL, the host serves the call here against a copy of the slot's memory, and the slot
resumes (one host round trip per system call, none per instruction).

Files: a request maps paths of its tenant's own namespace (``<root>/<tenant>/<path>``) to
descriptors 3, 4, ... in order. A path must be relative, without ``..``, and may not pass through a
symbolic link below the tenant's folder (``tenant_files``: checked at every open, not once). The
files a request maps may hold at most the tenant's byte quota together. Writes go to a staged copy;
only when the program halts normally do the changed files replace the real ones, all together or none
(``tenant_commit``: a journal, then renames), so a trap or a failed commit leaves every file as it
was, and a program maps its files under the same lock, never half of another's commit. Growing a
tenant's files past its byte quota is a trap.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from jaxinfer.processor.tenant_commit import RESERVED_PREFIX, check_paths, commit_files, path_parts, tenant_lock
from jaxinfer.processor.tenant_files import file_size, read_file

T = TypeVar("T")

WASI_MODULE = "wasi_snapshot_preview1"
# name -> (syscall number, params, results)
SYSCALLS: dict[str, tuple[int, str, str]] = {
    "fd_write": (1, "iiii", "i"),
    "fd_read": (2, "iiii", "i"),
    "fd_seek": (3, "iIii", "i"),
    "fd_close": (4, "i", "i"),
    "proc_exit": (5, "i", ""),
}
SYSCALL_NAMES = {number: name for name, (number, _, _) in SYSCALLS.items()}

ERRNO_SUCCESS, ERRNO_BADF, ERRNO_INVAL, ERRNO_FAULT, ERRNO_SPIPE = 0, 8, 28, 21, 70
STDIN, STDOUT, STDERR, FIRST_FILE = 0, 1, 2, 3
MAX_CAPTURE = 1 << 20  # bytes of stdout/stderr kept per program
MAX_FILE_BYTES = 1 << 32  # furthest a descriptor may seek (writes are bounded by the quota anyway)


def _clean_name(name: str) -> bool:
    return bool(name) and all(character.isprintable() for character in name)


class FileAccessError(ValueError):
    """A mapped path is not allowed (names the path and the rule)."""


class QuotaExceeded(Exception):
    """Staged writes would take the tenant past its byte quota (a trap)."""


class ProcessExit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"exit code {code}")
        self.code = code


@dataclass
class MappedFile:
    relative: str  # the mapped path, inside the tenant's folder
    data: bytearray
    original_size: int = 0  # bytes when mapped (they count for the quota already)
    position: int = 0
    dirty: bool = False
    closed: bool = False


@dataclass
class FileMapping:
    """A tenant's namespace under ``root``, the paths a request maps, and the tenant's quota."""

    root: Path
    tenant: str
    paths: tuple[str, ...] = ()
    quota_bytes: int = 1 << 20

    @property
    def folder(self) -> Path:
        return self.root / self.tenant

    def check(self) -> int:
        """Checks every mapped path (see ``_guarded``) and that together they hold at most the quota;
        returns the bytes they hold. Raises FileAccessError naming the path and the rule."""
        with self.locked():
            total = sum(self._guarded(relative, lambda r=relative: file_size(self.folder, r)) or 0
                        for relative in self.paths)
        if total > self.quota_bytes:
            raise FileAccessError(f"exec_files: the mapped files hold {total} bytes, over the tenant's quota of "
                                  f"{self.quota_bytes} (engine.exec_quota_bytes)")
        return total

    def read(self, relative: str, limit: int) -> bytearray:
        """The file's bytes (empty if it does not exist yet); more than ``limit`` is a FileAccessError."""
        return self._guarded(relative, lambda: read_file(self.folder, relative, limit))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Holds the tenant's lock (``tenant_commit.tenant_lock``): no commit runs meanwhile, and one a
        crash interrupted is finished or undone first. Refuses a tenant or a set of paths no commit could
        take (see ``tenant_commit.check_paths``) before touching the folder."""
        self._check_tenant()
        try:
            check_paths(self.paths)
        except ValueError as error:
            raise FileAccessError(f"exec_files: {error}") from None
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(tenant_lock(self.folder))
            except OSError as error:
                raise FileAccessError(f"tenant {self.tenant!r}: its folder: {error.strerror or error}") from error
            yield

    def _check_tenant(self) -> None:
        if not _clean_name(self.tenant) or "/" in self.tenant or self.tenant in (".", ".."):
            raise FileAccessError(f"tenant {self.tenant!r}: not a valid namespace name")

    def _guarded(self, relative: str, action: Callable[[], T]) -> T:
        """Runs ``action`` on ``relative`` after refusing absolute paths, ``..``, control characters, names
        reserved for commits and an invalid tenant; its OS complaints (a link, a FIFO, a file where a folder
        should be) become one FileAccessError naming the path."""
        self._check_tenant()
        try:
            path_parts(relative)
        except ValueError as error:
            raise FileAccessError(f"exec_files: {relative!r}: {error}") from None
        try:
            return action()
        except (OSError, ValueError) as error:
            raise FileAccessError(f"exec_files: {relative!r}: {error.strerror or error}"
                                  if isinstance(error, OSError) else f"exec_files: {relative!r}: {error}") from error

    def used_bytes(self) -> int:
        folder = self.folder
        if not folder.exists():
            return 0
        return sum(path.stat().st_size for path in folder.rglob("*")
                   if path.is_file() and not path.is_symlink() and not path.name.startswith(RESERVED_PREFIX))


@dataclass
class Syscalls:
    """One program's system calls: captured output and its mapped files (staged until commit)."""

    mapping: FileMapping | None = None
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    files: dict[int, MappedFile] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)  # mapped paths read or written
    # The other programs running now (the executor's): their staged growth counts for the tenant's quota,
    # so two programs of one tenant cannot each stay under it and together commit past it.
    running: Callable[[], Iterable[Syscalls]] = field(default=lambda: ())

    def __post_init__(self) -> None:
        if self.mapping is None:
            return
        left = self.mapping.quota_bytes
        with self.mapping.locked():
            for index, relative in enumerate(self.mapping.paths):
                data = self.mapping.read(relative, left)  # together at most the quota
                left -= len(data)
                self.files[FIRST_FILE + index] = MappedFile(relative, data, len(data))

    def call(self, number: int, args: list[int], memory: np.ndarray) -> int:
        """Serves one call; ``memory`` is the slot's linear memory (updated in place). Returns the errno."""
        name = SYSCALL_NAMES[number]
        return getattr(self, name)(memory, *args)

    # -- the calls ----------------------------------------------------------------------------

    def fd_write(self, memory: np.ndarray, fd: int, iovs: int, count: int, written_at: int) -> int:
        vectors = _vectors(memory, iovs, count)
        if vectors is None or any(buffer + length > memory.size - 8 for buffer, length in vectors):
            return ERRNO_FAULT
        total = sum(length for _, length in vectors)
        if fd in (STDOUT, STDERR):
            sink = self.stdout if fd == STDOUT else self.stderr
            sink += _gather(memory, vectors, max(0, MAX_CAPTURE - len(sink)))  # the rest is dropped
        else:
            handle = self._open(fd)
            if handle is None:
                return ERRNO_BADF
            end = handle.position + total
            growth = max(0, end - len(handle.data))
            if growth and self._staged_bytes() + growth + self._committed_elsewhere() + self._growth_of_others() \
                    > self.mapping.quota_bytes:
                raise QuotaExceeded(f"tenant quota of {self.mapping.quota_bytes} bytes exceeded")
            if handle.position > len(handle.data):  # written past the end after a seek: the gap reads as zeros
                handle.data.extend(bytes(handle.position - len(handle.data)))
            handle.data[handle.position : end] = _gather(memory, vectors, total)
            handle.position, handle.dirty = end, True
        return _store_u32(memory, written_at, total)

    def fd_read(self, memory: np.ndarray, fd: int, iovs: int, count: int, read_at: int) -> int:
        handle = self._open(fd) if fd >= FIRST_FILE else None
        if fd == STDIN:
            return _store_u32(memory, read_at, 0)
        if handle is None:
            return ERRNO_BADF
        vectors = _vectors(memory, iovs, count)
        if vectors is None:
            return ERRNO_FAULT
        total = 0
        for buffer, length in vectors:
            chunk = handle.data[handle.position : handle.position + length]
            if buffer + len(chunk) > memory.size - 8:
                return ERRNO_FAULT
            memory[buffer : buffer + len(chunk)] = np.frombuffer(bytes(chunk), np.uint8)
            handle.position += len(chunk)
            total += len(chunk)
        return _store_u32(memory, read_at, total)

    def fd_seek(self, memory: np.ndarray, fd: int, offset: int, whence: int, position_at: int) -> int:
        if fd in (STDIN, STDOUT, STDERR):
            return ERRNO_SPIPE
        handle = self._open(fd)
        if handle is None:
            return ERRNO_BADF
        offset = offset - (1 << 64) if offset >= 1 << 63 else offset
        base = {0: 0, 1: handle.position, 2: len(handle.data)}.get(whence)
        if base is None or not 0 <= base + offset <= MAX_FILE_BYTES:
            return ERRNO_INVAL
        if position_at + 8 > memory.size - 8:
            return ERRNO_FAULT
        handle.position = base + offset
        memory[position_at : position_at + 8] = np.frombuffer(struct.pack("<Q", handle.position), np.uint8)
        return ERRNO_SUCCESS

    def fd_close(self, memory: np.ndarray, fd: int) -> int:
        handle = self._open(fd)
        if handle is None:
            return ERRNO_BADF
        handle.closed = True
        return ERRNO_SUCCESS

    def proc_exit(self, memory: np.ndarray, code: int) -> int:
        raise ProcessExit(code)

    # -- files ---------------------------------------------------------------------------------

    def _open(self, fd: int) -> MappedFile | None:
        handle = self.files.get(fd)
        if handle is None or handle.closed:
            return None
        self.touched.add(self.mapping.paths[fd - FIRST_FILE])
        return handle

    def _staged_bytes(self) -> int:
        return sum(len(handle.data) for handle in self.files.values())

    def staged_growth(self) -> int:
        """Bytes this program's commit would add to its tenant's files."""
        return sum(max(0, len(handle.data) - handle.original_size) for handle in self.files.values() if handle.dirty)

    def _growth_of_others(self) -> int:
        folder = self.mapping.folder
        return sum(other.staged_growth() for other in self.running()
                   if other is not self and other.mapping is not None and other.mapping.folder == folder)

    def _committed_elsewhere(self) -> int:
        """Bytes of the tenant's files that this program did not map (they count for the quota)."""
        mapped = sum(handle.original_size for handle in self.files.values())
        return max(0, self.mapping.used_bytes() - mapped)

    def commit(self) -> dict[str, bytes]:
        """Replaces every changed file, all or none (``tenant_commit.commit_files``); returns them by mapped
        path. An OSError means no file changed."""
        written = {handle.relative: bytes(handle.data) for handle in self.files.values() if handle.dirty}
        if written:
            commit_files(self.mapping.folder, written)
        return written


def _vectors(memory: np.ndarray, iovs: int, count: int) -> list[tuple[int, int]] | None:
    if count > 1024 or iovs + 8 * count > memory.size - 8:
        return None
    raw = memory[iovs : iovs + 8 * count].tobytes()
    return [struct.unpack_from("<II", raw, 8 * index) for index in range(count)]


def _gather(memory: np.ndarray, vectors: list[tuple[int, int]], limit: int) -> bytes:
    """The bytes the vectors point at (already bounds-checked), at most ``limit`` of them."""
    parts, left = [], limit
    for buffer, length in vectors:
        take = min(length, left)
        parts.append(memory[buffer : buffer + take].tobytes())
        left -= take
        if left <= 0:
            break
    return b"".join(parts)


def _store_u32(memory: np.ndarray, address: int, value: int) -> int:
    if address + 4 > memory.size - 8:
        return ERRNO_FAULT
    memory[address : address + 4] = np.frombuffer(struct.pack("<I", value), np.uint8)
    return ERRNO_SUCCESS
