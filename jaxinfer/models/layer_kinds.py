"""What a model family declares about each layer: its kind (the KV it keeps) and its blocks' variants.

The kind names follow Hugging Face's `layer_types` ("full_attention", and later "sliding_attention"
and "linear_attention"). The decoder builds each layer from its `LayerSpec`, and the KV caches are
made per layer from its kind (`CausalLM.empty_caches`), so a new kind is a new cache and block,
not a special case in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxinfer.models.experts import ExpertsSpec

FULL_ATTENTION = "full_attention"  # every earlier token's KV, in pages of the shared pool
LAYER_KINDS = (FULL_ATTENTION,)


@dataclass(frozen=True)
class AttentionSpec:
    """The variants of the attention block: a bias on the q/k/v projections, an RMSNorm on each
    head's queries and keys before RoPE."""

    qkv_bias: bool = False
    qk_norm: bool = False


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its kind, its attention's variants, and its feed-forward block: the gated
    SiLU MLP, or the sparse experts where `experts` is set (models/experts.py)."""

    kind: str = FULL_ATTENTION
    attention: AttentionSpec = AttentionSpec()
    experts: ExpertsSpec | None = None

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"layer kind {self.kind!r} is not supported; supported: {', '.join(LAYER_KINDS)}")
