"""x @ W for a packed W on the CPU: dequantized a chunk of output columns at a time
(`engine.packed_matmul = "auto"` there; layers/pallas_matmul.py is the GPU/TPU kernel).

XLA's CPU backend does not fuse a dequantization into its dot: it writes the float weight out and
the dot reads it back. For a large weight that temporary costs more than the arithmetic: SmolLM2's
tied output head (49,152 x 576, Q8_0) dequantized whole takes 63 ms a step on 2 cores and 113 MB of
temporary memory, where the float dot alone takes 3 ms; in 32 chunks of 1,536 rows it takes 16 ms and
3.5 MB. Each output column is the same dot product as with the whole weight (the dot's blocking may
order its sums differently); only the float weight's peak in memory changes. With XLA's CPU scheduler
ordering for memory (jaxinfer/xla_flags.py) a step then holds one chunk of float weight at a time.

A weight of at most `chunk_bytes` as floats is dequantized whole (a loop would only add overhead).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.layers.quant import PackedFormat, dequantize, dequantize_rows

CHUNK_BYTES = 4 << 20


def chunk_count(columns: int, rows: int, chunk_bytes: int) -> int:
    """Chunks of whole columns of a float32 [rows, columns] weight: the fewest that divide the columns
    evenly with at most `chunk_bytes` each (1: dequantize whole; also where no divisor comes close)."""
    wanted = -(-columns * rows * 4 // chunk_bytes)
    if wanted <= 1:
        return 1
    for count in range(wanted, min(columns, 4 * wanted) + 1):
        if columns % count == 0:
            return count
    return 1


@dataclasses.dataclass(frozen=True)
class ChunkedMatmul:
    """The CPU's packed matmul: `__call__` for a kernel [in, out], `rows_first` for an embedding
    table [vocab, embed] used as the output head."""

    chunk_bytes: int = CHUNK_BYTES

    def fits(self, fmt: PackedFormat, fan_in: int, fan_out: int) -> bool:
        return True

    def __call__(self, x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array | None,
                 fmt: PackedFormat) -> jax.Array:
        """x [M, K] @ the packed [K, N] kernel -> [M, N] float32, a chunk of columns at a time."""
        count = chunk_count(q.shape[1], x.shape[1], self.chunk_bytes)
        if count == 1:
            return jnp.dot(x, dequantize(q, scale, offset, fmt, x.dtype), preferred_element_type=jnp.float32)
        width = q.shape[1] // count

        def one_chunk(index: jax.Array) -> jax.Array:
            part = [None if a is None else jax.lax.dynamic_slice_in_dim(a, index * width, width, axis=1)
                    for a in (q, scale, offset)]
            return jnp.dot(x, dequantize(*part, fmt, x.dtype), preferred_element_type=jnp.float32)

        return _columns(jax.lax.map(one_chunk, jnp.arange(count)))

    def rows_first(self, x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array | None,
                   fmt: PackedFormat) -> jax.Array:
        """x [M, embed] @ the rows-first table [vocab, embed]'s transpose -> [M, vocab] float32."""
        count = chunk_count(q.shape[0], x.shape[1], self.chunk_bytes)
        chunks = [None if a is None else a.reshape(count, a.shape[0] // count, a.shape[1]) for a in (q, scale, offset)]

        def one_chunk(part: tuple) -> jax.Array:
            return jnp.dot(x, dequantize_rows(*part, fmt, x.dtype).T, preferred_element_type=jnp.float32)

        return _columns(jax.lax.map(one_chunk, tuple(chunks)))


def _columns(chunks: jax.Array) -> jax.Array:
    """[chunks, M, width] -> [M, chunks * width]."""
    count, rows, width = chunks.shape
    return chunks.transpose(1, 0, 2).reshape(rows, count * width)
