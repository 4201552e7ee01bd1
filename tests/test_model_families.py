"""The families' shape (models/): each architecture maps to its family class, the class declares
its layers' kinds and variants, and the decoder builds exactly those blocks and caches. Parity of
every family's numbers with transformers is tests/test_parity_hf.py's."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from jaxinfer.config import SUPPORTED_ARCHITECTURES, ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.models import (
    LlamaForCausalLM,
    MixtralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    model_class,
)
from jaxinfer.models.layer_kinds import FULL_ATTENTION, LayerSpec

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
             head_dim=8)


def build(architecture: str, **flags):
    cfg = ModelConfig(architecture=architecture, **SHAPE, **flags)
    return model_class(architecture)(cfg, rngs=nnx.Rngs(0))


def test_every_supported_architecture_has_its_family_class():
    classes = {name: model_class(name) for name in SUPPORTED_ARCHITECTURES}
    assert classes == {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
                       "qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM}
    with pytest.raises(CheckpointError, match="unknown architecture 'gemma3'"):
        model_class("gemma3")


@pytest.mark.parametrize(("architecture", "flags", "bias", "qk_norm"), [
    ("llama", {}, False, False),
    ("llama", {"attention_bias": True}, True, False),
    ("qwen2", {"attention_bias": True}, True, False),
    ("qwen3", {"qk_norm": True}, False, True),
])
def test_the_family_builds_the_blocks_its_layer_specs_declare(architecture, flags, bias, qk_norm):
    model = build(architecture, **flags)
    assert model.layer_kinds == (FULL_ATTENTION,) * SHAPE["num_layers"]
    for spec, layer in zip(model.layer_specs, model.model.layers, strict=True):
        attention = layer.self_attn
        assert (spec.attention.qkv_bias, spec.attention.qk_norm) == (bias, qk_norm)
        assert (attention.q_proj.bias is not None, attention.k_proj.bias is not None) == (bias, bias)
        assert attention.o_proj.bias is None
        assert (attention.q_norm is not None, attention.k_norm is not None) == (qk_norm, qk_norm)


def test_a_llama_checkpoint_never_gets_the_qwen3_head_norm():
    assert build("llama", qk_norm=True).model.layers[0].self_attn.q_norm is None


def test_the_caches_are_made_per_layer_from_the_layer_kinds():
    model = build("qwen3", qk_norm=True)
    caches = model.empty_caches(num_pages=5, page_size=4)
    assert len(caches) == len(model.layer_kinds)
    shapes = {tuple(leaf.shape) for cache in caches for leaf in jax.tree.leaves(cache)}
    assert len(shapes) == 1 and 5 in next(iter(shapes))


def test_an_unknown_layer_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="layer kind 'sliding_attention' is not supported"):
        LayerSpec(kind="sliding_attention")
