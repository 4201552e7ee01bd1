"""A checkpoint's content fingerprint: do two processes, or two runs, read the same weights?

The fingerprint hashes every byte of the checkpoint's files (BLAKE2b) with their paths relative to
the checkpoint and their sizes. It depends on the content only: not on where the files lie, their
modification times, or the registry name that led to them. A partial hash (samples of each file)
would miss a fine-tune that changed a few tensors of a same-size file, and the KV store serves
pages by this key, so a miss would be stale pages computed with other weights.

Hashing a 16 GB checkpoint reads it once (seconds to tens of seconds), so each file's digest is
cached under `$JAXINFER_FINGERPRINT_CACHE` (default `~/.cache/jaxinfer/fingerprints`; "off"
disables it), keyed by the file's real path, device, inode, size and modification time in
nanoseconds: a rewritten file gets a new key. An edit that restores the size and modification time
by hand is not seen while its cache entry lives.

Uses: the processes of a group compare their fingerprints before loading (each reads its own copy
of the checkpoint, and nothing else would catch copies that differ), and the KV store keys pages by
it, so workers on different hosts with the same files share pages.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from jaxinfer.errors import CheckpointError
from jaxinfer.weights.registry import resolve

DIGEST_CHARS = 16
READ_BYTES = 1 << 22
ENV_CACHE = "JAXINFER_FINGERPRINT_CACHE"
# Other frameworks' copies of the weights that a download may carry next to the ones read here
# (`original/consolidated.00.pth` in Llama repositories); notes and hidden caches are not weights either.
NOT_READ_SUFFIXES = frozenset({".md", ".pth", ".pt", ".bin", ".h5", ".msgpack", ".onnx", ".ckpt"})


def fingerprint(path: str | Path) -> str:
    """The fingerprint of a checkpoint file or folder (hex). A single file is hashed without its name."""
    root = Path(path)
    try:
        files = [("", root)] if root.is_file() else _content_files(root)
        if not files:
            raise CheckpointError(f"{path}: the folder holds no checkpoint files")
        digest = hashlib.sha256()
        for name, file in files:
            size, file_digest = _file_digest_cached(file)
            digest.update(f"{name}\0{size}\0{file_digest}\0".encode())
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read for its fingerprint ({error})") from None
    return digest.hexdigest()[:DIGEST_CHARS]


def _content_files(root: Path) -> list[tuple[str, Path]]:
    """(relative name, path) of the files under `root` that hold the model, sorted by name; symlinked
    folders are followed once each."""
    if not root.is_dir():
        raise FileNotFoundError(f"no such file or folder: {root}")
    found, seen = [], set()
    for folder, subfolders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree
            subfolders.clear()
            continue
        seen.add(real)
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        for name in names:
            file = Path(folder, name)
            if not name.startswith(".") and file.suffix not in NOT_READ_SUFFIXES and file.is_file():
                found.append((file.relative_to(root).as_posix(), file))
    return sorted(found)


def _file_digest_cached(file: Path) -> tuple[int, str]:
    """(size, BLAKE2b hex digest) of a file, from the cache when its identity has not changed."""
    stat = file.stat()
    cache = _cache_dir()
    key = f"{os.path.realpath(file)}\0{stat.st_dev}\0{stat.st_ino}\0{stat.st_size}\0{stat.st_mtime_ns}"
    entry = cache / hashlib.sha256(key.encode()).hexdigest() if cache else None
    if entry is not None and entry.is_file():
        return stat.st_size, entry.read_text().strip()
    digest = _file_digest(file)
    if entry is not None:
        _write_quietly(entry, digest)
    return stat.st_size, digest


def _file_digest(file: Path) -> str:
    digest = hashlib.blake2b()
    with open(file, "rb") as stream:
        while chunk := stream.read(READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _cache_dir() -> Path | None:
    setting = os.environ.get(ENV_CACHE) or str(Path.home() / ".cache/jaxinfer/fingerprints")
    return None if setting == "off" else Path(setting)


def _write_quietly(entry: Path, digest: str) -> None:
    """Writes a cache entry whole (another process may read it at once); a cache that cannot be
    written only costs the next run a rehash."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, delete=False, suffix=".tmp") as temporary:
            temporary.write(digest)
        os.replace(temporary.name, entry)
    except OSError:
        pass


def load_fingerprints(model: str | Path, draft_model: str = "") -> dict[str, dict[str, str]]:
    """What a process of a group loads: each checkpoint as named, with its fingerprint."""
    named = {"model": str(model), **({"draft_model": draft_model} if draft_model else {})}
    return {field: {"name": name, "fingerprint": fingerprint(resolve(name).path)} for field, name in named.items()}


def check_same_as_leader(leader: dict[str, dict[str, str]], own: dict[str, dict[str, str]], process_id: int) -> None:
    """Raises CheckpointError when this process would load other weights than the leader (process 0)."""
    for field in sorted(set(leader) | set(own)):
        theirs, ours = leader.get(field), own.get(field)
        if theirs is None or ours is None:
            raise CheckpointError(f"{field}: the leader (process 0) loads {_describe(theirs)}, process "
                                  f"{process_id} {_describe(ours)}; every process of a group loads the same")
        if theirs["fingerprint"] != ours["fingerprint"]:
            raise CheckpointError(f"{field}: process {process_id} reads {_describe(ours)}, other files than the "
                                  f"leader's (process 0) {_describe(theirs)}; every process of a group must load "
                                  "the same checkpoint (copy the leader's files)")


def _describe(entry: dict[str, str] | None) -> str:
    return "none" if entry is None else f"{entry['name']!r} (fingerprint {entry['fingerprint']})"
