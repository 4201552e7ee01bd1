"""Checkpoint formats (HF safetensors, GGUF, native orbax), the named registry, and weight loading."""

from jaxinfer.weights.loader import LoadedModel, load_model, random_model
from jaxinfer.weights.registry import ResolvedCheckpoint, known_names, resolve

__all__ = ["LoadedModel", "ResolvedCheckpoint", "known_names", "load_model", "random_model", "resolve"]
