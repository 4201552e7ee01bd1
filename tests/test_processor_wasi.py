"""The WASI subset: captured stdout, a tenant's files as descriptors, atomic commit, quota, path rules.

Real files in a temporary folder; programs run on the jitted machine and stop at each system call,
which the host serves (jaxinfer/processor/wasi.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jaxinfer.processor import Unsupported, run
from jaxinfer.processor.wasi import MAX_CAPTURE, FileAccessError, FileMapping

IMPORTS = """
 (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
 (import "wasi_snapshot_preview1" "fd_read" (func $read (param i32 i32 i32 i32) (result i32)))
 (import "wasi_snapshot_preview1" "fd_seek" (func $seek (param i32 i64 i32 i32) (result i32)))
 (import "wasi_snapshot_preview1" "fd_close" (func $close (param i32) (result i32)))
 (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
 (memory 1)
 ;; write(fd, address, length): one iovec at 0, bytes written at 8; returns the errno
 (func $put (param $fd i32) (param $at i32) (param $n i32) (result i32)
   (i32.store (i32.const 0) (local.get $at)) (i32.store (i32.const 4) (local.get $n))
   (call $write (local.get $fd) (i32.const 0) (i32.const 1) (i32.const 8)))
 ;; read(fd, address, length): bytes read
 (func $get (param $fd i32) (param $at i32) (param $n i32) (result i32)
   (i32.store (i32.const 0) (local.get $at)) (i32.store (i32.const 4) (local.get $n))
   (drop (call $read (local.get $fd) (i32.const 0) (i32.const 1) (i32.const 8))) (i32.load (i32.const 8)))
"""


def program(body: str, data: str = "", result: str = "(result i32)") -> str:
    return f'(module {IMPORTS} {data} (func (export "main") {result} {body}))'


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    for tenant, text in (("acme", b"acme secret"), ("globex", b"globex secret")):
        (tmp_path / tenant).mkdir()
        (tmp_path / tenant / "secret.txt").write_bytes(text)
    return tmp_path


def mapping(root: Path, tenant: str, *paths: str, quota: int = 1 << 20) -> FileMapping:
    return FileMapping(root, tenant, paths, quota)


def test_stdout_and_stderr_are_captured() -> None:
    hello = program('(drop (call $put (i32.const 1) (i32.const 64) (i32.const 6))) '
                    '(call $put (i32.const 2) (i32.const 64) (i32.const 3))', '(data (i32.const 64) "hello\\n")')
    result = run(hello)
    assert result.stdout == b"hello\n" and result.values == [0]


def test_a_tenant_reads_only_its_own_file(root: Path) -> None:
    body = "(drop (call $get (i32.const 3) (i32.const 100) (i32.const 64))) " \
           "(call $put (i32.const 1) (i32.const 100) (i32.load (i32.const 8)))"
    assert run(program(body), files=mapping(root, "acme", "secret.txt")).stdout == b"acme secret"
    assert run(program(body), files=mapping(root, "globex", "secret.txt")).stdout == b"globex secret"


def test_writes_commit_on_halt_and_only_then(root: Path) -> None:
    data = '(data (i32.const 64) "new text")'
    write = "(call $put (i32.const 3) (i32.const 64) (i32.const 8))"
    result = run(program(write, data), files=mapping(root, "acme", "out/new.txt"))
    assert result.files_written == {"out/new.txt": b"new text"}
    assert (root / "acme" / "out" / "new.txt").read_bytes() == b"new text"
    trapped = run(program(f"(drop {write}) unreachable", data), files=mapping(root, "acme", "secret.txt"))
    assert trapped.trap == "unreachable" and trapped.files_written == {}
    assert (root / "acme" / "secret.txt").read_bytes() == b"acme secret"
    assert not [p for p in (root / "acme").rglob("*") if p.name.startswith(".jaxinfer-")]


def test_proc_exit(root: Path) -> None:
    data = '(data (i32.const 64) "x")'
    write = "(drop (call $put (i32.const 3) (i32.const 64) (i32.const 1)))"
    ok = run(program(f"{write} (call $exit (i32.const 0))", data, ""), files=mapping(root, "acme", "a.txt"))
    assert ok.trap is None and ok.files_written == {"a.txt": b"x"}
    failed = run(program(f"{write} (call $exit (i32.const 3))", data, ""), files=mapping(root, "acme", "b.txt"))
    assert failed.trap == "exit code 3" and not (root / "acme" / "b.txt").exists()


def test_quota_is_a_trap_and_leaves_files_alone(root: Path) -> None:
    body = "(call $put (i32.const 3) (i32.const 0) (i32.const 4096))"
    result = run(program(body), files=mapping(root, "acme", "big.bin", quota=2048))
    assert result.trap == "file quota exceeded"
    assert not (root / "acme" / "big.bin").exists()
    assert run(program(body), files=mapping(root, "acme", "big.bin", quota=8192)).trap is None


def test_seek_close_and_bad_descriptors(root: Path) -> None:
    body = """(drop (call $seek (i32.const 3) (i64.const 5) (i32.const 0) (i32.const 16)))
      (drop (call $get (i32.const 3) (i32.const 100) (i32.const 64)))
      (drop (call $put (i32.const 1) (i32.const 100) (i32.load (i32.const 8))))
      (drop (call $close (i32.const 3)))
      (i32.add (i32.mul (call $close (i32.const 3)) (i32.const 1000)) (call $put (i32.const 9) (i32.const 0)
        (i32.const 1)))"""
    result = run(program(body), files=mapping(root, "acme", "secret.txt"))
    assert result.stdout == b"secret"
    assert result.values == [8 * 1000 + 8]  # EBADF after close, and for a descriptor never mapped


@pytest.mark.parametrize("path", ["../globex/secret.txt", "/etc/passwd", "", "a/../../x"])
def test_paths_outside_the_namespace_are_refused(root: Path, path: str) -> None:
    with pytest.raises(FileAccessError):
        mapping(root, "acme", path).check()


def test_symlinks_out_of_the_namespace_are_refused(root: Path) -> None:
    os.symlink(root / "globex" / "secret.txt", root / "acme" / "link.txt")
    with pytest.raises(FileAccessError, match=r"'link.txt': .*symbolic link"):
        run(program("(i32.const 0)"), files=mapping(root, "acme", "link.txt"))


READ_AND_PRINT = "(drop (call $get (i32.const 3) (i32.const 100) (i32.const 64))) " \
                 "(call $put (i32.const 1) (i32.const 100) (i32.load (i32.const 8)))"


def test_a_folder_swapped_for_a_link_after_the_check_is_refused_at_the_read(root: Path) -> None:
    """The request's check passes; the folder is then replaced by a link to another tenant's folder
    before the program maps its file: the read refuses the link instead of following it."""
    (root / "acme" / "notes").mkdir()
    (root / "acme" / "notes" / "secret.txt").write_bytes(b"acme notes")
    files = mapping(root, "acme", "notes/secret.txt")
    assert files.check() == len(b"acme notes")
    (root / "acme" / "notes" / "secret.txt").unlink()
    (root / "acme" / "notes").rmdir()
    os.symlink(root / "globex", root / "acme" / "notes")
    with pytest.raises(FileAccessError, match=r"'notes/secret.txt': .*symbolic link"):
        run(program(READ_AND_PRINT), files=files)


def test_a_folder_swapped_for_a_link_before_the_commit_is_not_written_through(root: Path) -> None:
    """A program maps out/new.txt; while it runs, out/ becomes a link to another tenant's folder: the
    commit fails (a trap) and nothing is written in the other tenant's folder."""
    from jaxinfer.processor.wasi import Syscalls

    (root / "acme" / "out").mkdir()
    syscalls = Syscalls(mapping(root, "acme", "out/new.txt"))
    syscalls.files[3].data[:] = b"written"
    syscalls.files[3].dirty = True
    (root / "acme" / "out").rmdir()
    os.symlink(root / "globex", root / "acme" / "out")
    with pytest.raises(OSError, match="symbolic link"):
        syscalls.commit()
    assert sorted(p.name for p in (root / "globex").iterdir()) == ["secret.txt"]


def test_a_fifo_is_refused_without_blocking(root: Path) -> None:
    os.mkfifo(root / "acme" / "pipe")
    with pytest.raises(FileAccessError, match="'pipe': is not a regular file"):
        mapping(root, "acme", "pipe").check()
    with pytest.raises(FileAccessError, match="'pipe': is not a regular file"):
        run(program(READ_AND_PRINT), files=mapping(root, "acme", "pipe"))  # would block in open() if it tried


def test_mapped_files_hold_at_most_the_quota_together(root: Path) -> None:
    (root / "acme" / "a.bin").write_bytes(b"a" * 600)
    (root / "acme" / "b.bin").write_bytes(b"b" * 600)
    assert mapping(root, "acme", "a.bin", quota=1000).check() == 600
    with pytest.raises(FileAccessError, match=r"hold 1200 bytes, over the tenant's quota of 1000 "
                                              r"\(engine.exec_quota_bytes\)"):
        mapping(root, "acme", "a.bin", "b.bin", quota=1000).check()
    with pytest.raises(FileAccessError, match=r"'b.bin': holds 600 bytes, over the 400 this request may still map"):
        run(program(READ_AND_PRINT), files=mapping(root, "acme", "a.bin", "b.bin", quota=1000))
    assert run(program(READ_AND_PRINT), files=mapping(root, "acme", "a.bin", quota=1000)).stdout == b"a" * 64


def test_a_link_inside_the_namespace_is_refused_too(root: Path) -> None:
    """No link is followed below the tenant's folder, even one that stays inside it: the rule holds at
    every open without resolving where a link points."""
    os.symlink(root / "acme" / "secret.txt", root / "acme" / "alias.txt")
    with pytest.raises(FileAccessError, match="symbolic link"):
        mapping(root, "acme", "alias.txt").check()


def test_a_linked_tenant_folder_is_the_operator_s_layout(root: Path, tmp_path_factory) -> None:
    elsewhere = tmp_path_factory.mktemp("initech")
    (elsewhere / "data.txt").write_bytes(b"initech data")
    os.symlink(elsewhere, root / "initech")
    assert run(program(READ_AND_PRINT), files=mapping(root, "initech", "data.txt")).stdout == b"initech data"


def test_commit_keeps_an_existing_file_s_mode_and_new_files_are_private(root: Path) -> None:
    os.chmod(root / "acme" / "secret.txt", 0o640)
    data = '(data (i32.const 64) "x")'
    write = "(call $put (i32.const 3) (i32.const 64) (i32.const 1))"
    assert run(program(write, data), files=mapping(root, "acme", "secret.txt")).trap is None
    assert run(program(write, data), files=mapping(root, "acme", "fresh.txt")).trap is None
    assert (root / "acme" / "secret.txt").read_bytes() == b"xcme secret"
    assert (root / "acme" / "secret.txt").stat().st_mode & 0o777 == 0o640
    assert (root / "acme" / "fresh.txt").stat().st_mode & 0o777 == 0o600


def test_a_symlink_loop_or_a_bad_path_is_a_file_error_named_once(root: Path) -> None:
    os.symlink(root / "acme" / "loop", root / "acme" / "loop")
    with pytest.raises(FileAccessError, match=r"^exec_files: 'loop': is a symbolic link"):  # was a RuntimeError
        mapping(root, "acme", "loop").check()
    with pytest.raises(FileAccessError) as named:
        mapping(root, "acme", ".").check()
    assert str(named.value).count("exec_files") == 1, str(named.value)


def test_other_imports_are_unsupported_and_named() -> None:
    module = """(module (import "wasi_snapshot_preview1" "path_open"
      (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
      (func (export "main") (result i32) (call $open (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0)
        (i32.const 0) (i64.const 0) (i64.const 0) (i32.const 0) (i32.const 0))))"""
    with pytest.raises(Unsupported, match="path_open"):
        run(module)


def test_session_memory_lru_ttl_and_tenant_keys() -> None:
    import numpy as np

    from jaxinfer.processor.sessions import SessionMemory

    now = [0.0]
    cache = SessionMemory(capacity_bytes=2 * 65536, ttl_seconds=10.0, clock=lambda: now[0])
    page = np.zeros(65536 + 8, np.uint8)
    cache.put("acme", "s1", page, 1)
    cache.put("acme", "s2", page, 1)
    assert cache.get("acme", "s1") is not None  # s1 is now the most recently used
    cache.put("acme", "s3", page, 1)  # over capacity: acme's least recently used (s2) goes
    assert cache.get("acme", "s2") is None and cache.evictions == 1
    now[0] = 11.0
    assert cache.get("acme", "s1") is None and len(cache) == 1  # expired
    assert cache.bytes == 65536


def test_session_memory_keeps_each_tenant_s_share() -> None:
    """A tenant opening many sessions evicts its own, never a tenant that holds less: before, the
    cache-wide least recently used entry went, so one busy tenant wiped out every other tenant's
    sessions."""
    import numpy as np

    from jaxinfer.processor.sessions import SessionMemory

    now = [0.0]
    cache = SessionMemory(capacity_bytes=4 * 65536, ttl_seconds=100.0, clock=lambda: now[0])
    page = np.zeros(2 * 65536 + 8, np.uint8)
    cache.put("globex", "g1", page, 1)  # the oldest entry in the cache
    for turn in range(10):
        now[0] += 1
        cache.put("acme", f"a{turn}", page, 1)
    assert cache.get("globex", "g1") is not None
    assert cache.tenant_bytes("globex") == 65536 and cache.tenant_bytes("acme") == 3 * 65536
    assert [cache.get("acme", f"a{turn}") is not None for turn in range(10)] == [False] * 7 + [True] * 3
    cache.put("initech", "i1", page, 2)  # a third tenant takes its room from the largest holder
    assert cache.tenant_bytes("acme") == 65536 and cache.get("globex", "g1") is not None
    now[0] += 200  # everything expires: a new entry removes the expired ones first, not only what it needs
    cache.put("acme", "late", page, 1)
    assert len(cache) == 1 and cache.bytes == 65536 == cache.tenant_bytes("acme")


def test_review_regressions_in_the_wasi_layer(root: Path) -> None:
    (root / "acme" / "folder").mkdir()
    for bad in ("folder", "secret.txt/x", "a\x00b", "tab\tname"):
        with pytest.raises(FileAccessError):
            mapping(root, "acme", bad).check()
    with pytest.raises(FileAccessError):
        mapping(root, "ac\x00me", "x").check()
    # seeking past 2^63 is EINVAL (28), not a crash; writing after a seek past the end leaves zeros
    seek_far = "(drop (call $seek (i32.const 3) (i64.const 0x7fffffffffffffff) (i32.const 1) (i32.const 16))) " \
               "(call $seek (i32.const 3) (i64.const 0x7fffffffffffffff) (i32.const 1) (i32.const 16))"
    assert run(program(seek_far), files=mapping(root, "acme", "far.txt")).values == [28]
    gap = '(drop (call $seek (i32.const 3) (i64.const 10) (i32.const 0) (i32.const 16))) ' \
          '(call $put (i32.const 3) (i32.const 64) (i32.const 2))'
    run(program(gap, '(data (i32.const 64) "XY")'), files=mapping(root, "acme", "gap.txt"))
    assert (root / "acme" / "gap.txt").read_bytes() == bytes(10) + b"XY"
    # 1024 iovecs over the whole memory: stdout stays capped and the call is cheap
    many = "(local $i i32) (loop $l (i32.store (i32.mul (local.get $i) (i32.const 8)) (i32.const 0)) " \
           "(i32.store (i32.add (i32.mul (local.get $i) (i32.const 8)) (i32.const 4)) (i32.const 65536)) " \
           "(local.set $i (i32.add (local.get $i) (i32.const 1))) (br_if $l (i32.lt_u (local.get $i) " \
           "(i32.const 1024)))) (call $write (i32.const 1) (i32.const 0) (i32.const 1024) (i32.const 9000))"
    result = run(program(many))
    assert result.values == [0] and len(result.stdout) == MAX_CAPTURE  # 64 MiB asked for, 1 MiB kept


def test_run_slots_refuses_wasi_calls_and_imported_memory_is_unsupported() -> None:
    from jaxinfer.processor import run_slots

    with pytest.raises(Unsupported, match="run_slots"):
        run_slots(program("(call $put (i32.const 1) (i32.const 0) (i32.const 1))"), "main", [[]])
    with pytest.raises(Unsupported, match="imported memory"):
        run('(module (import "env" "mem" (memory 1)) (func (export "main") (result i32) (i32.const 1)))')


def test_programs_of_one_tenant_running_at_once_share_its_quota(root: Path) -> None:
    """Each program used to check its writes against the files on disk alone, so two programs of one
    tenant could each stay under the quota and together commit past it."""
    import struct

    import numpy as np

    from jaxinfer.processor.wasi import QuotaExceeded, Syscalls

    running: list[Syscalls] = []
    first, second, other_tenant = (Syscalls(mapping(root, tenant, name, quota=1000), running=lambda: running)
                                   for tenant, name in (("acme", "a.bin"), ("acme", "b.bin"), ("globex", "c.bin")))
    running += [first, second, other_tenant]
    memory = np.zeros(65536 + 8, np.uint8)

    def write(syscalls: Syscalls, length: int) -> int:  # one iovec at 0: `length` bytes from address 64
        memory[:8] = np.frombuffer(struct.pack("<II", 64, length), np.uint8)
        return syscalls.fd_write(memory, 3, 0, 1, 8)

    assert write(first, 600) == 0  # 600 staged + acme's 11 on disk
    assert write(other_tenant, 600) == 0  # another tenant's quota
    with pytest.raises(QuotaExceeded):
        write(second, 600)  # 600 + 11 + the first program's 600
    first.commit()
    running.remove(first)
    with pytest.raises(QuotaExceeded):
        write(second, 600)  # the same bytes, now on disk
    assert write(second, 300) == 0


def test_a_new_tenant_s_first_commit_creates_its_folder(root: Path) -> None:
    data = '(data (i32.const 64) "hello")'
    write = "(call $put (i32.const 3) (i32.const 64) (i32.const 5))"
    result = run(program(write, data), files=mapping(root, "newco", "notes/out.txt"))
    assert result.trap is None and (root / "newco" / "notes" / "out.txt").read_bytes() == b"hello"


def test_a_commit_over_a_link_replaces_the_link_with_a_private_file(root: Path) -> None:
    """The link's own mode (0777) must not become the file's, and its target is left alone."""
    from jaxinfer.processor.wasi import Syscalls

    syscalls = Syscalls(mapping(root, "acme", "out.txt"))
    syscalls.files[3].data[:] = b"mine"
    syscalls.files[3].dirty = True
    os.symlink(root / "globex" / "secret.txt", root / "acme" / "out.txt")  # appears while the program runs
    syscalls.commit()
    written = root / "acme" / "out.txt"
    assert not written.is_symlink() and written.read_bytes() == b"mine"
    assert written.stat().st_mode & 0o777 == 0o600 and (root / "globex" / "secret.txt").read_bytes() == b"globex secret"


def test_refused_reads_close_their_descriptors(root: Path) -> None:
    (root / "acme" / "folder").mkdir()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(FileAccessError, match="not a regular file"):
            mapping(root, "acme", "folder").read("folder", 1 << 20)
    assert len(os.listdir("/proc/self/fd")) == before
