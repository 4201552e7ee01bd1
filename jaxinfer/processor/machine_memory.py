"""Loads and stores: where a record's access goes and whether it is in bounds, a load's value from
the bytes at its address, the bytes a store writes, and both over all slots at once (``memory_access``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.machine_shape import PAGE_BYTES
from jaxinfer.processor import alu
from jaxinfer.processor.isa import LOAD_SIGNED, LOAD_WIDE, Op
from jaxinfer.processor.machine_state import MachineState, Record

U32 = jnp.uint32


class Access(NamedTuple):
    """Where a record's load or store goes: the access kind and width, the byte address (0 for
    none or out of bounds) and whether it is out of bounds."""

    is_load: jax.Array
    is_store: jax.Array
    width: jax.Array
    address: jax.Array
    out_of_bounds: jax.Array


def access(state: MachineState, record: Record, x: alu.Pair) -> Access:
    is_load, is_store = record.op == Op.LOAD, record.op == Op.STORE
    width = jnp.where(is_load, record.imm2 & 15, jnp.where(is_store, record.imm2, 0))
    address = x[0] + alu.as_unsigned(record.imm)
    wrapped = address < x[0]
    limit = (state.pages * PAGE_BYTES).astype(U32)
    out_of_bounds = (is_load | is_store) & (wrapped | (address > limit - width.astype(U32)) | (limit < width))
    address = jnp.where(out_of_bounds | ~(is_load | is_store), U32(0), address).astype(jnp.int32)
    return Access(is_load, is_store, width, address, out_of_bounds)


LANES = 8  # bytes a load reads and a store writes from its address (the widest access)


def assemble_load(window: jax.Array, width: jax.Array, kind: jax.Array) -> alu.Pair:
    """A load's value from the bytes at its address (``window`` [..., 8], uint32): the first ``width``
    of them, little-endian, sign-extended when ``kind`` (LOAD's imm2) says so, the high word for i64
    loads. Lanes combine by sums of disjoint bits, which Triton lowers and XLA vectorizes."""
    lanes = jnp.arange(LANES, dtype=jnp.int32)
    raw = jnp.where(lanes < width[..., None], window, U32(0))
    shifted = raw << (U32(8) * (lanes % 4).astype(U32))
    low = jnp.sum(jnp.where(lanes < 4, shifted, U32(0)), axis=-1, dtype=U32)
    high = jnp.sum(jnp.where(lanes >= 4, shifted, U32(0)), axis=-1, dtype=U32)
    top_byte = jnp.sum(jnp.where(lanes == width[..., None] - 1, raw, U32(0)), axis=-1, dtype=U32)
    extend = ((kind & LOAD_SIGNED) != 0) & ((top_byte >> 7) == 1)
    bits = (width * 8).astype(U32)
    low = jnp.where(extend & (bits < 32), low | alu.shift_left_word(U32(0xFFFFFFFF), bits), low)
    high = jnp.where(extend, jnp.where(bits <= 32, U32(0xFFFFFFFF), high | alu.shift_left_word(
        U32(0xFFFFFFFF), bits - 32)), high)
    return low, jnp.where((kind & LOAD_WIDE) != 0, high, U32(0))


def store_bytes(y: alu.Pair) -> jax.Array:
    """The bytes [..., 8] (uint8) a store of ``y`` writes from its address, of which it keeps its width."""
    lanes = jnp.arange(LANES, dtype=jnp.int32)
    word = jnp.where(lanes < 4, y[0][..., None], y[1][..., None])
    return ((word >> (U32(8) * (lanes % 4).astype(U32))) & U32(0xFF)).astype(jnp.uint8)


def memory_access(state: MachineState, record: Record, x: alu.Pair, y: alu.Pair, executing: jax.Array):
    """Loads and stores over all slots: the loaded value, the store's pending write (address, 8-byte
    window), and whether the access was out of bounds."""
    where = access(state, record, x)
    lanes = jnp.arange(LANES, dtype=jnp.int32)
    old = jnp.take_along_axis(state.memory, where.address[:, None] + lanes[None, :], axis=1)
    loaded = assemble_load(old.astype(U32), where.width, record.imm2)
    stored = store_bytes(y)
    in_width = lanes[None, :] < where.width[:, None]
    writing = (where.is_store & executing & ~where.out_of_bounds)[:, None] & in_width
    return loaded, (where.address, jnp.where(writing, stored, old)), where.out_of_bounds
