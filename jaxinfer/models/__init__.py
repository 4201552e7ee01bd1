"""Flax NNX decoder models and the architecture registry."""

from jaxinfer.models.llama import KVCache, LlamaForCausalLM
from jaxinfer.models.registry import model_class

__all__ = ["KVCache", "LlamaForCausalLM", "model_class"]
