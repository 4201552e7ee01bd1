"""The machine's loop as one Pallas GPU (Triton) kernel: one program per slot, the loop on chip.

On a GPU, XLA runs each fusion of the while loop's body as its own kernel launch, about 25 us an
iteration on an H200. Here the whole loop is one kernel: program ``s`` runs slot ``s``'s records
until it stops or has run ``steps`` of them. The slot's scalars live in registers; its register
file, linear memory and code stay in GPU memory and are read and written in place, one element at a
time (the outputs alias the inputs). Each record goes through the same ``machine.execute`` as the
other loops, with scalar operands, so the semantics are one piece of code; only the fetch, the
register and memory reads and the writes are this kernel's own.

With ``interpret=True`` Pallas's interpreter runs the kernel on the CPU (the tests run the
conformance files that way).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxinfer.processor import alu, machine, machine_memory, machine_state
from jaxinfer.processor.isa import FIELD, Status

U32 = jnp.uint32
SCALAR_COLUMNS = 16  # the 13 scalars padded to a power of two


def select_chain(op: jax.Array, *cases: jax.Array) -> jax.Array:
    """``lax.select_n`` for Triton, which lowers only two-way selects."""
    picked = cases[0]
    for code, case in enumerate(cases[1:], 1):
        picked = jnp.where(op == code, case, picked)
    return picked


def _kernel(steps_ref, code_ref, scalars_in, registers_in, memory_in, trace_in, scalars_ref, registers_ref,
            memory_ref, trace_ref, *, shape: machine.MachineShape, interpret: bool) -> None:
    del scalars_in, registers_in, memory_in, trace_in  # aliased by the outputs, read and written in place

    def read(index: jax.Array) -> alu.Pair:
        return registers_ref[index, 0], registers_ref[index, 1]

    def run_record(carry):
        iteration, state = carry
        record = machine_state.Record(*(code_ref[state.pc, FIELD[name]] for name in machine_state.Record._fields))
        x = read(machine.operand_address(state.fp, record.a))
        y = read(machine.operand_address(state.fp, record.b))
        z = read(machine.operand_address(state.fp, record.c))
        where = machine_memory.access(state, record, x)
        window = pl.ds(where.address, machine_memory.LANES)
        old = memory_ref[window]
        loaded = machine_memory.assemble_load(old.astype(U32), where.width, record.imm2)
        following, value, write_index, commit = machine.execute(state, record, x, y, z, loaded,
                                                                where.out_of_bounds, shape, select_chain)
        registers_ref[write_index, 0] = value[0]  # the scratch register when nothing is written
        registers_ref[write_index, 1] = value[1]
        storing = where.is_store & commit & (jnp.arange(machine_memory.LANES) < where.width)
        memory_ref[window] = jnp.where(storing, machine_memory.store_bytes(y), old)
        if shape.trace_entries:
            row = machine.trace_row(state, record, commit, shape)
            for column, entry in enumerate(machine.trace_entry(state, record, value)):
                trace_ref[row, column] = entry
            following = following._replace(traced=state.traced + (row < shape.trace_entries))
        if not interpret:  # the next record may read what this one wrote, through other threads of the
            pl_triton.debug_barrier()  # program: Triton orders their global memory only at a barrier
        return iteration + 1, following

    def keep_going(carry):
        iteration, state = carry
        return (iteration < steps_ref[0]) & (state.status == Status.RUNNING)

    scalars = [scalars_ref[column] for column in range(len(machine_state.SCALAR_FIELDS))]
    state = machine_state.MachineState(*scalars, registers=None, memory=None, trace=None)
    _, state = lax.while_loop(keep_going, run_record, (jnp.int32(0), state))
    for column, name in enumerate(machine_state.SCALAR_FIELDS):
        scalars_ref[column] = getattr(state, name)


def advance(state: machine_state.MachineState, code: jax.Array, steps: jax.Array, shape: machine.MachineShape, *,
            interpret: bool = False) -> machine_state.MachineState:
    """``loops.advance`` as one kernel."""
    scalars = jnp.pad(machine_state.pack_scalars(state),
                      ((0, 0), (0, SCALAR_COLUMNS - len(machine_state.SCALAR_FIELDS))))
    registers, memory, trace = state.registers, state.memory, state.trace

    def per_slot(array: jax.Array) -> pl.BlockSpec:
        return pl.BlockSpec((None, *array.shape[1:]), lambda slot: (slot,) + (0,) * (array.ndim - 1))

    arrays = (scalars, registers, memory, trace)
    scalars, registers, memory, trace = pl.pallas_call(
        functools.partial(_kernel, shape=shape, interpret=interpret),
        grid=(shape.slots,),
        in_specs=[pl.BlockSpec((1,), lambda slot: (0,)), per_slot(code), *map(per_slot, arrays)],
        out_specs=list(map(per_slot, arrays)),
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
        input_output_aliases={2: 0, 3: 1, 4: 2, 5: 3},
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=1, num_stages=1),
        name="jaxinfer_wasm_machine",
    )(jnp.reshape(steps, (1,)).astype(jnp.int32), code, *arrays)
    return machine_state.unpack_scalars(scalars[:, : len(machine_state.SCALAR_FIELDS)], registers, memory, trace)
