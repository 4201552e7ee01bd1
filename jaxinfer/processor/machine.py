"""The jitted machine: advances every running slot by one micro-op per iteration, on device.

State per slot (``MachineState``): the scalars of ``SCALAR_FIELDS`` (pc, frame pointer, call depth,
status, trap code, fuel, instructions, memory pages and limits, branches, trace counters), a
register file of (low, high) uint32 words (globals and constants first, then frames), linear memory
as bytes, and a trace buffer. ``loops.advance`` runs a ``lax.while_loop``
of at most ``steps`` iterations of ``step``; each iteration executes one record for every running slot with
branch-free code, so slots running different programs share one loop. The only real branch is
64-bit division, taken when some slot divides. The engine calls ``advance`` inside its jitted step
with a small ``steps``; the host API calls it with a large one.

On the CPU the loop is compiled as a single kernel (``loops._advance_one_kernel``); on accelerators, or
with ``MachineShape.loop == "while"``, it is a plain ``lax.while_loop``; with ``loop == "pallas"`` it
is the Pallas GPU kernel of ``gpu_kernel.py``. Every form runs each record through ``execute``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.machine_shape import PAGE_BYTES, MachineShape
from jaxinfer.processor import alu
from jaxinfer.processor.isa import ABSOLUTE, FIELD, LOAD_SIGNED, LOAD_WIDE, NO_WRITE, Op, Status, Trap

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


def _fetch(code: jax.Array, pc: jax.Array) -> Record:
    record = jnp.take_along_axis(code, pc[:, None, None], axis=1)[:, 0, :]
    return Record(*(record[:, FIELD[name]] for name in Record._fields))


def operand_address(fp: jax.Array, operand: jax.Array) -> jax.Array:
    """A record's register operand: frame-relative, or absolute from ABSOLUTE up (globals, constants)."""
    return jnp.where(operand >= ABSOLUTE, operand - ABSOLUTE, fp + operand)


def _read(registers: jax.Array, index: jax.Array) -> alu.Pair:
    pair = jnp.take_along_axis(registers, index[:, None, None], axis=1)[:, 0, :]
    return pair[:, 0], pair[:, 1]


def _i32_results(x: alu.Pair, y: alu.Pair) -> dict[Op, jax.Array]:
    a, b = x[0], y[0]
    sa, sb = alu.as_signed(a), alu.as_signed(b)
    division = alu.divide32(a, b)
    shift = b & U32(31)
    return {
        Op.I32_EQZ: alu.flag(a == 0), Op.I32_CLZ: lax.clz(a), Op.I32_CTZ: alu.count_trailing_zeros(a),
        Op.I32_POPCNT: lax.population_count(a), Op.I32_EXT8: alu.sign_extend(a, 8),
        Op.I32_EXT16: alu.sign_extend(a, 16),
        Op.I32_ADD: a + b, Op.I32_SUB: a - b, Op.I32_MUL: a * b,
        Op.I32_DIV_S: division["div_s"], Op.I32_DIV_U: division["div_u"],
        Op.I32_REM_S: division["rem_s"], Op.I32_REM_U: division["rem_u"],
        Op.I32_AND: a & b, Op.I32_OR: a | b, Op.I32_XOR: a ^ b,
        Op.I32_SHL: a << shift, Op.I32_SHR_S: alu.as_unsigned(sa >> shift.astype(jnp.int32)),
        Op.I32_SHR_U: a >> shift, Op.I32_ROTL: alu.rotate_left32(a, b), Op.I32_ROTR: alu.rotate_right32(a, b),
        Op.I32_EQ: alu.flag(a == b), Op.I32_NE: alu.flag(a != b),
        Op.I32_LT_S: alu.flag(sa < sb), Op.I32_LT_U: alu.flag(a < b),
        Op.I32_GT_S: alu.flag(sa > sb), Op.I32_GT_U: alu.flag(a > b),
        Op.I32_LE_S: alu.flag(sa <= sb), Op.I32_LE_U: alu.flag(a <= b),
        Op.I32_GE_S: alu.flag(sa >= sb), Op.I32_GE_U: alu.flag(a >= b),
    }


