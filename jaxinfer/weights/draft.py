"""A draft model made from its target: the target's first layers with its embedding, final norm and head.

Such a truncated (layer-skip) draft shares the target's vocabulary and tokenizer by construction;
it agrees with the target often enough to be a starting point, and `tools/train_draft.py`
distills it further. It is saved as a native orbax checkpoint, loadable as `draft_model`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.models import LlamaForCausalLM
from jaxinfer.weights import orbax_io
from jaxinfer.weights.loader import parameters

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def truncated_weights(model: LlamaForCausalLM, cfg: ModelConfig, num_layers: int
                      ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, host weights by engine name) of the first `num_layers` layers of `model`."""
    if not 0 < num_layers <= cfg.num_layers:
        raise ConfigError(f"num_layers: a draft needs 1 to {cfg.num_layers} layers, got {num_layers}")
    weights = {}
    for name, param in parameters(model).items():
        layer = LAYER.match(name)
        if layer is None or int(layer.group(1)) < num_layers:
            weights[name] = np.asarray(param.get_value())
    return dataclasses.replace(cfg, num_layers=num_layers), weights


def save_draft(folder: Path, cfg: ModelConfig, weights: dict[str, np.ndarray], source: str) -> None:
    dtype = str(next(iter(weights.values())).dtype)
    orbax_io.save(folder, cfg, weights, dtype=dtype, source=source)
