"""Host API of the processor: compile a module, instantiate it, invoke its exports on the machine.

An ``Instance`` keeps a module's globals and linear memory on the host between invocations (the
spec tests and multi-turn state rely on that) and runs each invocation on a one-slot machine
through ``loops.advance`` in chunks, checking the wall-clock limit between chunks.
"""

from __future__ import annotations

import functools
import struct
import time
from dataclasses import dataclass, field

import jax
import numpy as np
import wasmtime

from jaxinfer.machine_shape import PAGE_BYTES
from jaxinfer.processor import loops, machine, machine_state
from jaxinfer.processor.binary import LimitExceeded, MalformedModule, Module, decode
from jaxinfer.processor.isa import FIELD, NO_WRITE, RECORD_WIDTH, Op, Status, Trap
from jaxinfer.processor.lower import Unsupported, lower
from jaxinfer.processor.program import FunctionCode, Program
from jaxinfer.processor.validate import InvalidModule, validate
from jaxinfer.processor.wasi import SYSCALL_NAMES, SYSCALLS, FileMapping, ProcessExit, QuotaExceeded, Syscalls

DEFAULT_REGISTERS = 16384
DEFAULT_MAX_DEPTH = 1024
DEFAULT_MEMORY_PAGES = 16
STEPS_PER_CALL = 1 << 22


@dataclass
class ExecResult:
    """What one invocation produced. ``values`` are bit patterns as unsigned ints, as in the spec tests."""

    values: list[int]
    trap: str | None
    instructions: int
    stdout: bytes = b""
    files_written: dict[str, bytes] = field(default_factory=dict)
    branches: int = 0  # branches taken
    trace: list[str] = field(default_factory=list)  # one line per instruction with trace="full"


@dataclass
class HostCallOutcome:
    """What serving a slot's system call decided: resume it, or end it (an exit or a trap)."""

    resume: bool
    exit_code: int | None = None
    trap: str | None = None


def serve_host_call(code: np.ndarray, scalars: np.ndarray, registers: np.ndarray, memory: np.ndarray,
                    syscalls: Syscalls) -> HostCallOutcome:
    """Serves the HOSTCALL a slot stopped at; updates its scalars, registers and memory (host copies)."""
    pc, fp, pages = (int(scalars[_SCALAR[name]]) for name in ("pc", "fp", "pages"))
    record = code[pc]
    number, count = int(record[FIELD["imm"]]), int(record[FIELD["imm2"]])
    base = fp + int(record[FIELD["b"]])
    params = SYSCALLS[SYSCALL_NAMES[number]][1]
    args = [int(registers[base + i, 0]) | (int(registers[base + i, 1]) << 32 if params[i] == "I" else 0)
            for i in range(count)]
    try:
        errno = syscalls.call(number, args, memory[: pages * PAGE_BYTES + 8])
    except ProcessExit as exit_:
        return HostCallOutcome(False, exit_code=exit_.code)
    except QuotaExceeded:
        return HostCallOutcome(False, trap=Trap.QUOTA.message)
    except (OSError, ValueError, OverflowError, struct.error) as error:  # never out of the engine's step
        return HostCallOutcome(False, trap=f"host call {SYSCALL_NAMES[number]} failed: {error}")
    if int(record[FIELD["dst"]]) != NO_WRITE:
        registers[fp + int(record[FIELD["dst"]])] = (errno, 0)
    scalars[_SCALAR["pc"]] = pc + 1
    scalars[_SCALAR["status"]] = Status.RUNNING
    return HostCallOutcome(True)


_SCALAR = machine_state.SCALAR


def trace_lines(rows: np.ndarray) -> list[str]:
    """Trace rows (pc, op, value low, value high) as text: one line per executed record (a WebAssembly
    instruction with the operands and local.set folded into it)."""
    lines = []
    for pc, op, low, high in rows.tolist():
        value = (low & 0xFFFFFFFF) | ((high & 0xFFFFFFFF) << 32)
        lines.append(f"{pc:5d} {Op(op).name.lower():<10} {value}")
    return lines


@dataclass
class CompiledModule:
    module: Module
    program: Program


