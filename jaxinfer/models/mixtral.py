"""The Mixtral family: Llama attention, and in every layer a sparse block (`block_sparse_moe`) of
experts w1 (gate), w3 (up), w2 (down), routed by softmax, top k, renormalised."""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.models.decoder import CausalLM
from jaxinfer.models.experts import ExpertsSpec
from jaxinfer.models.layer_kinds import AttentionSpec, LayerSpec


class MixtralForCausalLM(CausalLM):
    @staticmethod
    def layer_spec(cfg: ModelConfig, index: int) -> LayerSpec:
        moe = cfg.moe
        assert moe is not None, "a Mixtral config has experts (config.moe_from_hf)"
        experts = ExpertsSpec(module="block_sparse_moe", projections=("w1", "w3", "w2"), num_experts=moe.num_experts,
                              top_k=moe.top_k, width=moe.intermediate_size, renormalize=moe.renormalize)
        return LayerSpec(attention=AttentionSpec(qkv_bias=cfg.attention_bias),
                         experts=experts if index in moe.sparse_layers else None)
