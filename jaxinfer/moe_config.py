"""The mixture-of-experts part of a model's config: how many experts, how many each token uses,
their width, how the router's top scores are weighted, and which layers have experts.

Read from a Hugging Face `config.json` for the families that have experts (Qwen3-MoE, Mixtral) and
kept as `ModelConfig.moe`; a dense model has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxinfer.errors import ConfigError


@dataclass(frozen=True)
class MoEConfig:
    """Experts of the sparse layers. Routing is softmax over every expert's router logit, then the
    `top_k` best; `renormalize` divides their weights by their sum (Mixtral always does, Qwen3-MoE
    where `norm_topk_prob` says so). Layers not in `sparse_layers` keep the dense MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: tuple[int, ...]
    renormalize: bool = True

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"moe.{name} must be a positive whole number, got {value!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.top_k}) exceeds the number of experts ({self.num_experts})")

    @property
    def params_per_layer(self) -> int:
        """Weights of one sparse layer given its hidden size 1 (multiply by hidden): router and experts."""
        return self.num_experts * (1 + 3 * self.intermediate_size)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> MoEConfig | None:
        if not data:
            return None
        return cls(**{**data, "sparse_layers": tuple(data["sparse_layers"])})


def moe_from_hf(hf: dict[str, Any], model_type: str, num_layers: int) -> MoEConfig | None:
    """The experts a `config.json` of `model_type` declares (None for a dense family)."""
    if model_type == "mixtral":
        return MoEConfig(num_experts=int(hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]),
                         intermediate_size=int(hf["intermediate_size"]), sparse_layers=tuple(range(num_layers)))
    if model_type != "qwen3_moe":
        return None
    if hf.get("shared_expert_intermediate_size"):
        raise ConfigError("shared_expert_intermediate_size: shared experts (Qwen2-MoE) are not supported yet")
    step = int(hf.get("decoder_sparse_step", 1))
    if step <= 0:
        raise ConfigError(f"decoder_sparse_step must be positive, got {step}")
    dense = {int(i) for i in hf.get("mlp_only_layers") or ()}
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 writes the second
    if experts is None:
        raise KeyError("num_experts")
    return MoEConfig(num_experts=int(experts), top_k=int(hf["num_experts_per_tok"]),
                     intermediate_size=int(hf["moe_intermediate_size"]), sparse_layers=sparse,
                     renormalize=bool(hf.get("norm_topk_prob", False)))
