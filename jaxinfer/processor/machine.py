"""One iteration of the machine for every running slot: fetch each slot's record and its operands,
execute it (next pc and frame, traps, memory growth, trace row), and return its writes as ``Pending``,
applied before the next iteration reads (``apply_writes``, ``apply_per_slot``).

``loops.advance`` runs a ``lax.while_loop`` of at most ``steps`` iterations of ``step``; each
iteration executes one record for every running slot with branch-free code, so slots running
different programs share one loop. The only real branch is 64-bit division (machine_values.py),
taken when some slot divides. The engine calls ``advance`` inside its jitted step with a small
``steps``; the host API calls it with a large one. The state is machine_state.py's, what each
opcode computes machine_values.py's, loads and stores machine_memory.py's.

On the CPU the loop is compiled as a single kernel (``loops._advance_one_kernel``); on accelerators, or
with ``MachineShape.loop == "while"``, it is a plain ``lax.while_loop``; with ``loop == "pallas"`` it
is the Pallas GPU kernel of ``gpu_kernel.py``. Every form runs each record through ``execute``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer.machine_shape import MachineShape
from jaxinfer.processor import alu
from jaxinfer.processor.isa import ABSOLUTE, FIELD, NO_WRITE, Op, Status, Trap
from jaxinfer.processor.machine_memory import memory_access
from jaxinfer.processor.machine_state import MachineState, Record, empty_state  # noqa: F401 (tests: machine.empty_state)
from jaxinfer.processor.machine_values import record_value

U32 = jnp.uint32


def _fetch(code: jax.Array, pc: jax.Array) -> Record:
    record = jnp.take_along_axis(code, pc[:, None, None], axis=1)[:, 0, :]
    return Record(*(record[:, FIELD[name]] for name in Record._fields))


def operand_address(fp: jax.Array, operand: jax.Array) -> jax.Array:
    """A record's register operand: frame-relative, or absolute from ABSOLUTE up (globals, constants)."""
    return jnp.where(operand >= ABSOLUTE, operand - ABSOLUTE, fp + operand)


def _read(registers: jax.Array, index: jax.Array) -> alu.Pair:
    pair = jnp.take_along_axis(registers, index[:, None, None], axis=1)[:, 0, :]
    return pair[:, 0], pair[:, 1]


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
    loaded, memory_write, out_of_bounds = memory_access(state, record, x, y, executing)
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
    value = record_value(state, record._replace(op=jnp.where(folded_compare, record.imm2, op)), x, y, z, loaded,
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
