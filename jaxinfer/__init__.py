"""jaxinfer: an LLM inference engine in JAX/XLA.

    from jaxinfer import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
"""

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.params import RequestOutput, SamplingParams, Usage
from jaxinfer.errors import JaxinferError
from jaxinfer.llm import LLM

__all__ = ["LLM", "EngineConfig", "JaxinferError", "ModelConfig", "RequestOutput", "SamplingParams", "Usage"]