def to_binary(source: bytes | str) -> bytes:
    """WebAssembly text (str, or bytes not starting with NUL) to binary with wasmtime's wat2wasm."""
    if isinstance(source, bytes | bytearray) and source[:1] == b"\x00":  # binary (text never starts with NUL)
        return bytes(source)
    text = source.decode("utf-8") if isinstance(source, bytes | bytearray) else source
    try:
        return bytes(wasmtime.wat2wasm(text))
    except wasmtime.WasmtimeError as error:
        raise MalformedModule(str(error).splitlines()[0]) from error


def compile_module(source: bytes | str) -> CompiledModule:
    """Parse, validate and lower; raises MalformedModule, InvalidModule or Unsupported (a feature of a
    later proposal is Unsupported even where the module is also invalid: the validator never sees it)."""
    module = decode(to_binary(source))
    validate(module)
    return CompiledModule(module, lower(module))


def _bucket(value: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, (value - 1).bit_length()))


def _memory_capacity(program: Program, memory_pages: int) -> int:
    """Pages an instance's memory holds: one without a memory (never in bounds), else up to the limit or
    the module's maximum."""
    if not program.memory:
        return 1
    maximum = program.memory[1]
    return memory_pages if maximum is None else min(memory_pages, maximum)


def initial_globals(program: Program) -> np.ndarray:
    """[globals + constants, 2] uint32 (low, high) words: the globals' initial values, then the constant pool."""
    values = [*program.global_inits, *program.constants]
    return np.array([[value & 0xFFFFFFFF, value >> 32] for value in values], np.uint32).reshape(-1, 2)


def initial_memory(program: Program, memory_pages: int, capacity_pages: int,
                   base: tuple[bytes, int] | None = None) -> tuple[np.ndarray, int, int]:
    """Linear memory with the data segments written (plus 8 padding bytes), its size in pages and the
    module's maximum (``memory_pages`` is the limit past which growing traps).

    ``base`` (memory bytes, pages) is a previous turn's memory to start from (see sessions.py)."""
    minimum, maximum = program.memory or (0, 0)
    maximum = 65536 if maximum is None else maximum
    limit = min(memory_pages, maximum)
    if base is not None:
        if not program.memory:
            raise Unsupported("a memory to take the session's memory")
        if base[1] > limit:
            raise LimitExceeded(f"the session's memory of {base[1]} pages is over this module's limit of {limit} "
                                "pages")
        minimum = max(minimum, base[1])
    if minimum > memory_pages:
        raise LimitExceeded(f"a memory of {minimum} pages is over the limit of {memory_pages} pages "
                            "(exec_memory_pages)")
    memory = np.zeros(capacity_pages * PAGE_BYTES + 8, np.uint8)
    if base is not None:
        memory[: len(base[0])] = np.frombuffer(base[0], np.uint8)
    for offset, payload in program.data:
        if offset + len(payload) > minimum * PAGE_BYTES:
            raise Unsupported("data segment does not fit in memory")
        memory[offset : offset + len(payload)] = np.frombuffer(payload, np.uint8)
    return memory, minimum, maximum


def code_image(program: Program, code_length: int) -> np.ndarray:
    if len(program.code) > code_length:
        raise LimitExceeded(f"a program of {len(program.code)} code records is over the limit of {code_length} "
                            "(exec_code_records)")
    code = np.zeros((code_length, RECORD_WIDTH), np.int32)
    code[: len(program.code)] = program.code
    return code


def entry_scalars(code: FunctionCode, base: int, fuel: int, pages: int, max_pages: int, page_limit: int,
                  tracing: bool) -> np.ndarray:
    """The scalars of a slot about to run ``code`` with its frame at register ``base``."""
    return machine_state.scalar_row(pc=code.entry, fp=base, status=Status.RUNNING, fuel=fuel, pages=pages,
                                    max_pages=max_pages, page_limit=page_limit, tracing=tracing)


def initial_registers(globals_: np.ndarray, code: FunctionCode, args: list[int], registers: int) -> np.ndarray:
    """The register file at entry: globals, then the entry frame (link, arguments)."""
    if len(args) != len(code.params):
        raise ValueError(f"args: expected {len(code.params)} values, got {len(args)}")
    base = len(globals_)
    if base + code.frame_size + 1 > registers:
        raise LimitExceeded(f"an entry frame of {code.frame_size} registers (after {base} globals) is over the "
                            f"limit of {registers} registers (exec_registers)")
    image = np.zeros((registers + 1, 2), np.uint32)
    image[:base] = globals_
    for index, value in enumerate(args):  # register 0 of the frame is its (unused) link
        image[base + 1 + index] = (value & 0xFFFFFFFF, (value >> 32) & 0xFFFFFFFF)
    return image


