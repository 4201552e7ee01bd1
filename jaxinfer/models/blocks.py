"""The shared blocks a model family composes: attention (the full-attention kind, with its variants),
the gated MLP (or the sparse experts, models/experts.py), the pre-norm decoder layer, and
`_run_layer`, the nested jit every layer runs through (private to models/: the lowered step names it,
and tests count its calls).

Module and parameter names mirror Hugging Face's (`self_attn.q_proj.kernel`), so a checkpoint maps
onto the tree by name. The blocks know nothing of requests: a layer maps a flat batch of tokens,
their attention metadata and its paged KV cache to hidden states and its new cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.layers.attention import AttentionBackend, AttentionMetadata, real_tokens
from jaxinfer.layers.basic import Linear, RMSNorm
from jaxinfer.layers.kv_layout import LayerCache
from jaxinfer.layers.quant import PackedFormat
from jaxinfer.layers.rope import apply_rope
from jaxinfer.models.experts import ONE_DEVICE, ExpertPlacement, SparseMoE
from jaxinfer.models.layer_kinds import AttentionSpec, LayerSpec

# the packed format (layers/quant.py) of each projection, by its name in the block (None: float)
PackedFormats = dict[str, PackedFormat]


class Attention(nnx.Module):
    """Attention over every earlier token of the sequence (the paged KV cache), with RoPE; the
    projections may have a bias (`spec.qkv_bias`) and the heads an RMSNorm before RoPE (`spec.qk_norm`)."""

    def __init__(self, cfg: ModelConfig, spec: AttentionSpec, backend: AttentionBackend, dtype: jnp.dtype,
                 rngs: nnx.Rngs | None, packed: PackedFormats | None = None):
        e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias, packed = spec.qkv_bias, packed or {}
        self.q_proj = Linear(e, h * d, ("embed", "heads"), bias=bias, dtype=dtype, rngs=rngs,
                             packed=packed.get("q_proj"))
        self.k_proj = Linear(e, kv * d, ("embed", "kv_heads"), bias=bias, dtype=dtype, rngs=rngs,
                             packed=packed.get("k_proj"))
        self.v_proj = Linear(e, kv * d, ("embed", "kv_heads"), bias=bias, dtype=dtype, rngs=rngs,
                             packed=packed.get("v_proj"))
        self.o_proj = Linear(h * d, e, ("heads", "embed"), dtype=dtype, rngs=rngs, packed=packed.get("o_proj"))
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, axis_name="head_dim")
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, axis_name="head_dim")
        else:
            self.q_norm = self.k_norm = None
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.backend = backend
        self.kv_layout = backend.layout_for(kv, d, dtype)

    def __call__(
        self, x: jax.Array, cache: LayerCache, meta: AttentionMetadata, inv_freq: jax.Array, lora: jax.Array | None
    ) -> tuple[jax.Array, LayerCache]:
        t = x.shape[0]
        q = self.q_proj(x, lora).reshape(t, self.num_heads, self.head_dim)
        k = self.k_proj(x, lora).reshape(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, lora).reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, meta.positions, inv_freq)
        k = apply_rope(k, meta.positions, inv_freq)
        cache = self.kv_layout.update(cache, k, v, meta.write_slots)
        out = self.backend.attend(q, cache, meta, self.head_dim**-0.5, self.kv_layout)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim), lora), cache


class MLP(nnx.Module):
    """The gated SiLU feed-forward block: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None, packed: PackedFormats | None = None):
        e, m = cfg.hidden_size, cfg.intermediate_size
        packed = packed or {}
        self.gate_proj = Linear(e, m, ("embed", "mlp"), dtype=dtype, rngs=rngs, packed=packed.get("gate_proj"))
        self.up_proj = Linear(e, m, ("embed", "mlp"), dtype=dtype, rngs=rngs, packed=packed.get("up_proj"))
        self.down_proj = Linear(m, e, ("mlp", "embed"), dtype=dtype, rngs=rngs, packed=packed.get("down_proj"))

    def __call__(self, x: jax.Array, lora: jax.Array | None) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x, lora)) * self.up_proj(x, lora), lora)


class DecoderLayer(nnx.Module):
    """A pre-norm residual layer: x + attention(norm(x)), then + feed-forward(norm(x)), as its spec
    declares; the feed-forward block is the MLP (`mlp`) or the sparse experts (under the family's name)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, backend: AttentionBackend, dtype: jnp.dtype,
                 rngs: nnx.Rngs | None, placement: ExpertPlacement = ONE_DEVICE,
                 packed: dict[str, PackedFormats] | None = None):
        """`packed`: the packed projections' formats by block ("self_attn", "mlp") and name."""
        packed = packed or {}
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, spec.attention, backend, dtype, rngs, packed.get("self_attn"))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.sparse = spec.experts is not None
        if spec.experts is None:
            self.feed_forward_name = "mlp"
            self.mlp = MLP(cfg, dtype, rngs, packed.get("mlp"))
        else:
            self.feed_forward_name = spec.experts.module
            setattr(self, spec.experts.module, SparseMoE(cfg.hidden_size, spec.experts, placement, dtype, rngs,
                                                         packed.get(spec.experts.module)))

    def __call__(
        self, x: jax.Array, cache: LayerCache, meta: AttentionMetadata, inv_freq: jax.Array, lora: jax.Array | None
    ) -> tuple[jax.Array, LayerCache]:
        attn_out, cache = self.self_attn(self.input_layernorm(x), cache, meta, inv_freq, lora)
        x = x + attn_out
        normed = self.post_attention_layernorm(x)
        if self.sparse:
            return x + getattr(self, self.feed_forward_name)(normed, real_tokens(meta)), cache
        return x + self.mlp(normed, lora), cache


@functools.partial(jax.jit, static_argnums=0)
def _run_layer(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, cache: LayerCache, meta: AttentionMetadata,
               inv_freq: jax.Array, lora: jax.Array | None) -> tuple[jax.Array, LayerCache]:
    """One decoder layer as a nested jit. The layers share one structure (`graphdef`) and their inputs'
    shapes, so under the step's trace the layer is traced and lowered once per bucket and called once
    per layer; XLA inlines the calls, and the compiled step is the one that 30 copies of the body give.
    Tracing every layer in turn made up most of an engine start's lowering, which is paid even on a
    warm compilation cache (docs/architecture.md, "Model")."""
    return nnx.merge(graphdef, state)(x, cache, meta, inv_freq, lora)
