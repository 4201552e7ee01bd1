"""The Llama-family decoder (Llama 3.x, SmolLM2, Qwen2/2.5 with qkv bias, Qwen3 with q/k norm).

Module and parameter names mirror Hugging Face's (`model.layers.0.self_attn.q_proj.kernel`), so a
checkpoint maps onto the tree by name. The model knows nothing of requests: it maps a flat batch of
tokens, their attention metadata and the per-layer paged KV caches to hidden states and new caches.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxinfer.config import ModelConfig
from jaxinfer.layers.attention import AttentionBackend, AttentionMetadata, ReferenceAttention
from jaxinfer.layers.basic import Embed, Linear, RMSNorm
from jaxinfer.layers.kv_layout import KVLayout, LayerCache
from jaxinfer.layers.lora import ZerosFn, slot_one_hot
from jaxinfer.layers.rope import apply_rope, inverse_frequencies
from jaxinfer.parallel.mesh import named_sharding


def _pad_param(param: nnx.Param, pad: tuple[tuple[int, int], ...]) -> None:
    """Pads a parameter with zeros, resharded for its new shape (the mesh axis may no longer divide it)."""
    value = param[...]
    grown = jnp.pad(value, pad)
    sharding = value.sharding
    if isinstance(sharding, NamedSharding):
        sharding = named_sharding(grown.shape, param.logical_axes, sharding.mesh)
    param.set_value(jax.device_put(grown, sharding))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(e, h * d, ("embed", "heads"), bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(e, kv * d, ("embed", "kv_heads"), bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(e, kv * d, ("embed", "kv_heads"), bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * d, e, ("heads", "embed"), dtype=dtype, rngs=rngs)
        if cfg.qk_norm:
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
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        e, m = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(e, m, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(e, m, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(m, e, ("mlp", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, lora: jax.Array | None) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x, lora)) * self.up_proj(x, lora), lora)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, backend, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(
        self, x: jax.Array, cache: LayerCache, meta: AttentionMetadata, inv_freq: jax.Array, lora: jax.Array | None
    ) -> tuple[jax.Array, LayerCache]:
        attn_out, cache = self.self_attn(self.input_layernorm(x), cache, meta, inv_freq, lora)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x), lora), cache


@functools.partial(jax.jit, static_argnums=0)
def _run_layer(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, cache: LayerCache, meta: AttentionMetadata,
               inv_freq: jax.Array, lora: jax.Array | None) -> tuple[jax.Array, LayerCache]:
    """One decoder layer as a nested jit. The layers share one structure (`graphdef`) and their inputs'
    shapes, so under the step's trace the layer is traced and lowered once per bucket and called once
    per layer; XLA inlines the calls, and the compiled step is the one that 30 copies of the body give.
    Tracing every layer in turn made up most of an engine start's lowering, which is paid even on a
    warm compilation cache (docs/architecture.md, "Model")."""
    return nnx.merge(graphdef, state)(x, cache, meta, inv_freq, lora)


class LlamaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, backend, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


class LlamaForCausalLM(nnx.Module):
    """Decoder with a paged KV cache; `__call__` runs one ragged batch, `logits` projects rows."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        backend: AttentionBackend | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        self.config = cfg
        self.dtype = dtype
        self.lora_slots = 0  # adapter slots, slot 0 = none (add_lora_slots)
        self.base_vocab_size = cfg.vocab_size  # ids from here on were added (extend_vocabulary)
        self.model = LlamaModel(cfg, backend or ReferenceAttention(), dtype, rngs)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), dtype=dtype, rngs=rngs)
        )

    def __call__(
        self, tokens: jax.Array, caches: tuple, meta: AttentionMetadata, adapters: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple]:
        """tokens [T] (with their adapter slots [T]) -> final-norm hidden states [T, hidden], updated caches."""
        x = self.model.embed_tokens(tokens, adapters)
        lora = slot_one_hot(adapters, self.lora_slots, x.dtype) if adapters is not None and self.lora_slots else None
        inv_freq = jnp.asarray(inverse_frequencies(self.config))
        new_caches = []
        for layer, cache in zip(self.model.layers, caches, strict=True):
            graphdef, state = nnx.split(layer)
            x, cache = _run_layer(graphdef, state, x, cache, meta, inv_freq, lora)
            new_caches.append(cache)
        return self.model.norm(x), tuple(new_caches)

    @property
    def kv_layout(self) -> KVLayout:
        """The layout of each layer's KV cache, chosen by the attention backend for this model's heads."""
        return self.model.layers[0].self_attn.kv_layout

    def set_attention(self, backend: AttentionBackend) -> None:
        """Swaps every layer's attention backend, and with it the layout of the caches it reads."""
        for layer in self.model.layers:
            attention = layer.self_attn
            attention.backend = backend
            attention.kv_layout = backend.layout_for(attention.num_kv_heads, attention.head_dim, self.dtype)

    def empty_caches(self, num_pages: int, page_size: int, mesh: Mesh | None = None) -> tuple:
        """Zeroed KV caches of every layer over `num_pages` page ids, sharded on `mesh` when one is given."""
        return tuple(self.kv_layout.empty(num_pages, page_size, self.dtype, mesh) for _ in self.model.layers)

    def extend_vocabulary(self, size: int) -> None:
        """Grows the embedding (and an untied output head) to ``size`` ids with zero rows, for control
        tokens added to the tokenizer; a zero row scores 0 for every hidden state until trained."""
        grow = size - self.config.vocab_size
        if grow <= 0:
            return
        _pad_param(self.model.embed_tokens.weight, ((0, grow), (0, 0)))
        if self.lm_head is not None:
            _pad_param(self.lm_head.kernel, ((0, 0), (0, grow)))
        self.config = dataclasses.replace(self.config, vocab_size=size)

    def adaptable_linears(self, targets: tuple[str, ...]) -> dict[str, Linear]:
        """The projections named in ``targets`` (q_proj ... down_proj), by their checkpoint prefix."""
        found = {}
        for i, layer in enumerate(self.model.layers):
            for block_name, block in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
                for name in targets:
                    if isinstance(getattr(block, name, None), Linear):
                        found[f"model.layers.{i}.{block_name}.{name}"] = getattr(block, name)
        return found

    def add_lora_slots(self, slots: int, rank: int, targets: tuple[str, ...], zeros: ZerosFn) -> None:
        """Gives the target projections `slots` zeroed adapter slots of `rank`, and, with tied embeddings
        and ids added past the checkpoint's vocabulary, per-slot rows for those ids (filled with the base's)."""
        for linear in self.adaptable_linears(targets).values():
            linear.add_lora_slots(slots, rank, zeros)
        if self.lm_head is None and self.base_vocab_size < self.config.vocab_size:
            self.model.embed_tokens.add_token_slots(slots, self.base_vocab_size, zeros)
        self.lora_slots = slots

    def logits(self, hidden: jax.Array, adapters: jax.Array | None = None) -> jax.Array:
        """float32 logits [..., vocab] for the given hidden rows (with their adapter slots)."""
        if self.lm_head is None:
            return self.model.embed_tokens.attend(hidden, adapters)
        return jnp.dot(hidden, self.lm_head.kernel[...], preferred_element_type=jnp.float32)
