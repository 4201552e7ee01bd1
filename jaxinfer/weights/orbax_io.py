"""The native checkpoint: orbax-saved weights beside the model config and tokenizer files.

Layout of a checkpoint folder:
  jaxinfer.json      format marker, model config, dtype, where it was converted from
  tokenizer.json     the tokenizer (tokenizers library format)
  tokenizer_config.json  chat template, special tokens, add_bos_token
  state/             orbax PyTree checkpoint of {engine parameter name: array}

Restore places each array directly with its target sharding, so every host reads only its shards.
A draft model's checkpoint may leave out tensors it shares with its target (`from_target` in the
marker, e.g. the embedding): they are taken from the target when the draft is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, ConfigError
from jaxinfer.weights.registry import ORBAX_MARKER
from jaxinfer.weights.shardings import param_sharding

FORMAT = "jaxinfer-orbax"
VERSION = 1


def _flat_key(name: str) -> str:
    # orbax treats '.' in dict keys as plain characters, but '/' would nest: keep names flat and safe.
    return name.replace("/", "_")


def save(folder: Path, cfg: ModelConfig, params: dict[str, nnx.Param | np.ndarray | jax.Array], *, dtype: str,
         source: str, from_target: tuple[str, ...] = (), packed: dict[str, Any] | None = None) -> None:
    """Writes the weights (parameters or plain arrays, by engine name) and the metadata marker last.

    `from_target`: parameters left out because a draft takes them from its target at load time.
    `packed`: the packed projections' formats (weight_plan.to_meta), restored packed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {_flat_key(name): p.get_value() if isinstance(p, nnx.Param) else p for name, p in params.items()}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((folder / "state").absolute(), state, force=True)
    checkpointer.wait_until_finished()
    meta = {"format": FORMAT, "version": VERSION, "model_config": cfg.to_dict(), "dtype": dtype, "source": source}
    if from_target:
        meta["from_target"] = list(from_target)
    if packed:
        meta["packed"] = packed
    tmp = folder / (ORBAX_MARKER + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(folder / ORBAX_MARKER)  # the marker appears last: a half-written folder is not a checkpoint


def read_meta(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / ORBAX_MARKER).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{folder}: unreadable {ORBAX_MARKER} ({exc})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder}: {ORBAX_MARKER} is not a {FORMAT} checkpoint")
    return meta


def read_config(folder: Path) -> ModelConfig:
    try:
        return ModelConfig.from_dict(read_meta(folder)["model_config"])
    except (KeyError, TypeError, ValueError, ConfigError) as exc:  # a marker from another version, or edited
        raise CheckpointError(f"{folder / ORBAX_MARKER}: model_config is missing or invalid ({exc})") from None


def from_target(folder: Path) -> list[str]:
    """Parameters the checkpoint does not hold: a draft takes them from its target model."""
    return list(read_meta(folder).get("from_target", []))


def restore_tensors(
    folder: Path, params: dict[str, nnx.Param], mesh: Mesh
) -> Iterator[tuple[str, str, jax.Array]]:
    abstract = {}
    for name, param in params.items():
        value = param.get_value()
        sharding = param_sharding(name, param, params, mesh)
        abstract[_flat_key(name)] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    state_dir = (Path(folder) / "state").absolute()
    if not state_dir.exists():
        raise CheckpointError(f"{folder}: missing state/ folder")
    try:
        restored = ocp.StandardCheckpointer().restore(state_dir, abstract)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise CheckpointError(f"{folder}: cannot restore weights ({exc})") from None
    for name in params:
        yield name, name, restored[_flat_key(name)]