@functools.lru_cache(maxsize=16)
def _advance_for(shape: machine.MachineShape):
    return jax.jit(functools.partial(loops.advance, shape=shape), donate_argnums=0)


class Instance:
    """A module instance: globals and memory that persist across invocations."""

    def __init__(self, compiled: CompiledModule, *, memory_pages: int = DEFAULT_MEMORY_PAGES,
                 max_call_depth: int = DEFAULT_MAX_DEPTH, registers: int = DEFAULT_REGISTERS,
                 trace_entries: int = 0, loop: str = "auto") -> None:
        program = compiled.program
        self.program = program
        self.globals = initial_globals(program)
        capacity = _bucket(_memory_capacity(program, memory_pages), 1)
        memory, self.pages, self.max_pages = initial_memory(program, memory_pages, capacity)
        self.memory_limit = memory_pages
        self.memory = jax.numpy.asarray(memory[None])  # stays on the device between invocations
        code_length = _bucket(len(program.code), 256)
        self.code = code_image(program, code_length)[None]
        self.device_code = jax.numpy.asarray(self.code)
        self.shape = machine.MachineShape(1, code_length, registers, capacity, max_call_depth,
                                          trace_entries, loop)
        if program.start is not None:
            result = self.call(program.start, [])
            if result.trap:
                raise RuntimeError(f"start function trapped: {result.trap}")

    def global_value(self, name: str) -> int:
        kind, index = self.program.exports.get(name, (None, None))
        if kind != "global":
            raise KeyError(f"no exported global {name!r}")
        value_type = self.program.global_types[index][0]
        if value_type in "fF":
            raise Unsupported(f"{'f32' if value_type == 'f' else 'f64'} global")
        low, high = (int(word) for word in self.globals[index])
        return low if value_type == "i" else low | high << 32

    def invoke(self, name: str, args: list[int] = (), **limits) -> ExecResult:
        return self.call(self.program.function_index(name), list(args), **limits)

    def call(self, function: int, args: list[int], *, max_instructions: int = 2**31 - 1,
             timeout_seconds: float | None = None, files: FileMapping | None = None) -> ExecResult:
        """Runs one function; WASI calls are served on the host, files committed only on a normal halt.
        With ``trace_entries`` the first that many instructions are traced."""
        program = self.program
        code = program.entry_code(function, f"function {function}")
        syscalls = Syscalls(files)
        state = self._initial_state(code, args, max_instructions)
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        advance = _advance_for(self.shape)
        while True:
            state = advance(state, self.device_code, np.int32(STEPS_PER_CALL))
            status = int(state.status[0])
            if status == Status.SYSCALL:
                state, outcome = self._serve(state, syscalls)
                if not outcome.resume:
                    return self._finish(state, code, syscalls, outcome.trap, outcome.exit_code)
            elif status != Status.RUNNING:
                break
            if deadline is not None and time.monotonic() > deadline:
                return self._finish(state, code, syscalls, Trap.TIMEOUT.message)
        trap = Trap(int(state.trap[0])).message if status == Status.TRAPPED else None
        return self._finish(state, code, syscalls, trap)

    def _serve(self, state: machine_state.MachineState, syscalls: Syscalls
               ) -> tuple[machine_state.MachineState, HostCallOutcome]:
        scalars = np.array(machine_state.pack_scalars(state)[0])
        registers, memory = np.array(state.registers[0]), np.array(state.memory[0])
        outcome = serve_host_call(self.code[0], scalars, registers, memory, syscalls)
        return machine_state.unpack_scalars(scalars[None], registers[None], memory[None], state.trace), outcome

    def _initial_state(self, code: FunctionCode, args: list[int], max_instructions: int) -> machine_state.MachineState:
        registers = initial_registers(self.globals, code, args, self.shape.registers)[None]
        scalars = entry_scalars(code, len(self.globals), max_instructions, self.pages, self.max_pages,
                                self.memory_limit, self.shape.trace_entries > 0)
        trace = np.zeros((1, self.shape.trace_entries + 1, 4), np.int32)
        return machine_state.unpack_scalars(scalars[None], jax.numpy.asarray(registers), self.memory, trace)

    def _finish(self, state: machine_state.MachineState, code: FunctionCode, syscalls: Syscalls, trap: str | None,
                exit_code: int | None = None) -> ExecResult:
        registers = np.asarray(state.registers[0])
        base = len(self.globals)
        self.globals = registers[:base].copy()
        self.memory = state.memory
        self.pages = int(state.pages[0])
        if exit_code:  # proc_exit with a failure code: like a trap, the files stay as they were
            trap = f"exit code {exit_code}"
        values = []
        if trap is None and exit_code is None:
            for index, value_type in enumerate(code.results):
                low, high = (int(word) for word in registers[base + index])
                values.append(low if value_type == "i" else low | high << 32)
        written = {}
        if trap is None:
            try:
                written = syscalls.commit()
            except OSError as error:
                trap = f"file commit failed: {error.strerror or error}"
        executed = int(state.executed[0])
        trace = trace_lines(np.asarray(state.trace[0])[: int(state.traced[0])])
        return ExecResult(values, trap, executed, bytes(syscalls.stdout), written, int(state.branches[0]), trace)


