"""The Qwen families: Qwen2/2.5 (the Llama layer with a bias on the q/k/v projections) and Qwen3
(an RMSNorm on each head's queries and keys before RoPE, no bias unless the checkpoint has one)."""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import CausalLM
from jaxinfer.models.layer_kinds import AttentionSpec, LayerSpec


class Qwen2ForCausalLM(CausalLM):
    @staticmethod
    def layer_spec(cfg: ModelConfig, index: int) -> LayerSpec:
        return LayerSpec(attention=AttentionSpec(qkv_bias=cfg.attention_bias))


class Qwen3ForCausalLM(CausalLM):
    @staticmethod
    def layer_spec(cfg: ModelConfig, index: int) -> LayerSpec:
        return LayerSpec(attention=AttentionSpec(qkv_bias=cfg.attention_bias, qk_norm=cfg.qk_norm))
