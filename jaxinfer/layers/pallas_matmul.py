"""x @ W for a packed kernel W (layers/quant.py) as one Pallas kernel (Triton on GPUs, Mosaic on TPUs):
each program dequantizes one column strip of W a block of input rows at a time, in registers / VMEM,
so no float copy of W exists in device memory at any point (the XLA path relies on XLA fusing the
dequantize into the dot, which the CPU backend does not do; docs/models.md).

One program per (`block_m` rows of x, `block_n` columns of W) walks the input dimension in blocks of
`block_k` rows. A 4-bit block's stored rows hold two input rows each (llama.cpp's order: the low
nibbles are the first half of each group, the high nibbles the second half), so instead of
interleaving the nibbles back into rows the kernel takes x split the same way (`split_halves`, a
cheap reshape of the activations outside the kernel) and runs two dots per block:
`x_low @ low_values + x_high @ high_values`. Scales (and offsets) are widened from one per group to
one per stored row in the kernel. Values are dequantized in float32 and cast to x's dtype before the
dot (the XLA path's rounding); products accumulate in float32.

With `interpret=True` the kernel runs through Pallas's interpreter (the CPU tests). Shapes the
blocks cannot tile exactly (`fits` is False) take the XLA path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pl_tpu
from jax.experimental.pallas import triton as pl_triton

from jaxinfer.layers.quant import PackedFormat

PLATFORMS = ("gpu", "tpu")
MIN_DOT = 16  # Triton's tensor-core dot: at least 16 along every dimension


def _power_of_two_divisor(size: int, multiple_of: int, most: int) -> int | None:
    """The largest power of two <= `most` that divides `size` and is a multiple of `multiple_of`."""
    block = 1 << (most.bit_length() - 1)
    while block >= multiple_of:
        if size % block == 0 and block % multiple_of == 0:
            return block
        block //= 2
    return None


def _aligned_divisor(size: int, align: int, most: int) -> int | None:
    """The largest multiple of `align` <= `most` that divides `size`; else `size` itself where it is
    at most twice `most` (a block may always span a whole dimension)."""
    for block in range(most - most % align, 0, -align):
        if size % block == 0:
            return block
    return size if size <= 2 * most else None


def _stored_rows(fmt: PackedFormat, block_k: int) -> int:
    return block_k // 2 if fmt.bits == 4 else block_k


@dataclasses.dataclass(frozen=True)
class PackedMatmulBlocks:
    """The kernel's tiling of one [M, K] @ [K, N] product."""

    m: int
    n: int
    k: int


