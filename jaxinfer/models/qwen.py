"""The Qwen families: Qwen2/2.5 (the Llama layer with a bias on the q/k/v projections), Qwen3
(an RMSNorm on each head's queries and keys before RoPE, no bias unless the checkpoint has one) and
Qwen3-MoE (Qwen3's attention; sparse experts in `mlp` on the layers its config names)."""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import CausalLM
from jaxinfer.models.experts import ExpertsSpec
from jaxinfer.models.layer_kinds import AttentionSpec, LayerSpec


class Qwen2ForCausalLM(CausalLM):
    @staticmethod
    def layer_spec(cfg: ModelConfig, index: int) -> LayerSpec:
        return LayerSpec(attention=AttentionSpec(qkv_bias=cfg.attention_bias))


class Qwen3ForCausalLM(CausalLM):
    @staticmethod
    def layer_spec(cfg: ModelConfig, index: int) -> LayerSpec:
        return LayerSpec(attention=AttentionSpec(qkv_bias=cfg.attention_bias, qk_norm=cfg.qk_norm))


class Qwen3MoeForCausalLM(CausalLM):
    @staticmethod
    def layer_spec(cfg: ModelConfig, index: int) -> LayerSpec:
        moe = cfg.moe
        assert moe is not None, "a Qwen3-MoE config has experts (config.moe_from_hf)"
        experts = ExpertsSpec(module="mlp", projections=("gate_proj", "up_proj", "down_proj"),
                              num_experts=moe.num_experts, top_k=moe.top_k, width=moe.intermediate_size,
                              renormalize=moe.renormalize)
        return LayerSpec(attention=AttentionSpec(qkv_bias=cfg.attention_bias, qk_norm=cfg.qk_norm),
                         experts=experts if index in moe.sparse_layers else None)
