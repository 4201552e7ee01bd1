"""Maps an architecture name from a checkpoint to the model family class that implements it."""

from __future__ import annotations

from jaxinfer.config import SUPPORTED_ARCHITECTURES
from jaxinfer.errors import CheckpointError
from jaxinfer.models.decoder import CausalLM
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.mixtral import MixtralForCausalLM
from jaxinfer.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

_CLASSES: dict[str, type[CausalLM]] = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
                                       "qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM}
assert set(_CLASSES) == set(SUPPORTED_ARCHITECTURES), "every supported architecture has a family class"


def model_class(architecture: str) -> type[CausalLM]:
    try:
        return _CLASSES[architecture]
    except KeyError:
        raise CheckpointError(
            f"unknown architecture {architecture!r}; supported: {', '.join(sorted(_CLASSES))}"
        ) from None