@dataclasses.dataclass(frozen=True)
class PallasPackedMatmul:
    """`engine.packed_matmul = "pallas"`: packed projections multiply through this kernel."""

    platform: str = "gpu"  # which lowering the block sizes are chosen for: gpu (Triton) or tpu (Mosaic)
    interpret: bool = False

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"packed matmul platform {self.platform!r}; choose from {', '.join(PLATFORMS)}")

    def blocks(self, fmt: PackedFormat, rows: int, fan_in: int, fan_out: int) -> PackedMatmulBlocks | None:
        """Block sizes for x [rows, fan_in] @ W [fan_in, fan_out], or None where they cannot tile W."""
        if self.platform == "gpu":  # Triton: power-of-two blocks of at least 16
            block_n = _power_of_two_divisor(fan_out, MIN_DOT, 128)
            block_k = _power_of_two_divisor(fan_in, max(fmt.group, 2 * MIN_DOT), 128)
            block_m = min(64, max(MIN_DOT, pl.next_power_of_2(rows)))
        else:  # Mosaic: lane-dense columns; stored rows and group rows in whole sublane tiles
            block_n = _aligned_divisor(fan_out, 128, 512)
            block_k = _aligned_divisor(fan_in, 16 * fmt.group, 4096)
            block_m = min(128, max(16, pl.next_power_of_2(rows)))
        if block_n is None or block_k is None:
            return None
        return PackedMatmulBlocks(block_m, block_n, block_k)

    def fits(self, fmt: PackedFormat, fan_in: int, fan_out: int) -> bool:
        return self.blocks(fmt, 1, fan_in, fan_out) is not None

    def __call__(self, x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array | None,
                 fmt: PackedFormat) -> jax.Array:
        """x [M, K] @ the packed [K, N] kernel -> [M, N] float32."""
        rows, fan_in = x.shape
        fan_out = q.shape[1]
        blocks = self.blocks(fmt, rows, fan_in, fan_out)
        if blocks is None:
            raise ValueError(f"packed matmul: a [{fan_in}, {fan_out}] {fmt.name} kernel does not tile "
                             f"({self.platform})")
        padded_rows = -(-rows // blocks.m) * blocks.m
        halves = split_halves(jnp.pad(x, ((0, padded_rows - rows), (0, 0))), fmt)
        stored = [q, scale] + ([offset] if fmt.offset else [])
        x_spec = pl.BlockSpec((blocks.m, halves[0].shape[1]), lambda i, j: (i, 0))
        strip_specs = [pl.BlockSpec((a.shape[0], blocks.n), lambda i, j: (0, j)) for a in stored]
        out = pl.pallas_call(
            functools.partial(_kernel, fmt=fmt, block_k=blocks.k, steps=fan_in // blocks.k, dtype=x.dtype),
            grid=(padded_rows // blocks.m, fan_out // blocks.n),
            in_specs=[x_spec] * len(halves) + strip_specs,
            out_specs=pl.BlockSpec((blocks.m, blocks.n), lambda i, j: (i, j)),
            out_shape=jax.ShapeDtypeStruct((padded_rows, fan_out), jnp.float32),
            interpret=self.interpret,
            compiler_params=self._compiler_params(),
            name="jaxinfer_packed_matmul",
        )(*halves, *stored)
        return out[:rows]

    def _compiler_params(self):
        if self.platform == "gpu":
            return pl_triton.CompilerParams(num_warps=4, num_stages=2)
        return pl_tpu.CompilerParams(dimension_semantics=("parallel", "parallel"))


def split_halves(x: jax.Array, fmt: PackedFormat) -> tuple[jax.Array, ...]:
    """x [M, K] as the stored rows of a 4-bit kernel pair with it: (the first half of each group's
    columns, the second half), each [M, K / 2]; an 8-bit kernel's rows are x's columns as they are."""
    if fmt.bits == 8:
        return (x,)
    rows, fan_in = x.shape
    grouped = x.reshape(rows, fan_in // fmt.group, 2, fmt.group // 2)
    return grouped[:, :, 0].reshape(rows, fan_in // 2), grouped[:, :, 1].reshape(rows, fan_in // 2)


def _kernel(*refs, fmt: PackedFormat, block_k: int, steps: int, dtype: jnp.dtype) -> None:
    x_refs = refs[:2] if fmt.bits == 4 else refs[:1]
    q_ref, scale_ref, *rest = refs[len(x_refs):]
    offset_ref, out_ref = (rest[0], rest[1]) if fmt.offset else (None, rest[0])
    rows = _stored_rows(fmt, block_k)
    groups = block_k // fmt.group
    columns = out_ref.shape[1]

    def per_row(ref, step: jax.Array) -> jax.Array:
        """The block's per-group values [groups, N] widened to one per stored row [rows, N]."""
        values = ref[pl.ds(step * groups, groups), :].astype(jnp.float32)
        return jnp.broadcast_to(values[:, None, :], (groups, rows // groups, columns)).reshape(rows, columns)

    def body(step: jax.Array, acc: jax.Array) -> jax.Array:
        stored = q_ref[pl.ds(step * rows, rows), :]
        scale = per_row(scale_ref, step)
        offset = per_row(offset_ref, step) if offset_ref is not None else None

        def dequantized(values: jax.Array) -> jax.Array:
            values = values.astype(jnp.float32)
            if fmt.zero:
                values = values - fmt.zero
            weights = values * scale
            return (weights if offset is None else weights + offset).astype(dtype)

        parts = (stored,) if fmt.bits == 8 else (stored & 0xF, stored >> 4)
        for x_ref, values in zip(x_refs, parts, strict=True):
            acc = acc + jnp.dot(x_ref[:, pl.ds(step * rows, rows)], dequantized(values),
                                preferred_element_type=jnp.float32)
        return acc

    out_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros(out_ref.shape, jnp.float32))
