"""Hugging Face checkpoint folders: config.json and single or sharded *.safetensors.

Tensors are yielded one at a time as (engine name, checkpoint name, array) in the engine's layout:
linear weights are transposed from torch's [out, in] to [in, out], and a sparse layer's experts
(`...experts.{i}.gate_proj.weight`) are stacked into one [experts, in, out] tensor per projection,
yielded once its last expert is read (at most the layers in flight are held on the host).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxinfer.config import ModelConfig, read_hf_config
from jaxinfer.errors import CheckpointError, ConfigError

_LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|gate)\.weight$")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"^(.+\.experts)\.(\w+)$")


def read_config(folder: Path) -> ModelConfig:
    try:
        return read_hf_config(folder / "config.json")
    except ConfigError as exc:
        raise CheckpointError(f"{folder / 'config.json'}: {exc}") from None


def checkpoint_name(name: str) -> str:
    """The tensor name a HF checkpoint uses for an engine parameter (inverse of `engine_name`)."""
    stacked = _STACKED.match(name)
    if stacked:
        return f"{stacked.group(1)}.*.{stacked.group(2)}.weight"
    return name.removesuffix(".kernel") + ".weight" if name.endswith(".kernel") else name


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({folder / name for name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({exc!r})") from None
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{folder}: the index names {f.name}, which is missing")
    return files


def engine_name(hf_name: str) -> str:
    if hf_name == "lm_head.weight":
        return "lm_head.kernel"
    return _LINEAR.sub(lambda m: f".{m.group(1)}.kernel", hf_name)


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names; integer or FP8 tensors are quantized weights


def iter_tensors(folder: Path, cfg: ModelConfig | None = None) -> Iterator[tuple[str, str, np.ndarray]]:
    """Every tensor of the folder in the engine's layout; `cfg` gives the experts to stack per layer."""
    experts = cfg.moe.num_experts if cfg is not None and cfg.moe is not None else 0
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, array in _file_tensors(folder):
        expert = _EXPERT.match(hf_name)
        if expert is not None:
            yield from _stacked_when_complete(stacks, expert, array, experts, folder)
            continue
        name = engine_name(hf_name)
        yield name, hf_name, np.ascontiguousarray(array.T) if name.endswith(".kernel") else array
    if stacks:
        prefix, parts = next(iter(stacks.items()))
        missing = sorted(set(range(experts)) - set(parts))[:5]
        raise CheckpointError(f"{folder}: {prefix} lacks experts {missing} of {experts}")


def _stacked_when_complete(stacks: dict[str, dict[int, np.ndarray]], expert: re.Match, array: np.ndarray,
                           experts: int, folder: Path) -> Iterator[tuple[str, str, np.ndarray]]:
    """Keeps one expert's [in, out] tensor; yields the projection's stack when every expert is in."""
    index = int(expert.group(2))
    key = f"{expert.group(1)}.{expert.group(3)}"
    if not 0 <= index < experts:
        raise CheckpointError(f"{folder}: tensor {expert.group(0)} names expert {index}, but the config has "
                              f"{experts} experts (num_experts / num_local_experts)")
    parts = stacks.setdefault(key, {})
    parts[index] = np.ascontiguousarray(array.T)
    if len(parts) == experts:
        del stacks[key]
        yield key, f"{expert.group(1)}.*.{expert.group(3)}.weight", np.stack([parts[i] for i in range(experts)])


def _file_tensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(checkpoint name, array as stored) of every tensor of every file."""
    for file in safetensors_files(folder):
        try:
            with safe_open(file, framework="numpy") as f:
                for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    dtype = f.get_slice(hf_name).get_dtype()
                    if dtype not in FLOAT_DTYPES:
                        raise CheckpointError(f"{file}: tensor {hf_name} has dtype {dtype}; this engine loads "
                                              f"float weights ({', '.join(FLOAT_DTYPES)}), not quantized ones")
                    yield hf_name, f.get_tensor(hf_name)
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: unreadable or truncated safetensors file ({exc})") from None
