"""A checkpoint's content fingerprint: do two processes, or two runs, read the same weights?

Hashing every byte of an 8B checkpoint takes tens of seconds; the fingerprint instead hashes each
file's relative path, its size and evenly spaced samples of its bytes (a fine-tune or a different
quantization changes bytes everywhere, so the samples differ). It reads a few hundred KB per file,
so it is cheap enough to compute on every load, and it depends on the content only: not on where
the files lie, their modification times, or the registry name that led to them.

Uses: the processes of a group compare their fingerprints before loading (each reads its own copy
of the checkpoint, and nothing else would catch copies that differ), and the KV store keys pages by
it, so workers on different hosts with the same files share pages.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from jaxinfer.errors import CheckpointError
from jaxinfer.weights.registry import resolve

SAMPLE_BYTES = 1 << 16
SAMPLES_PER_FILE = 8
DIGEST_CHARS = 16


def fingerprint(path: str | Path) -> str:
    """The fingerprint of a checkpoint file or folder (hex); hidden entries and Markdown are ignored."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(_content_files(root))
    digest = hashlib.sha256()
    for file in files:
        name = file.name if file == root else file.relative_to(root).as_posix()
        try:
            _hash_file(digest, name, file)
        except OSError as error:
            raise CheckpointError(f"{file}: cannot be read for its fingerprint ({error})") from None
    return digest.hexdigest()[:DIGEST_CHARS]


def _content_files(root: Path) -> list[Path]:
    """Files under `root` that hold the model: not caches, locks or notes (`.cache/`, README.md)."""
    return [file for file in root.rglob("*")
            if file.is_file() and not any(part.startswith(".") for part in file.relative_to(root).parts)
            and file.suffix != ".md"]


def _hash_file(digest: hashlib._Hash, name: str, file: Path) -> None:
    size = file.stat().st_size
    digest.update(f"{name}\0{size}\0".encode())
    with open(file, "rb") as stream:
        for offset in _sample_offsets(size):
            stream.seek(offset)
            digest.update(stream.read(SAMPLE_BYTES))


def _sample_offsets(size: int) -> list[int]:
    """Where the samples start: the whole file when it is small, else evenly spaced, ending at its end."""
    if size <= SAMPLE_BYTES * SAMPLES_PER_FILE:
        return list(range(0, size, SAMPLE_BYTES))
    last = size - SAMPLE_BYTES
    return [last * i // (SAMPLES_PER_FILE - 1) for i in range(SAMPLES_PER_FILE)]


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
