"""LoRA adapter files: PEFT's layout (adapter_config.json + adapter_model.safetensors) or orbax.

Both layouts hold the same tensors under PEFT's names:
  base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight   [rank, in]
  base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_B.weight   [out, rank]
  base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta [n, embed]
    (the new rows of the ids in `trainable_token_indices`, PEFT's trainable tokens)
An orbax adapter keeps them in ``state/`` (an orbax PyTree checkpoint) beside adapter_config.json.
`read_adapter` turns either into engine-ready arrays: A [in, rank], B [rank, out] with the scale
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) folded into B.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxinfer.errors import CheckpointError

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
ORBAX_STATE = "state"
LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.\d+\.(?:self_attn|mlp)\.\w+)\.lora_([AB])"
                      r"(?:\.default)?\.weight$")
TOKENS_KEY = re.compile(r"^(?:base_model\.model\.)?model\.embed_tokens\.token_adapter\.trainable_tokens_delta"
                        r"(?:\.default)?$")
TOKENS_NAME = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter ready for the engine's slots."""

    rank: int
    modules: dict[str, tuple[np.ndarray, np.ndarray]]  # "model.layers.0.self_attn.q_proj" -> (A [in, r], B [r, out])
    token_ids: tuple[int, ...]  # ids whose embedding rows the adapter replaces
    token_rows: np.ndarray | None  # [len(token_ids), embed]
    digest: str  # content hash: prefix-cache pages computed with it are keyed by this

    @property
    def targets(self) -> set[str]:
        return {name.rsplit(".", 1)[1] for name in self.modules}

    def to_arrays(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(JSON-able fields, named arrays): the adapter as the multi-host control channel sends it."""
        arrays = {f"{module}.{part}": matrix for module, pair in self.modules.items()
                  for part, matrix in zip("AB", pair, strict=True)}
        if self.token_rows is not None:
            arrays["token_rows"] = self.token_rows
        return {"rank": self.rank, "modules": list(self.modules), "token_ids": list(self.token_ids),
                "digest": self.digest}, arrays

    @classmethod
    def from_arrays(cls, fields: dict, arrays: dict[str, np.ndarray]) -> AdapterWeights:
        modules = {module: (arrays[f"{module}.A"], arrays[f"{module}.B"]) for module in fields["modules"]}
        return cls(fields["rank"], modules, tuple(fields["token_ids"]), arrays.get("token_rows"), fields["digest"])


def lora_name(module: str, part: str) -> str:
    """PEFT's tensor name of a module's A or B matrix."""
    return f"base_model.model.{module}.lora_{part}.weight"


def read_adapter(path: Path) -> AdapterWeights:
    """Reads and checks an adapter folder (either layout); errors name the file and the field."""
    path = Path(path)
    config = _read_config(path)
    tensors = _read_tensors(path)
    rank, scale = _rank_and_scale(path, config)
    modules = _modules(path, tensors, rank, scale)
    token_ids, token_rows = _token_rows(path, config, tensors)
    if not modules and token_rows is None:
        raise CheckpointError(f"{path}: the adapter holds no LoRA tensors")
    return AdapterWeights(rank, modules, token_ids, token_rows, _digest(config, tensors))


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not an adapter folder (no {CONFIG_FILE})") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / CONFIG_FILE}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / CONFIG_FILE}: must hold a JSON object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path / CONFIG_FILE}: peft_type {config.get('peft_type')!r}; only LORA is served")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise CheckpointError(f"{path / CONFIG_FILE}: {flag} is not supported")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise CheckpointError(f"{path / CONFIG_FILE}: bias and modules_to_save are not supported (LoRA "
                              f"matrices and trainable tokens only)")
    return config


def _this_process_only() -> ocp.StandardCheckpointer:
    """A checkpointer whose barriers involve this process alone: in a process group only the leader
    reads an adapter (it sends the checked tensors), and the others are not there to meet it."""
    process = jax.process_index()
    return ocp.StandardCheckpointer(multiprocessing_options=ocp.options.MultiprocessingOptions(
        primary_host=process, active_processes={process}, barrier_sync_key_prefix=f"adapter-read-{process}"))


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    if (path / SAFETENSORS_FILE).exists():
        try:
            with safe_open(path / SAFETENSORS_FILE, framework="numpy") as tensors:  # bf16 too, on the host
                return {name: tensors.get_tensor(name) for name in tensors.keys()}  # noqa: SIM118 (not a mapping)
        except Exception as exc:  # safetensors raises its own error types for damaged files
            raise CheckpointError(f"{path / SAFETENSORS_FILE}: unreadable ({exc})") from None
    if (path / ORBAX_STATE).is_dir():
        try:
            restored = _this_process_only().restore((path / ORBAX_STATE).absolute())
        except Exception as exc:  # orbax and tensorstore raise many types for a damaged or foreign folder
            raise CheckpointError(f"{path / ORBAX_STATE}: cannot restore ({exc})") from None
        return {name: np.asarray(value) for name, value in restored.items()}
    raise CheckpointError(f"{path}: no {SAFETENSORS_FILE} and no orbax {ORBAX_STATE}/ folder")


def _rank_and_scale(path: Path, config: dict[str, Any]) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)  # PEFT's default alpha
    rank_ok = isinstance(rank, int) and not isinstance(rank, bool) and rank > 0
    alpha_ok = isinstance(alpha, int | float) and not isinstance(alpha, bool) and math.isfinite(alpha)
    if not (rank_ok and alpha_ok):
        raise CheckpointError(f"{path / CONFIG_FILE}: r must be a positive integer and lora_alpha a finite number")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise CheckpointError(f"{path / CONFIG_FILE}: rank_pattern / alpha_pattern are not supported")
    return rank, alpha / (rank**0.5 if config.get("use_rslora") else rank)


def _modules(path: Path, tensors: dict[str, np.ndarray], rank: int, scale: float
             ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    parts: dict[str, dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        match = LORA_KEY.match(name)
        if match is not None:
            parts.setdefault(match.group(1), {})[match.group(2)] = value
        elif ".experts." in name:
            raise CheckpointError(f"{path}: tensor {name!r} adapts an expert of a sparse layer; LoRA on experts "
                                  "is not supported yet (adapt the attention projections and dense layers)")
        elif TOKENS_KEY.match(name) is None:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} (LoRA A/B of the projections and "
                                  f"trainable tokens only)")
    modules = {}
    for module, pair in sorted(parts.items()):
        if set(pair) != {"A", "B"}:
            raise CheckpointError(f"{path}: {module} has lora_{'A' if 'A' in pair else 'B'} without its partner")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise CheckpointError(f"{path}: {module}: lora_A {a.shape} / lora_B {b.shape} do not match r={rank}")
        modules[module] = (_finite(path, f"{module}.lora_A", a.T), _finite(path, f"{module}.lora_B", b.T * scale))
    return modules


def _finite(path: Path, name: str, values: np.ndarray) -> np.ndarray:
    """`values` as float32, refusing NaN and infinities (also those a float64 value overflows to): one
    non-finite slot would turn every row of a batch to NaN, requests without an adapter included."""
    cast = np.asarray(values, np.float32)
    if not np.isfinite(cast).all():
        raise CheckpointError(f"{path}: {name} holds NaN or infinite values (after scaling by lora_alpha / r and "
                              "casting to float32)")
    return cast


def _token_rows(path: Path, config: dict[str, Any], tensors: dict[str, np.ndarray]
                ) -> tuple[tuple[int, ...], np.ndarray | None]:
    indices = config.get("trainable_token_indices") or ()
    if isinstance(indices, dict):
        indices = indices.get("embed_tokens", ())
    ids = isinstance(indices, list | tuple) and all(isinstance(i, int) and not isinstance(i, bool) for i in indices)
    if not ids:
        raise CheckpointError(f"{path / CONFIG_FILE}: trainable_token_indices must be a list of token ids")
    rows = next((value for name, value in tensors.items() if TOKENS_KEY.match(name)), None)
    if rows is None and not indices:
        return (), None
    if rows is None or rows.ndim != 2 or rows.shape[0] != len(indices):
        raise CheckpointError(f"{path}: trainable_token_indices lists {len(indices)} ids but the trainable "
                              f"tokens tensor is {None if rows is None else rows.shape}")
    return tuple(int(i) for i in indices), _finite(path, "trainable tokens", rows)


def _digest(config: dict[str, Any], tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name]).tobytes())
    return h.hexdigest()[:32]


def save_adapter(folder: Path, config: dict[str, Any], tensors: dict[str, np.ndarray], *, layout: str) -> None:
    """Writes an adapter in `layout` "peft" (safetensors) or "orbax"; the config file comes last."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    if layout == "peft":
        save_file(arrays, str(folder / SAFETENSORS_FILE))
    elif layout == "orbax":
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save((folder / ORBAX_STATE).absolute(), arrays, force=True)
        checkpointer.wait_until_finished()
    else:
        raise ValueError(f"layout must be peft or orbax, got {layout!r}")
    tmp = folder / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps({"peft_type": "LORA", **config}, indent=2))
    tmp.replace(folder / CONFIG_FILE)  # a folder without its config is not an adapter