def _i64_results(x: alu.Pair, y: alu.Pair) -> dict[Op, alu.Pair]:
    zero = jnp.zeros_like(x[0])
    less_signed, less_unsigned = alu.less64(x, y, True), alu.less64(x, y, False)
    greater_signed, greater_unsigned = alu.less64(y, x, True), alu.less64(y, x, False)
    equal = (x[0] == y[0]) & (x[1] == y[1])

    def boolean(condition: jax.Array) -> alu.Pair:
        return alu.flag(condition), zero

    def extended(low: jax.Array) -> alu.Pair:
        return low, alu.sign_word(low)

    return {
        Op.I64_EQZ: boolean((x[0] | x[1]) == 0), Op.I64_CLZ: (alu.clz64(x), zero), Op.I64_CTZ: (alu.ctz64(x), zero),
        Op.I64_POPCNT: (lax.population_count(x[0]) + lax.population_count(x[1]), zero),
        Op.I64_EXT8: extended(alu.sign_extend(x[0], 8)), Op.I64_EXT16: extended(alu.sign_extend(x[0], 16)),
        Op.I64_EXT32: extended(x[0]), Op.I64_EXTEND_S: extended(x[0]), Op.I64_EXTEND_U: (x[0], zero),
        Op.I64_WRAP: (x[0], zero),
        Op.I64_ADD: alu.add64(x, y), Op.I64_SUB: alu.sub64(x, y), Op.I64_MUL: alu.mul64(x, y),
        Op.I64_AND: (x[0] & y[0], x[1] & y[1]), Op.I64_OR: (x[0] | y[0], x[1] | y[1]),
        Op.I64_XOR: (x[0] ^ y[0], x[1] ^ y[1]),
        Op.I64_SHL: alu.shl64(x, y[0]), Op.I64_SHR_S: alu.shr64(x, y[0], signed=True),
        Op.I64_SHR_U: alu.shr64(x, y[0], signed=False), Op.I64_ROTL: alu.rotl64(x, y[0]),
        Op.I64_ROTR: alu.rotr64(x, y[0]),
        Op.I64_EQ: boolean(equal), Op.I64_NE: boolean(~equal),
        Op.I64_LT_S: boolean(less_signed), Op.I64_LT_U: boolean(less_unsigned),
        Op.I64_GT_S: boolean(greater_signed), Op.I64_GT_U: boolean(greater_unsigned),
        Op.I64_LE_S: boolean(~greater_signed), Op.I64_LE_U: boolean(~greater_unsigned),
        Op.I64_GE_S: boolean(~less_signed), Op.I64_GE_U: boolean(~less_unsigned),
    }


_DIVIDE64 = (Op.I64_DIV_S, Op.I64_DIV_U, Op.I64_REM_S, Op.I64_REM_U)


def _divide64(op: jax.Array, x: alu.Pair, y: alu.Pair, executing: jax.Array) -> alu.Pair:
    """64-bit quotient or remainder, computed only in iterations where some slot divides."""
    dividing = executing & (op >= min(_DIVIDE64)) & (op <= max(_DIVIDE64))
    signed = (op == Op.I64_DIV_S) | (op == Op.I64_REM_S)
    remainder = (op == Op.I64_REM_S) | (op == Op.I64_REM_U)

    # Both branches take their inputs as operands and compute what they return (Triton's lowering
    # of a cond yields only values made inside it).
    def divide(operands):
        x, y, signed, remainder = operands
        quotient, rest = alu.divide64(x, y, signed)
        return jnp.where(remainder, rest[0], quotient[0]), jnp.where(remainder, rest[1], quotient[1])

    def skip(operands):
        x = operands[0]
        return x[0] ^ x[0], x[1] ^ x[1]

    some = dividing if dividing.ndim == 0 else jnp.any(dividing)  # one slot's scalars: no reduction (Triton)
    return lax.cond(some, divide, skip, (x, y, signed, remainder))


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