def run(module: bytes | str, func: str = "main", args: list[int] = (), *, max_instructions: int = 10_000_000,
        memory_pages: int = DEFAULT_MEMORY_PAGES, timeout_seconds: float | None = None,
        files: FileMapping | None = None, trace_entries: int = 0, loop: str = "auto") -> ExecResult:
    """Compile, instantiate and invoke one export on the jitted machine (``files``: WASI descriptors 3..;
    ``trace_entries``: trace that many instructions; ``loop``: see ``machine.MachineShape``)."""
    instance = Instance(compile_module(module), memory_pages=memory_pages, trace_entries=trace_entries, loop=loop)
    return instance.invoke(func, list(args), max_instructions=max_instructions, timeout_seconds=timeout_seconds,
                           files=files)


def run_slots(module: bytes | str, func: str, args_per_slot: list[list[int]], *, max_instructions: int = 10_000_000,
              memory_pages: int = DEFAULT_MEMORY_PAGES, loop: str = "auto") -> list[ExecResult]:
    """Run one export in ``len(args_per_slot)`` slots of one machine at once, each with its own
    arguments, memory and fuel: the batched path the engine uses, exposed for tests and benchmarks."""
    compiled = compile_module(module)
    instances = [Instance(compiled, memory_pages=memory_pages) for _ in args_per_slot]
    code = compiled.program.entry_code(compiled.program.function_index(func), func)
    if (compiled.program.code[:, FIELD["op"]] == Op.HOSTCALL).any():
        raise Unsupported("WASI calls in run_slots (use run or Instance, which serve them)")
    states = [instance._initial_state(code, list(args), max_instructions)
              for instance, args in zip(instances, args_per_slot, strict=True)]
    state = jax.tree.map(lambda *parts: jax.numpy.concatenate(parts), *states)
    slots = len(args_per_slot)
    shape = machine.MachineShape(slots, instances[0].shape.code_length, instances[0].shape.registers,
                                 instances[0].shape.memory_pages, instances[0].shape.max_depth, loop=loop)
    device_code = jax.numpy.asarray(np.repeat(instances[0].code, slots, axis=0))
    advance = _advance_for(shape)
    while True:
        state = advance(state, device_code, np.int32(STEPS_PER_CALL))
        if not (np.asarray(state.status) == Status.RUNNING).any():
            break
    results = []
    for slot, instance in enumerate(instances):
        one = jax.tree.map(lambda leaf, slot=slot: leaf[slot : slot + 1], state)
        status = int(one.status[0])
        trap = Trap(int(one.trap[0])).message if status == Status.TRAPPED else None
        results.append(instance._finish(one, code, Syscalls(), trap))
    return results


__all__ = ["CompiledModule", "ExecResult", "Instance", "InvalidModule", "MalformedModule", "Unsupported",
           "compile_module", "run", "run_slots"]
