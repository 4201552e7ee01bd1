"""Maps an architecture name from a checkpoint to the model class that implements it."""

from __future__ import annotations

from jaxinfer.config import SUPPORTED_ARCHITECTURES
from jaxinfer.errors import CheckpointError
from jaxinfer.models.llama import LlamaForCausalLM

_CLASSES = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return _CLASSES[architecture]
    except KeyError:
        raise CheckpointError(
            f"unknown architecture {architecture!r}; supported: {', '.join(sorted(_CLASSES))}"
        ) from None
