"""Host side of packed weights: llama.cpp's quantized blocks repacked into the device layout
(layers/quant.py) without expanding them to floats, and float kernels quantized at load
(`engine.weights_dtype = "int8" | "int4"`).

A packed kernel travels from a checkpoint reader to `loader.fill` as a `PackedTensor`: its format
and its stored arrays rows-first, one row per output as GGUF stores them, named by the suffix of
their parameter (`q`, `scale`, `offset`). `arrays` turns them to a kernel's [in, out]; an embedding
table is kept rows-first and takes `rows` as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from jaxinfer.errors import ConfigError
from jaxinfer.layers.quant import Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, PackedFormat

GGML = gguf.GGMLQuantizationType
GGUF_FORMATS: dict[GGML, PackedFormat] = {GGML.Q8_0: Q8_0, GGML.Q4_0: Q4_0, GGML.Q4_1: Q4_1, GGML.Q4_K: Q4_K,
                                          GGML.Q6_K: Q6_K}
FLOAT_TYPES = (GGML.F32, GGML.F16, GGML.BF16)


@dataclass
class PackedTensor:
    """A kernel [fan_in, fan_out] in `fmt`: its stored arrays by parameter suffix, rows-first
    ([fan_out, ...])."""

    fmt: PackedFormat
    rows: dict[str, np.ndarray]
    fan_in: int
    fan_out: int

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """The stored arrays in a kernel's [in, out] orientation (a stack's: [experts, in, out])."""
        return {suffix: np.ascontiguousarray(np.swapaxes(stored, -1, -2)) for suffix, stored in self.rows.items()}


def stack_experts(kernels: list[PackedTensor]) -> PackedTensor:
    """One packed tensor of stacked experts from each expert's, in order (arrays [experts, out, ...])."""
    first = kernels[0]
    rows = {suffix: np.stack([kernel.rows[suffix] for kernel in kernels]) for suffix in first.rows}
    return PackedTensor(first.fmt, rows, first.fan_in, first.fan_out)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _pack_nibbles(values: np.ndarray, group: int) -> np.ndarray:
    """values [rows, fan_in] in 0..15 -> bytes [rows, fan_in / 2]: in each group, the first half in the
    low nibbles and the second half in the high nibbles."""
    rows, fan_in = values.shape
    split = values.astype(np.uint8).reshape(rows, fan_in // group, 2, group // 2)
    return (split[:, :, 0] | (split[:, :, 1] << 4)).reshape(rows, fan_in // 2)


def _oriented(fmt: PackedFormat, q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> PackedTensor:
    """Rows-first arrays ([out, ...], as GGUF stores them), the scales in the format's dtype."""
    fan_out = q.shape[0]
    fan_in = q.shape[1] * (2 if fmt.bits == 4 else 1)
    rows = {"q": np.ascontiguousarray(q), "scale": np.ascontiguousarray(scale.astype(fmt.scale_dtype))}
    if offset is not None:
        rows["offset"] = np.ascontiguousarray(offset.astype(fmt.scale_dtype))
    return PackedTensor(fmt, rows, fan_in, fan_out)


def repack_gguf(raw: np.ndarray, qtype: GGML, fan_out: int, fan_in: int) -> PackedTensor:
    """A GGUF tensor's raw blocks (rows of `fan_in` values, one row per output) in the device layout."""
    fmt = GGUF_FORMATS[qtype]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw).reshape(fan_out, fan_in // block, size)
    if qtype == GGML.Q8_0:
        return _oriented(fmt, blocks[..., 2:].view(np.int8).reshape(fan_out, fan_in), _f16(blocks[..., :2]), None)
    if qtype == GGML.Q4_0:
        return _oriented(fmt, blocks[..., 2:].reshape(fan_out, fan_in // 2), _f16(blocks[..., :2]), None)
    if qtype == GGML.Q4_1:
        return _oriented(fmt, blocks[..., 4:].reshape(fan_out, fan_in // 2), _f16(blocks[..., :2]),
                         _f16(blocks[..., 2:4]))
    if qtype == GGML.Q4_K:
        return _repack_q4_k(fmt, blocks, fan_out, fan_in)
    return _repack_q6_k(fmt, blocks, fan_out, fan_in)


def _repack_q4_k(fmt: PackedFormat, blocks: np.ndarray, fan_out: int, fan_in: int) -> PackedTensor:
    """Super-blocks of 256: per 32-value sub-block a 6-bit scale and min times the block's d and dmin;
    the values of sub-blocks 2c and 2c+1 share 32 bytes (low and high nibbles)."""
    flat = blocks.reshape(-1, blocks.shape[-1])
    d, dmin = _f16(flat[:, :2]).astype(np.float32), _f16(flat[:, 2:4]).astype(np.float32)
    sc, mins = gguf.quants.Q4_K.get_scale_min(flat[:, 4:16])
    scale = (d[:, None] * sc.astype(np.float32)).reshape(fan_out, fan_in // 32)
    offset = -(dmin[:, None] * mins.astype(np.float32)).reshape(fan_out, fan_in // 32)
    qs = flat[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    values = (qs & 0xF).reshape(fan_out, fan_in)
    return _oriented(fmt, _pack_nibbles(values, 32), scale, offset)


def _repack_q6_k(fmt: PackedFormat, blocks: np.ndarray, fan_out: int, fan_in: int) -> PackedTensor:
    """Super-blocks of 256: 6-bit values (4 low bits in `ql`, 2 high in `qh`, minus 32) and an int8
    scale per 16 values times the block's d."""
    flat = blocks.reshape(-1, blocks.shape[-1])
    ql = flat[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    qh = flat[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    values = ((ql & 0xF).reshape(-1, 8, 32) | ((qh & 0x3).reshape(-1, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    scales = flat[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(flat[:, 208:210]).astype(np.float32)
    scale = (d[:, None] * scales).reshape(fan_out, fan_in // 16)
    return _oriented(fmt, values.reshape(fan_out, fan_in), scale, None)


def quantize_kernel(kernel: np.ndarray, fmt: PackedFormat, name: str) -> PackedTensor:
    """A float kernel [in, out] quantized symmetrically per group of `fmt.group` input rows: 8-bit
    values in -127..127, or 4-bit ones in -8..7 stored with zero point 8; float16 scales."""
    fan_in, fan_out = kernel.shape
    if fan_in % fmt.group:
        raise ConfigError(f"engine.weights_group = {fmt.group} does not divide the {fan_in} input rows of {name}")
    groups = np.asarray(kernel, np.float32).T.reshape(fan_out, fan_in // fmt.group, fmt.group)
    top = 127 if fmt.bits == 8 else 7
    scale = (np.abs(groups).max(axis=-1) / top).astype(np.float16)
    scale[scale == 0] = 1  # an all-zero group: any scale gives zeros
    values = np.clip(np.rint(groups / scale.astype(np.float32)[..., None]), -top - (fmt.bits == 4), top)
    values = values.reshape(fan_out, fan_in)
    if fmt.bits == 8:
        return _oriented(fmt, values.astype(np.int8), scale, None)
    return _oriented(fmt, _pack_nibbles(values + fmt.zero, fmt.group), scale, None)
