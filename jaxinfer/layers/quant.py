"""Packed weights on the device: the formats a projection's kernel can be kept in, and their
dequantization inside the jitted matmul (the float weight exists only as a value of the step's
computation, never as a stored array).

A packed kernel of shape [in, out] is stored in groups of `group` consecutive input rows:
- `q`: 8-bit signed values [in, out] (int8), or 4-bit values packed two to a byte [in / 2, out]
  (uint8): in each group the first half of the rows sit in the low nibbles, the second half in the
  high nibbles (llama.cpp's Q4_0 / Q4_1 block order, so those blocks copy over unchanged);
- `scale`: one per group and output column [in / group, out] (float16 where the source's scales
  are float16, else float32);
- `offset` (formats that have one): added per group, [in / group, out].

An embedding table [vocab, embed] is kept rows-first: the same arrays transposed ([vocab, embed / 2]
values, [vocab, embed / group] scales), so a token's row is one contiguous read (`dequantize_rows`).

A value is `scale * (q - zero)` or `scale * q + offset`, computed in float32 in the order llama.cpp
(and the `gguf` package) uses, so the dequantized weight equals the `gguf` package's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class PackedFormat:
    """How one kernel is packed: `bits` per value (4 or 8), values per scale (`group`), a zero point
    subtracted before scaling (`zero`), an additive per-group `offset`, and the scales' dtype."""

    name: str
    bits: int
    group: int
    zero: int = 0
    offset: bool = False
    scale_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or self.group <= 0 or self.group % 2:
            raise ValueError(f"packed format {self.name}: bits must be 4 or 8 and the group even, got "
                             f"{self.bits} bits, group {self.group}")

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The stored arrays' parameter-name suffixes."""
        return ("q", "scale", "offset") if self.offset else ("q", "scale")

    def stored_shapes(self, fan_in: int, fan_out: int) -> dict[str, tuple[int, int]]:
        """The arrays a [fan_in, fan_out] kernel is stored as, by the suffix of their parameter name."""
        rows = fan_in // 2 if self.bits == 4 else fan_in
        shapes = {"q": (rows, fan_out), "scale": (fan_in // self.group, fan_out)}
        if self.offset:
            shapes["offset"] = shapes["scale"]
        return shapes

    def bits_per_weight(self) -> float:
        scale_bits = 16 if self.scale_dtype == "float16" else 32
        return self.bits + scale_bits * (2 if self.offset else 1) / self.group


# llama.cpp's block formats (weights/packing.py repacks their blocks) and the ones quantized at load
Q8_0 = PackedFormat("q8_0", bits=8, group=32)
Q4_0 = PackedFormat("q4_0", bits=4, group=32, zero=8)
Q4_1 = PackedFormat("q4_1", bits=4, group=32, offset=True)
Q4_K = PackedFormat("q4_k", bits=4, group=32, offset=True, scale_dtype="float32")
Q6_K = PackedFormat("q6_k", bits=8, group=16, scale_dtype="float32")


def load_format(bits: int, group: int) -> PackedFormat:
    """The format `weights_dtype = "int8" | "int4"` quantizes a float kernel into (symmetric)."""
    return PackedFormat(f"int{bits}_g{group}", bits=bits, group=group, zero=0 if bits == 8 else 8)


def unpack_values(q: jax.Array, fmt: PackedFormat) -> jax.Array:
    """The stored values as int32 [in, out] (4-bit: nibbles back in their rows' order)."""
    if fmt.bits == 8:
        return q.astype(jnp.int32)
    rows, cols = q.shape
    half = fmt.group // 2
    blocks = q.reshape(rows // half, half, cols)
    low, high = (blocks & 0xF).astype(jnp.int32), (blocks >> 4).astype(jnp.int32)
    return jnp.concatenate([low, high], axis=1).reshape(2 * rows, cols)


def dequantize(q: jax.Array, scale: jax.Array, offset: jax.Array | None, fmt: PackedFormat,
               dtype: jnp.dtype) -> jax.Array:
    """The kernel [in, out] in `dtype`, as the `gguf` package computes it (float32, then cast)."""
    values = unpack_values(q, fmt)
    fan_in, fan_out = values.shape
    grouped = values.reshape(fan_in // fmt.group, fmt.group, fan_out)
    if fmt.zero:
        grouped = grouped - fmt.zero
    weights = grouped.astype(jnp.float32) * scale.astype(jnp.float32)[:, None, :]
    if offset is not None:
        weights = weights + offset.astype(jnp.float32)[:, None, :]
    return weights.reshape(fan_in, fan_out).astype(dtype)


def dequantize_rows(q: jax.Array, scale: jax.Array, offset: jax.Array | None, fmt: PackedFormat,
                    dtype: jnp.dtype) -> jax.Array:
    """Rows-first packed rows ([rows, values / 2] or [rows, values], groups along each row: an
    embedding table's) as [rows, values] in `dtype`."""
    return dequantize(q.T, scale.T, None if offset is None else offset.T, fmt, dtype).T


def stored_dtype(fmt: PackedFormat, suffix: str) -> jnp.dtype:
    """The dtype of a packed kernel's stored array `suffix` (`q`, `scale` or `offset`)."""
    if suffix == "q":
        return jnp.int8 if fmt.bits == 8 else jnp.uint8
    return jnp.dtype(fmt.scale_dtype)