def _memory_access(state: MachineState, record: Record, x: alu.Pair, y: alu.Pair, executing: jax.Array):
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


class Pending(NamedTuple):
    """The register and memory writes of the last record, applied before the next one reads.

    Deferring them makes every read of an iteration follow its only write, so XLA updates the
    register file and memory in place instead of copying them each iteration.
    """

    register: jax.Array  # [slots] register index (the scratch register when nothing is written)
    register_value: jax.Array  # [slots, 2]
    address: jax.Array  # [slots] byte address of the 8-byte window
    window: jax.Array  # [slots, 8] bytes (the old bytes where nothing is stored)
    trace_row: jax.Array  # [slots] trace row (the scratch row when not tracing)
    trace_entry: jax.Array  # [slots, 4]


def no_writes(shape: MachineShape) -> Pending:
    return Pending(jnp.full((shape.slots,), shape.registers, jnp.int32), jnp.zeros((shape.slots, 2), U32),
                    jnp.full((shape.slots,), shape.memory_bytes, jnp.int32),
                    jnp.zeros((shape.slots, 8), jnp.uint8),
                    jnp.full((shape.slots,), shape.trace_entries, jnp.int32), jnp.zeros((shape.slots, 4), jnp.int32))


def apply_writes(state: MachineState, pending: Pending) -> MachineState:
    """The pending writes as scatters: one kernel each for all slots (the accelerator loop)."""
    rows = jnp.arange(state.pc.shape[0])
    registers = state.registers.at[rows, pending.register].set(pending.register_value, mode="promise_in_bounds")
    positions = pending.address[:, None] + jnp.arange(8, dtype=jnp.int32)[None, :]
    memory = state.memory.at[rows[:, None], positions].set(pending.window, mode="promise_in_bounds")
    if state.trace.shape[1] > 1:  # tracing compiled in
        trace = state.trace.at[rows, pending.trace_row].set(pending.trace_entry, mode="promise_in_bounds")
        state = state._replace(trace=trace)
    return state._replace(registers=registers, memory=memory)


def apply_per_slot(state: MachineState, pending: Pending) -> MachineState:
    """The pending writes as one dynamic-update-slice per slot and array: the form the CPU's single
    kernel can emit (XLA:CPU's whole-computation emitter has no scatter)."""
    registers, memory, trace = state.registers, state.memory, state.trace
    for slot in range(state.pc.shape[0]):
        registers = lax.dynamic_update_slice(registers, pending.register_value[slot][None, None],
                                             (slot, pending.register[slot], 0))
        memory = lax.dynamic_update_slice(memory, pending.window[slot][None], (slot, pending.address[slot]))
        if trace.shape[1] > 1:  # tracing compiled in
            trace = lax.dynamic_update_slice(trace, pending.trace_entry[slot][None, None],
                                             (slot, pending.trace_row[slot], 0))
    return state._replace(registers=registers, memory=memory, trace=trace)


def step(state: MachineState, code: jax.Array, shape: MachineShape) -> tuple[MachineState, Pending]:
    """Execute one record in every running slot; its writes are returned, not yet applied."""
    record = _fetch(code, state.pc)
    fp = state.fp
    x = _read(state.registers, operand_address(fp, record.a))
    y = _read(state.registers, operand_address(fp, record.b))
    z = _read(state.registers, operand_address(fp, record.c))
    executing = (state.status == Status.RUNNING) & (state.fuel >= record.cost)
    loaded, memory_write, out_of_bounds = _memory_access(state, record, x, y, executing)
    following, value, write_index, commit = execute(state, record, x, y, z, loaded, out_of_bounds, shape)
    trace_write = _trace_write(state, record, value, commit, shape)
    following = following._replace(traced=state.traced + (trace_write[0] < shape.trace_entries))
    return following, Pending(write_index, jnp.stack(value, axis=-1), *memory_write, *trace_write)


