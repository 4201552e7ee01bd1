"""Linear, embedding and RMSNorm modules whose parameters carry logical axis names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _init(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype: jnp.dtype, scale: float = 0.02) -> jax.Array:
    if rngs is None:
        return jnp.zeros(shape, dtype)
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is stored [in, out] (the transpose of torch's Linear)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        axes: tuple[str, str],
        *,
        bias: bool = False,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        self.kernel = nnx.Param(_init(rngs, (in_features, out_features), dtype), logical_axes=axes)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype), logical_axes=(axes[1],)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.dot(x, self.kernel[...], preferred_element_type=jnp.float32).astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embed(nnx.Module):
    """Token embedding table [vocab, embed]; `attend` reuses it as a tied output projection."""

    def __init__(self, vocab: int, dim: int, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None = None):
        self.weight = nnx.Param(_init(rngs, (vocab, dim), dtype), logical_axes=("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...e,ve->...v", x, self.weight[...], preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight (HF Llama semantics)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype = jnp.float32, axis_name: str = "embed"):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype), logical_axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)
