"""jaxinfer: an LLM inference engine in JAX/XLA.

    from jaxinfer import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
"""

from jaxinfer.xla_flags import prefer_memory_scheduling

prefer_memory_scheduling()  # before any backend starts (jaxinfer/xla_flags.py)

from jaxinfer.config import EngineConfig, ModelConfig  # noqa: E402
from jaxinfer.engine.params import RequestOutput, SamplingParams, Usage  # noqa: E402
from jaxinfer.errors import JaxinferError  # noqa: E402
from jaxinfer.llm import LLM  # noqa: E402

__all__ = ["LLM", "EngineConfig", "JaxinferError", "ModelConfig", "RequestOutput", "SamplingParams", "Usage"]
