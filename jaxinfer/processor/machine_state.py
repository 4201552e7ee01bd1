"""The machine's data: the state of every slot (``MachineState``), its scalar columns and their
packing into one array, an idle state to start from, and the record the machine fetches (``Record``).

State per slot: the scalars of ``SCALAR_FIELDS`` (pc, frame pointer, call depth, status, trap code,
fuel, instructions, memory pages and limits, branches, trace counters), a register file of (low,
high) uint32 words (globals and constants first, then frames), linear memory as bytes, and a trace
buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.machine_shape import MachineShape

U32 = jnp.uint32


class MachineState(NamedTuple):
    pc: jax.Array
    fp: jax.Array
    depth: jax.Array
    status: jax.Array
    trap: jax.Array
    fuel: jax.Array
    executed: jax.Array
    pages: jax.Array
    max_pages: jax.Array  # the module's maximum: growing past it gives -1, as the spec says
    page_limit: jax.Array  # the configured limit: growing past it (within the maximum) is a trap
    branches: jax.Array  # branches taken
    tracing: jax.Array  # 1: write a trace row per executed record (shape.trace_entries > 0)
    traced: jax.Array  # trace rows written
    registers: jax.Array  # [slots, registers + 1, 2] uint32; the last register absorbs non-writes
    memory: jax.Array  # [slots, memory bytes + 8] uint8; the 8 padding bytes are never in bounds
    trace: jax.Array  # [slots, trace_entries + 1, 4] int32 rows (pc, op, value low, value high); the last absorbs


SCALAR_FIELDS = MachineState._fields[:13]
SCALAR = {name: index for index, name in enumerate(SCALAR_FIELDS)}


def empty_state(shape: MachineShape, sharding: jax.sharding.Sharding | None = None) -> MachineState:
    """Every slot idle, placed with `sharding` when given (built on the devices: no host copy to send)."""
    def zeros(dims: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return jnp.zeros(dims, dtype, device=sharding)

    scalars = {name: zeros((shape.slots,), jnp.int32) for name in SCALAR_FIELDS}
    return MachineState(
        **scalars,
        registers=zeros((shape.slots, shape.registers + 1, 2), U32),
        memory=zeros((shape.slots, shape.memory_bytes + 8), jnp.uint8),
        trace=zeros((shape.slots, shape.trace_entries + 1, 4), jnp.int32),
    )


class Record(NamedTuple):
    op: jax.Array
    dst: jax.Array
    a: jax.Array
    b: jax.Array
    c: jax.Array
    imm: jax.Array
    imm2: jax.Array
    cost: jax.Array


def scalar_row(**values: int) -> np.ndarray:
    """One slot's scalars in ``SCALAR_FIELDS`` order (fields not given are 0)."""
    unknown = set(values) - set(SCALAR_FIELDS)
    if unknown:
        raise KeyError(f"not machine scalars: {sorted(unknown)}")
    return np.array([int(values.get(name, 0)) for name in SCALAR_FIELDS], np.int32)


def pack_scalars(state: MachineState) -> jax.Array:
    """The per-slot scalars as one [slots, 13] array: the loop updates them in one kernel, not thirteen."""
    return jnp.stack([getattr(state, name) for name in SCALAR_FIELDS], axis=1)


def unpack_scalars(scalars: jax.Array, registers: jax.Array, memory: jax.Array, trace: jax.Array) -> MachineState:
    return MachineState(*(scalars[:, column] for column in range(len(SCALAR_FIELDS))), registers, memory, trace)