def execute(state: MachineState, record: Record, x: alu.Pair, y: alu.Pair, z: alu.Pair, loaded: alu.Pair,
            out_of_bounds: jax.Array, shape: MachineShape, select: Callable = lax.select_n
            ) -> tuple[MachineState, alu.Pair, jax.Array, jax.Array]:
    """One record given its operands and memory access, elementwise over whatever shape the scalars
    have: the next scalars, the value it writes, the register it writes (``shape.registers``, the
    scratch register, for none) and whether it committed. ``select(op, *cases)`` picks by opcode."""
    running = state.status == Status.RUNNING
    out_of_fuel = running & (state.fuel < record.cost)
    executing = running & ~out_of_fuel
    op, fp = record.op, state.fp

    # A conditional branch with a compare folded in (imm2: the compare's op) branches on the compare.
    folded_compare = ((op == Op.BR_IF) | (op == Op.BR_UNLESS)) & (record.imm2 != 0)
    value = _value(state, record._replace(op=jnp.where(folded_compare, record.imm2, op)), x, y, z, loaded,
                   executing, select)
    condition = jnp.where(folded_compare, value[0], x[0])
    trap = _trap(state, record, x, y, out_of_bounds, shape)
    trap = jnp.where(out_of_fuel, Trap.FUEL_EXHAUSTED, jnp.where(executing, trap, Trap.NONE))
    trapped = trap != Trap.NONE
    commit = executing & ~trapped

    grow = _grow(state, op, x, commit)
    value = (jnp.where(op == Op.MGROW, grow[0], value[0]), value[1])
    writes = commit & (record.dst != NO_WRITE) & (op != Op.HOSTCALL)  # a host call's result: the host writes it
    write_index = jnp.where(writes, operand_address(fp, record.dst), shape.registers)

    pc, new_fp, depth, finished = _next_pc(state, record, x, condition)
    branching = (op >= Op.BR) & (op <= Op.BR_TABLE)
    taken = commit & branching & (pc != state.pc + 1)
    status = jnp.where(commit & finished, Status.DONE, state.status)
    status = jnp.where(commit & (op == Op.HOSTCALL), Status.SYSCALL, status)  # the host serves it
    following = state._replace(
        pc=jnp.where(commit, pc, state.pc),
        fp=jnp.where(commit, new_fp, state.fp),
        depth=jnp.where(commit, depth, state.depth),
        status=jnp.where(trapped, Status.TRAPPED, status),
        trap=jnp.where(trapped, trap, state.trap),
        fuel=jnp.where(commit, state.fuel - record.cost, state.fuel),
        executed=jnp.where(commit, state.executed + record.cost, state.executed),
        pages=jnp.where(commit, grow[1], state.pages),
        branches=state.branches + taken,
    )
    return following, value, write_index, commit


def trace_row(state, record, commit, shape) -> jax.Array:
    """The trace row an executed record writes (``shape.trace_entries``, the scratch row, for none;
    records of cost 0, the moves lowering adds, are left out)."""
    keep = commit & (state.tracing != 0) & (record.cost > 0) & (state.traced < shape.trace_entries)
    return jnp.where(keep, state.traced, shape.trace_entries)


def trace_entry(state, record, value) -> list[jax.Array]:
    """A trace row's columns: pc, op, the value's low and high words."""
    return [state.pc, record.op, alu.as_signed(value[0]), alu.as_signed(value[1])]


def _trace_write(state, record, value, commit, shape) -> tuple[jax.Array, jax.Array]:
    return trace_row(state, record, commit, shape), jnp.stack(trace_entry(state, record, value), axis=-1)


def _value(state, record, x, y, z, loaded, executing, select: Callable = lax.select_n) -> alu.Pair:
    op = record.op
    zero = jnp.zeros_like(x[0])
    table: dict[Op, alu.Pair] = {
        Op.CONST: (alu.as_unsigned(record.imm), alu.as_unsigned(record.imm2)),
        Op.MOV: x,
        Op.SELECT: (jnp.where(z[0] != 0, x[0], y[0]), jnp.where(z[0] != 0, x[1], y[1])),
        Op.LOAD: loaded,
        Op.MSIZE: (state.pages.astype(U32), zero),
        Op.CALL: (alu.as_unsigned(state.pc + 1), alu.as_unsigned(state.fp)),
        Op.RETURN: z,
    }
    table.update({key: (word, zero) for key, word in _i32_results(x, y).items()})
    table.update(_i64_results(x, y))
    quotient = _divide64(op, x, y, executing)
    table.update(dict.fromkeys(_DIVIDE64, quotient))
    cases = [table.get(Op(code), (zero, zero)) for code in range(len(Op))]
    return select(op, *[pair[0] for pair in cases]), select(op, *[pair[1] for pair in cases])


