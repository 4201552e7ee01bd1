"""The attention backend registry: `engine.attention_backend` names -> backends, checked for the platform;
and `engine.packed_matmul`, the packed projections' matmul kernel, checked the same way.

It sits above the backends (`attention.ReferenceAttention`, `pallas_attention`, `ragged_attention`),
which share the metadata and helpers of `layers/attention.py` and never import this module.
"""

from __future__ import annotations

import jax

from jaxinfer.config import ATTENTION_BACKENDS
from jaxinfer.errors import ConfigError
from jaxinfer.layers.attention import AttentionBackend, ReferenceAttention
from jaxinfer.layers.basic import PackedMatmul

KERNEL_PLATFORMS = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}  # each kernel backend and where it compiles
AUTO_BACKEND = {platform: name for name, platform in KERNEL_PLATFORMS.items()}  # elsewhere: the reference


def backend_name(name: str, platform: str | None = None) -> str:
    """The backend a setting means here: ``auto`` picks the platform's Pallas kernel, else the reference."""
    if name != "auto":
        return name
    return AUTO_BACKEND.get(platform or jax.default_backend(), "reference")


KV_DTYPES = ("auto", "int8", "fp8")  # auto: the model's dtype


def make_backend(name: str, *, block_tokens: int, query_tile: int, model_parallel: int = 1,
                 platform: str | None = None, expert_parallel: int = 1, kv_dtype: str = "auto") -> AttentionBackend:
    """The backend for a replica whose mesh has `model_parallel` devices on its model axis (and
    `expert_parallel` on its expert axis), keeping KV pages in `kv_dtype`; only the reference backend
    runs beside an expert axis, and the TPU kernel reads no quantized pages yet."""
    platform = platform or jax.default_backend()
    name = backend_name(name, platform)
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"engine.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype != "auto" and name not in ("reference", "pallas_gpu"):
        raise ConfigError(f"engine.kv_dtype = {kv_dtype} is read by the reference and pallas_gpu attention backends "
                          f"only yet, and engine.attention_backend is {name}; use attention_backend = reference")
    if expert_parallel > 1 and name != "reference":
        raise ConfigError(f"engine.attention_backend = {name} beside engine.mesh_expert = {expert_parallel} is not "
                          "supported yet (its kernel runs in shard_map over the data and model axes only); use "
                          "attention_backend = reference")
    needed = KERNEL_PLATFORMS.get(name)
    if needed is not None and needed != platform:
        raise ConfigError(f"engine.attention_backend = {name} compiles only for {needed.upper()}s, and this "
                          f"platform is {platform} (use auto or reference; ragged_reference runs the TPU "
                          f"backend's layout anywhere)")
    if name == "reference":
        return ReferenceAttention(block_tokens=block_tokens, query_tile=query_tile, kv_dtype=kv_dtype)
    if name == "pallas_gpu":
        from jaxinfer.layers.pallas_attention import PallasGpuAttention

        return PallasGpuAttention(block_tokens=block_tokens, query_tile=query_tile, model_parallel=model_parallel,
                                  kv_dtype=kv_dtype)
    if name in ("pallas_tpu", "ragged_reference"):
        from jaxinfer.layers.ragged_attention import RaggedPagedAttention

        settings = dict(block_tokens=block_tokens, query_tile=query_tile, model_parallel=model_parallel)
        if name == "pallas_tpu":
            return RaggedPagedAttention.tpu_kernel(**settings)
        return RaggedPagedAttention.plain_jax(**settings)
    raise ValueError(f"unknown attention backend {name!r} (one of {', '.join(ATTENTION_BACKENDS)})")


PACKED_MATMULS = ("auto", "xla", "chunked", "pallas")


def make_packed_matmul(name: str, *, model_parallel: int = 1, expert_parallel: int = 1,
                       platform: str | None = None) -> PackedMatmul | None:
    """`engine.packed_matmul`: None for XLA's dequantize-and-dot, the CPU's chunked dequantize
    (layers/chunked_matmul.py; `auto` there), or the Pallas kernel of a GPU or TPU (one device per
    replica: the kernel is not split over a model axis yet)."""
    platform = platform or jax.default_backend()
    if name not in PACKED_MATMULS:
        raise ConfigError(f"engine.packed_matmul must be one of {', '.join(PACKED_MATMULS)}, got {name!r}")
    if name == "auto":
        name = "chunked" if platform == "cpu" else "xla"
    if name == "xla":
        return None
    if name == "chunked":
        from jaxinfer.layers.chunked_matmul import ChunkedMatmul

        return ChunkedMatmul()
    if platform not in ("gpu", "tpu"):
        raise ConfigError(f"engine.packed_matmul = pallas compiles only for GPUs and TPUs, and this platform is "
                          f"{platform}; use auto, xla or chunked")
    if model_parallel * expert_parallel > 1:
        raise ConfigError(f"engine.packed_matmul = pallas runs on one device per replica yet, and the mesh has "
                          f"{model_parallel} on its model axis and {expert_parallel} on its expert axis; use auto")
    from jaxinfer.layers.pallas_matmul import PallasPackedMatmul

    return PallasPackedMatmul(platform=platform)
