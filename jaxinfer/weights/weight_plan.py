"""Which of a model's projections stay packed on the device, and in which format
(`engine.weights_dtype`, docs/models.md "Packed weights").

- `packed`: the checkpoint's own quantization is kept. A GGUF file's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K
  projections stay in their blocks (weights/packing.py), an orbax checkpoint's packed projections
  stay packed, and float checkpoints stay float.
- `auto`: `packed` on GPUs and TPUs. On the CPU a GGUF's projections are dequantized at load: XLA's
  CPU backend writes each dequantized weight out before its matmul, every step, which leaves SmolLM2
  packed at 0.76x float32's speed at batch 1 (docs/models.md, "Packed weights"). An orbax checkpoint
  stored packed stays packed everywhere.
- `int8` / `int4`: every projection of the layers is quantized at load, per group of
  `engine.weights_group` input rows (a quantized GGUF's projections are dequantized first).
- `float32` / `bfloat16`: every weight is dequantized at load into the engine's dtype (what the
  engine did before packed weights).

The packed weights are the layers' projections, a sparse layer's stacked experts, the embedding
table and an untied output head (`packable`); norms, biases and routers stay float in every mode. An
embedding is kept rows-first (layers/quant.py), so its arrays are the transpose of a kernel's; an
expert stack is each expert's kernel arrays stacked on a leading axis.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxinfer.errors import ConfigError
from jaxinfer.layers.quant import PackedFormat, load_format
from jaxinfer.models.decoder import EMBEDDING, OUTPUT_HEAD
from jaxinfer.weights.packing import PackedTensor, quantize_kernel, stack_experts

WEIGHTS_DTYPES = ("auto", "packed", "int8", "int4", "float32", "bfloat16")
WEIGHTS_GROUPS = (16, 32, 64, 128, 256)
PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.kernel$")
EXPERTS = re.compile(r"^model\.layers\.\d+\.\w+\.experts\.\w+$")  # stacked [experts, in, out]


def packable(name: str) -> bool:
    """Whether the parameter `name` may be kept packed: a projection, the embedding or the output head."""
    return bool(PROJECTION.match(name) or EXPERTS.match(name)) or name in (EMBEDDING, OUTPUT_HEAD)


@dataclass(frozen=True)
class WeightsChoice:
    """`engine.weights_dtype` and `engine.weights_group`, checked."""

    dtype: str = "auto"
    group: int = 32

    def __post_init__(self) -> None:
        if self.dtype not in WEIGHTS_DTYPES:
            raise ConfigError(f"engine.weights_dtype must be one of {', '.join(WEIGHTS_DTYPES)}, got {self.dtype!r}")
        if self.group not in WEIGHTS_GROUPS:
            raise ConfigError(f"engine.weights_group must be one of {', '.join(map(str, WEIGHTS_GROUPS))}, got "
                              f"{self.group!r}")

    @property
    def unpacked(self) -> bool:
        return self.dtype in ("float32", "bfloat16")

    @property
    def quantizes_at_load(self) -> bool:
        return self.dtype in ("int8", "int4")


    def keeps_checkpoint_packing(self, platform: str) -> bool:
        """Whether the checkpoint's own packed projections stay packed on `platform`."""
        return self.dtype == "packed" or (self.dtype == "auto" and platform != "cpu")


def load_time_formats(choice: WeightsChoice, projections: Iterable[str]) -> dict[str, PackedFormat]:
    """`int8` / `int4`: the format each packable weight (by parameter name) is quantized into."""
    fmt = load_format(8 if choice.dtype == "int8" else 4, choice.group)
    return {name: fmt for name in projections if packable(name)}


def packed_stream(tensors: Iterable[tuple[str, str, Any]], formats: dict[str, PackedFormat]
                  ) -> Iterator[tuple[str, str, Any]]:
    """A checkpoint's tensors with each packed weight split into its stored arrays (`kernel_q`,
    `kernel_scale`, `kernel_offset`; an embedding's `weight_*`, rows-first), quantizing a float one
    into its format on the way."""
    for name, tensor_name, array in tensors:
        fmt = formats.get(name)
        if fmt is None:
            yield name, tensor_name, array
            continue
        rows_first = name == EMBEDDING
        if not isinstance(array, PackedTensor):
            kernel = np.asarray(array, np.float32)
            if kernel.ndim == 3:  # stacked experts, each quantized as a kernel of its own
                array = stack_experts([quantize_kernel(expert, fmt, tensor_name) for expert in kernel])
            else:
                array = quantize_kernel(kernel.T if rows_first else kernel, fmt, tensor_name)
        elif array.fmt != fmt:
            raise ConfigError(f"{tensor_name}: packed as {array.fmt.name}, the model was built for {fmt.name}")
        for suffix, stored in (array.rows if rows_first else array.arrays).items():
            yield f"{name}_{suffix}", tensor_name, stored


def to_meta(formats: dict[str, PackedFormat]) -> dict[str, dict[str, Any]]:
    """The formats as an orbax checkpoint's metadata records them."""
    return {name: dataclasses.asdict(fmt) for name, fmt in formats.items()}


def from_meta(meta: dict[str, dict[str, Any]] | None) -> dict[str, PackedFormat]:
    return {name: PackedFormat(**fields) for name, fields in (meta or {}).items()}
