"""The processor inside the engine's step: machine slots on device, loaded by the host, advanced on device.

``ExecUnit`` owns a ``MachineState`` for ``exec_slots`` slots and their code. The engine's jitted
step calls ``advance_in_step``, which runs up to ``exec_steps_per_step`` iterations for every
running slot and returns a small report (status, trap, instructions, the first result registers)
that travels back with the sampled ids. Loading a program into a slot and stopping a slot are small
jitted updates enqueued between steps, so no step waits for the host and no instruction needs a
host round trip.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.parallel.transfer import to_devices
from jaxinfer.processor import loops, machine, machine_state
from jaxinfer.processor.instance import (
    CompiledModule,
    code_image,
    entry_scalars,
    initial_globals,
    initial_memory,
    initial_registers,
)
from jaxinfer.processor.isa import Status
from jaxinfer.processor.lower import Unsupported
from jaxinfer.processor.protocol import ENTRY_POINTS

RESULT_REGISTERS = 4  # results reported per slot (functions with more results are rejected)
ALONE_FACTOR = 16  # a machine-only step (no sequence to compute) runs this many engine steps' iterations


class ExecReport(NamedTuple):
    scalars: jax.Array  # [slots, len(SCALAR_FIELDS)] int32 (machine_state.SCALAR names the columns)
    results: jax.Array  # [slots, RESULT_REGISTERS, 2] uint32: the registers where results are left


@dataclass(frozen=True)
class SlotImage:
    """A program ready to load: its code, entry registers, memory and scalars, and its result types."""

    code: np.ndarray
    registers: np.ndarray
    memory: np.ndarray
    scalars: np.ndarray  # machine_state.SCALAR_FIELDS
    result_types: str


def report(state: machine_state.MachineState) -> ExecReport:
    rows = jnp.arange(state.pc.shape[0])[:, None]
    positions = state.fp[:, None] + jnp.arange(RESULT_REGISTERS)[None, :]
    return ExecReport(machine_state.pack_scalars(state), state.registers[rows, positions])


def advance_in_step(state: machine_state.MachineState, code: jax.Array, *, steps: int,
                    shape: machine.MachineShape) -> tuple[machine_state.MachineState, ExecReport]:
    """What the engine's step runs: at most ``steps`` iterations, then the report."""
    state = loops.advance(state, code, jnp.int32(steps), shape)
    return state, report(state)


def _write_slot(state: machine_state.MachineState, slot: jax.Array, registers, memory, scalars
                ) -> machine_state.MachineState:
    fields = {name: getattr(state, name).at[slot].set(scalars[index])
              for index, name in enumerate(machine_state.SCALAR_FIELDS)}
    return machine_state.MachineState(**fields, registers=state.registers.at[slot].set(registers),
                                      memory=state.memory.at[slot].set(memory), trace=state.trace)


def _load(state: machine_state.MachineState, code: jax.Array, slot: jax.Array, image_code, registers, memory, scalars):
    return _write_slot(state, slot, registers, memory, scalars), code.at[slot].set(image_code)


def _stop(state: machine_state.MachineState, slot: jax.Array) -> machine_state.MachineState:
    return state._replace(status=state.status.at[slot].set(Status.IDLE))


