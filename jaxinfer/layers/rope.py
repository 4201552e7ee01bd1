"""Rotary position embeddings (rotate-half form), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """float32 inverse frequencies [head_dim // 2], computed the way transformers does."""
    dim = cfg.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    if cfg.rope_scaling is not None:
        inv = _llama3_scale(inv, cfg)
    if cfg.rope_freq_factors is not None:
        inv = (inv / np.asarray(cfg.rope_freq_factors, np.float32)).astype(np.float32)
    return inv


def _llama3_scale(inv: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    s = cfg.rope_scaling
    assert s is not None
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x [tokens, heads, head_dim] by each token's position."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