def _trap(state, record, x, y, out_of_bounds, shape) -> jax.Array:
    op = record.op
    divides32 = (op >= Op.I32_DIV_S) & (op <= Op.I32_REM_U)
    divides64 = (op >= Op.I64_DIV_S) & (op <= Op.I64_REM_U)
    by_zero = (divides32 & (y[0] == 0)) | (divides64 & ((y[0] | y[1]) == 0))
    overflow32 = (op == Op.I32_DIV_S) & (x[0] == U32(0x80000000)) & (y[0] == U32(0xFFFFFFFF))
    overflow64 = (op == Op.I64_DIV_S) & (x[0] == 0) & (x[1] == U32(0x80000000)) & (y[0] == U32(0xFFFFFFFF)) & (
        y[1] == U32(0xFFFFFFFF))
    call_overflow = (op == Op.CALL) & ((state.depth >= shape.max_depth)
                                       | (state.fp + record.b + record.imm2 > shape.registers))
    over_limit = (op == Op.MGROW) & _within_maximum(state, x) & (x[0] > (state.page_limit - state.pages).astype(U32))
    trap = jnp.zeros_like(op) + int(Trap.NONE)
    for condition, code in ((op == Op.UNREACHABLE, Trap.UNREACHABLE), (by_zero, Trap.DIVIDE_BY_ZERO),
                            (overflow32 | overflow64, Trap.OVERFLOW), (out_of_bounds, Trap.OUT_OF_BOUNDS),
                            (call_overflow, Trap.STACK_EXHAUSTED), (over_limit, Trap.MEMORY_LIMIT)):
        trap = jnp.where(condition & (trap == Trap.NONE), code, trap)
    return trap


def _within_maximum(state, x) -> jax.Array:
    """memory.grow by x stays within the module's maximum (past it the result is -1, not a trap)."""
    return x[0] <= (state.max_pages - state.pages).astype(U32)


def _grow(state, op, x, commit) -> tuple[jax.Array, jax.Array]:
    """memory.grow: the old size or -1 (past the module's maximum), and the new size."""
    requested = x[0]
    fits = _within_maximum(state, x)
    growing = commit & (op == Op.MGROW) & fits
    result = jnp.where(fits, state.pages.astype(U32), U32(0xFFFFFFFF))
    return result, jnp.where(growing, state.pages + requested.astype(jnp.int32), state.pages)


def _next_pc(state, record, x, condition) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    op, pc = record.op, state.pc
    taken = (((op == Op.BR_IF) & (condition != 0)) | ((op == Op.BR_UNLESS) & (condition == 0)) | (op == Op.BR)
             | (op == Op.CALL))
    table_target = pc + 1 + jnp.minimum(x[0], alu.as_unsigned(record.imm2)).astype(jnp.int32)
    next_pc = jnp.where(taken, record.imm, jnp.where(op == Op.BR_TABLE, table_target, pc + 1))
    next_pc = jnp.where(op == Op.HOSTCALL, pc, next_pc)  # the host moves past it when it resumes the slot
    returning = op == Op.RETURN
    next_pc = jnp.where(returning, alu.as_signed(x[0]), next_pc)
    fp = jnp.where(op == Op.CALL, state.fp + record.b, jnp.where(returning, alu.as_signed(x[1]), state.fp))
    depth = state.depth + (op == Op.CALL) - returning
    finished = returning & (state.depth == 0)
    return next_pc, jnp.where(finished, state.fp, fp), depth, finished


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
