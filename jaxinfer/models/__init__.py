"""Flax NNX decoder models: the shared decoder and blocks, one small file per family, the registry."""

from jaxinfer.layers.kv_layout import KVCache
from jaxinfer.models.decoder import CausalLM
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.mixtral import MixtralForCausalLM
from jaxinfer.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM
from jaxinfer.models.registry import model_class

__all__ = ["CausalLM", "KVCache", "LlamaForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
           "Qwen3MoeForCausalLM", "model_class"]
