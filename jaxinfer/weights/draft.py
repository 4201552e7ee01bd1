"""A draft model made from its target: the target's first layers with its embedding, final norm and head.

Such a truncated (layer-skip) draft shares the target's vocabulary and tokenizer by construction;
it agrees with the target often enough to be a starting point, and `tools/train_draft.py`
distills it further. It is saved as a native orbax checkpoint, loadable as `draft_model`, without
the embedding it shares with the target.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.models import CausalLM
from jaxinfer.weights import orbax_io
from jaxinfer.weights.loader import parameters

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
SHARED_PREFIX = "model.embed_tokens."  # kept frozen in training, so identical to the target's


def truncated_weights(model: CausalLM, cfg: ModelConfig, num_layers: int
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


def save_draft(folder: Path, cfg: ModelConfig, weights: dict[str, np.ndarray], source: str,
               dtype: str | None = None, share_embedding: bool = True) -> None:
    """Saves a draft; with `share_embedding` its (frozen) embedding is left out and taken from the
    target at load time, which is most of a small draft's bytes (SmolLM2: 28M of 35M parameters)."""
    shared = tuple(name for name in weights if name.startswith(SHARED_PREFIX)) if share_embedding else ()
    kept = {name: w.astype(dtype) if dtype else w for name, w in weights.items() if name not in shared}
    orbax_io.save(folder, cfg, kept, dtype=dtype or str(next(iter(kept.values())).dtype), source=source,
                  from_target=shared)
