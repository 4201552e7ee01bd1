"""The Llama family (Llama 3.x, SmolLM2, Mistral without a reached window): every layer full
attention with the gated SiLU MLP; a bias on the q/k/v projections where the checkpoint has one."""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import CausalLM
from jaxinfer.models.layer_kinds import AttentionSpec, LayerSpec


class LlamaForCausalLM(CausalLM):
    @staticmethod
    def layer_spec(cfg: ModelConfig, index: int) -> LayerSpec:
        return LayerSpec(attention=AttentionSpec(qkv_bias=cfg.attention_bias))
