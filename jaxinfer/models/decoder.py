"""The decoder every family shares: embedding, the layers its family declares, final norm, output
head, and what the engine asks of a model (KV caches per layer kind, attention backend swap,
vocabulary growth, LoRA slots, logits).

A family is a subclass that declares each layer's `LayerSpec` (models/llama.py, models/qwen.py).
Parameter names mirror Hugging Face's (`model.layers.0.self_attn.q_proj.kernel`), so a checkpoint
maps onto the tree by name. The model knows nothing of requests: it maps a flat batch of tokens,
their attention metadata and the per-layer paged KV caches to hidden states and new caches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxinfer.config import ModelConfig
from jaxinfer.layers.attention import AttentionBackend, AttentionMetadata, ReferenceAttention
from jaxinfer.layers.basic import Embed, Linear, RMSNorm, weight_params
from jaxinfer.layers.kv_layout import KVLayout
from jaxinfer.layers.lora import ZerosFn, slot_one_hot
from jaxinfer.layers.quant import PackedFormat
from jaxinfer.layers.rope import inverse_frequencies
from jaxinfer.models.blocks import DecoderLayer, _run_layer
from jaxinfer.models.experts import ONE_DEVICE, ExpertPlacement
from jaxinfer.models.layer_kinds import FULL_ATTENTION, LayerSpec
from jaxinfer.parallel.mesh import named_sharding

EMBEDDING, OUTPUT_HEAD = "model.embed_tokens.weight", "lm_head.kernel"  # parameter names packed formats key on


def _pad_param(param: nnx.Param, pad: tuple[tuple[int, int], ...]) -> None:
    """Pads a parameter with zeros, resharded for its new shape (the mesh axis may no longer divide it)."""
    value = param[...]
    grown = jnp.pad(value, pad)
    sharding = value.sharding
    if isinstance(sharding, NamedSharding):
        sharding = named_sharding(grown.shape, param.logical_axes, sharding.mesh)
    param.set_value(jax.device_put(grown, sharding))


class DecoderStack(nnx.Module):
    """`model.*` of a checkpoint: the embedding, the layers (one spec each) and the final norm."""

    def __init__(self, cfg: ModelConfig, specs: tuple[LayerSpec, ...], backend: AttentionBackend, dtype: jnp.dtype,
                 rngs: nnx.Rngs | None, placement: ExpertPlacement, packed: dict[str, PackedFormat]):
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs,
                                  packed=packed.get(EMBEDDING))
        self.layers = nnx.List([DecoderLayer(cfg, spec, backend, dtype, rngs, placement, _layer_formats(packed, i))
                                for i, spec in enumerate(specs)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


def _layer_formats(packed: dict[str, PackedFormat], index: int) -> dict[str, dict[str, PackedFormat]]:
    """Layer `index`'s packed weights by block and name within it ("q_proj", or a sparse block's
    "experts.gate_proj"), from formats by parameter name."""
    found: dict[str, dict[str, PackedFormat]] = {}
    prefix = f"model.layers.{index}."
    for name, fmt in packed.items():
        if name.startswith(prefix):
            block, inner = name[len(prefix):].removesuffix(".kernel").split(".", 1)
            found.setdefault(block, {})[inner] = fmt
    return found


class CausalLM(nnx.Module):
    """Decoder with a paged KV cache; `__call__` runs one ragged batch, `logits` projects rows.

    A family overrides `layer_spec` (what layer `index` of a checkpoint with `cfg` is). `placement`: the
    mesh axes a mixture-of-experts layer splits over (models/experts.py). `packed`: the format of each
    packed projection, by its kernel's parameter name (layers/quant.py; the others are float)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        backend: AttentionBackend | None = None,
        rngs: nnx.Rngs | None = None,
        placement: ExpertPlacement = ONE_DEVICE,
        packed: dict[str, PackedFormat] | None = None,
    ):
        self.config = cfg
        self.dtype = dtype
        self.lora_slots = 0  # adapter slots, slot 0 = none (add_lora_slots)
        self.base_vocab_size = cfg.vocab_size  # ids from here on were added (extend_vocabulary)
        self.layer_specs = tuple(self.layer_spec(cfg, i) for i in range(cfg.num_layers))
        self.packed_formats = tuple(sorted((packed or {}).items()))  # a tuple: the graph's static data is hashed
        self.model = DecoderStack(cfg, self.layer_specs, backend or ReferenceAttention(), dtype, rngs, placement,
                                  dict(self.packed_formats))
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), dtype=dtype, rngs=rngs,
                        packed=dict(self.packed_formats).get(OUTPUT_HEAD))
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

    @staticmethod
    def layer_spec(cfg: ModelConfig, index: int) -> LayerSpec:
        """Layer `index`'s kind and variants; each family class (models/llama.py, qwen.py) defines it."""
        raise NotImplementedError("CausalLM is the shared decoder: build a family class (models.model_class)")

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind (models/layer_kinds.py): what KV it keeps."""
        return tuple(spec.kind for spec in self.layer_specs)

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
        return tuple(self._empty_cache(kind, num_pages, page_size, mesh) for kind in self.layer_kinds)

    def _empty_cache(self, kind: str, num_pages: int, page_size: int, mesh: Mesh | None):
        """One layer's cache for its kind: a full-attention layer's pages in the shared pool."""
        assert kind == FULL_ATTENTION, f"no cache for layer kind {kind!r}"  # LayerSpec refuses others
        return self.kv_layout.empty(num_pages, page_size, self.dtype, mesh)

    def extend_vocabulary(self, size: int) -> None:
        """Grows the embedding (and an untied output head) to ``size`` ids with zero rows, for control
        tokens added to the tokenizer; a zero row scores 0 for every hidden state until trained."""
        grow = size - self.config.vocab_size
        if grow <= 0:
            return
        embed = self.model.embed_tokens
        for param in weight_params(embed, "weight", embed.packed):  # packed: zero scales and offsets, zero rows
            _pad_param(param, ((0, grow), (0, 0)))
        if self.lm_head is not None:
            for param in weight_params(self.lm_head, "kernel", self.lm_head.packed):
                _pad_param(param, ((0, 0), (0, grow)))
        self.config = dataclasses.replace(self.config, vocab_size=size)

    def adaptable_linears(self, targets: tuple[str, ...]) -> dict[str, Linear]:
        """The projections named in ``targets`` (q_proj ... down_proj), by their checkpoint prefix; the
        experts of a sparse layer are not adapted (its router and experts are not `Linear`s here)."""
        found = {}
        for i, layer in enumerate(self.model.layers):
            for block_name, block in (("self_attn", layer.self_attn), ("mlp", getattr(layer, "mlp", None))):
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
        return jnp.dot(hidden, self.lm_head.weight(hidden.dtype), preferred_element_type=jnp.float32)