class ExecUnit:
    def __init__(self, shape: machine.MachineShape, steps_per_step: int, sharding: jax.sharding.Sharding) -> None:
        self.shape, self.steps, self.sharding = shape, steps_per_step, sharding
        # Built on the devices: host zeros sent across processes would be compared first (parallel.transfer).
        self.state = machine_state.empty_state(shape, sharding)
        self.code = jnp.zeros((shape.slots, shape.code_length, 8), jnp.int32, device=sharding)
        self._load = jax.jit(_load, donate_argnums=(0, 1))
        self._write = jax.jit(_write_slot, donate_argnums=(0,))
        self._alone = jax.jit(functools.partial(advance_in_step, steps=steps_per_step * ALONE_FACTOR, shape=shape),
                              donate_argnums=(0,))
        self._stop = jax.jit(_stop, donate_argnums=(0,))
        # Reads take the slot as an argument: one program each, whatever the slot.
        self._read_slot = jax.jit(lambda state, slot: (machine_state.pack_scalars(state)[slot], state.registers[slot],
                                                             state.memory[slot]))
        self._read_trace = jax.jit(lambda state, slot: state.trace[slot])
        self.free = list(range(shape.slots))
        # How a change to the machine state runs: at once here; in a process group's leader it is
        # first sent to the followers (ModelRunner._replicated), which apply it with `apply_call`.
        self.replicate: Callable[..., Any] = lambda apply, method, fields, arrays=None: apply()

    @property
    def step_function(self):
        return functools.partial(advance_in_step, steps=self.steps, shape=self.shape)

    def prepare(self, compiled: CompiledModule, max_instructions: int,
                memory: tuple[bytes, int] | None = None, trace: bool = False,
                memory_pages: int | None = None) -> SlotImage:
        """The slot image for the module's entry point, starting from ``memory`` (bytes, pages) when
        given; raises Unsupported when it cannot run here."""
        program = compiled.program
        entry = next((name for name in ENTRY_POINTS if program.exports.get(name, ("",))[0] == "func"), None)
        if entry is None:
            raise Unsupported("an exported function main or _start")
        code = program.entry_code(program.function_index(entry), entry)
        if program.start is not None:
            raise Unsupported("a start function")
        if code.params or len(code.results) > RESULT_REGISTERS:
            raise Unsupported(f"{entry} with parameters or more than {RESULT_REGISTERS} results")
        globals_ = initial_globals(program)
        limit = self.shape.memory_pages if memory_pages is None else min(memory_pages, self.shape.memory_pages)
        memory, pages, max_pages = initial_memory(program, limit, self.shape.memory_pages, memory)
        scalars = entry_scalars(code, len(globals_), max_instructions, pages, max_pages, limit,
                                trace and self.shape.trace_entries > 0)
        registers = initial_registers(globals_, code, [], self.shape.registers)
        return SlotImage(code_image(program, self.shape.code_length), registers, memory, scalars, code.results)

    def load(self, slot: int, image: SlotImage) -> None:
        arrays = {"code": image.code, "registers": image.registers, "memory": image.memory, "scalars": image.scalars}
        self.replicate(lambda: self._load_image(slot, arrays), "exec_load", {"slot": slot}, arrays)

    def _load_image(self, slot: int, arrays: dict[str, np.ndarray]) -> None:
        inputs = self._sent(np.int32(slot), arrays["code"], arrays["registers"], arrays["memory"], arrays["scalars"])
        self.state, self.code = self._load(self.state, self.code, *inputs)

    def _sent(self, *arrays: np.ndarray) -> tuple[jax.Array, ...]:
        """Host arrays on the state's devices, in one explicit copy (no implicit transfer at the call)."""
        return tuple(to_devices(arrays, self.sharding))

    def _local(self, slot: int) -> tuple[machine_state.MachineState, jax.Array]:
        """The state as this process's first device holds it (replicated: reads need no other process),
        and the slot's index sent there explicitly."""
        state = jax.tree.map(lambda array: array.addressable_data(0), self.state)
        return state, jax.device_put(np.int32(slot), state.status.sharding)

    def scalars(self, slot: int) -> np.ndarray:
        return self.read(slot)[0]

    def memory(self, slot: int) -> np.ndarray:
        return self.read(slot)[2]

    def read(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A slot's scalars, registers and memory on the host (one program, one copy back), writable: a
        system call changes them."""
        return tuple(np.array(part) for part in jax.device_get(self._read_slot(*self._local(slot))))

    def trace_rows(self, slot: int, count: int) -> np.ndarray:
        """The first ``count`` trace rows of a slot (pc, op, value low, value high)."""
        return jax.device_get(self._read_trace(*self._local(slot)))[: min(count, self.shape.trace_entries)]

    def resume(self, slot: int, scalars: np.ndarray, registers: np.ndarray, memory: np.ndarray) -> None:
        arrays = {"scalars": scalars, "registers": registers, "memory": memory}
        self.replicate(lambda: self._resume(slot, arrays), "exec_resume", {"slot": slot}, arrays)

    def _resume(self, slot: int, arrays: dict[str, np.ndarray]) -> None:
        self.state = self._write(self.state, *self._sent(np.int32(slot), arrays["registers"], arrays["memory"],
                                                          arrays["scalars"]))

    def run_alone(self) -> ExecReport:
        """Advances the slots without a model step (nothing else to compute); returns the report."""
        return self.replicate(self._run_alone, "exec_alone", {})

    def _run_alone(self) -> ExecReport:
        self.state, exec_report = self._alone(self.state, self.code)
        return exec_report

    def apply_call(self, method: str, fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """A follower's copy of a change the leader made (see `replicate`)."""
        if method == "exec_load":
            self._load_image(fields["slot"], arrays)
        elif method == "exec_resume":
            self._resume(fields["slot"], arrays)
        elif method == "exec_alone":
            self._run_alone()
        elif method == "exec_stop":
            self._stop_slot(fields["slot"])
        else:
            raise ValueError(f"control channel: unknown processor call {method!r}")

    def warmup(self) -> None:
        """Compiles the load, stop and machine-only programs now rather than at the first program."""
        shape = self.shape
        idle = SlotImage(np.zeros((shape.code_length, 8), np.int32), np.zeros((shape.registers + 1, 2), np.uint32),
                         np.zeros(shape.memory_bytes + 8, np.uint8),
                         np.zeros(len(machine_state.SCALAR_FIELDS), np.int32), "")
        # Every process warms up alike, so none of this is sent to followers.
        self._load_image(0, {"code": idle.code, "registers": idle.registers, "memory": idle.memory,
                             "scalars": idle.scalars})
        scalars, registers, memory = self.read(0)
        self.trace_rows(0, 0)
        self._resume(0, {"scalars": scalars, "registers": registers, "memory": memory})
        self._stop_slot(0)
        jax.block_until_ready(self._run_alone())

    def stop(self, slot: int) -> None:
        self.replicate(lambda: self._stop_slot(slot), "exec_stop", {"slot": slot})

    def _stop_slot(self, slot: int) -> None:
        self.state = self._stop(self.state, *self._sent(np.int32(slot)))
