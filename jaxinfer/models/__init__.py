"""Flax NNX decoder models and the architecture registry."""

from jaxinfer.layers.kv_layout import KVCache
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.registry import model_class

__all__ = ["KVCache", "LlamaForCausalLM", "model_class"]
