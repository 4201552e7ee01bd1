"""Lowering of validated WebAssembly functions to the machine's micro-ISA (see isa.py).

Register 0 of a frame is its link (return pc, caller frame pointer), written by CALL; local ``k``
is register ``1 + k`` and stack slot ``s`` of a function with ``L`` locals is register
``1 + L + s``. A call shifts its arguments up one register (moves of cost 0) to make room for the
callee's link; RETURN reads the link and writes the first result over it in the same record.
``local.get``, ``global.get`` and constants are not moves: the record that consumes them reads
the local, the global or the program's constant pool (absolute registers after the globals)
directly, and a ``local.set`` right after a computation retargets that record's destination.
Entries still aliased go to their slots before control flow (moves carrying the folded cost).
Branches that carry values become explicit moves followed by a jump; ``br_table`` becomes an
indexed jump into a table of jumps. Code after an unconditional branch is not emitted. A function
that uses an instruction the machine does not run (floats, indirect calls, imports other than the
WASI subset of wasi.py) is recorded as unsupported with the instruction's name, and so is every
function that calls it. A call to an imported WASI function is a HOSTCALL record.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from jaxinfer.processor.binary import Instruction, Module, Unsupported
from jaxinfer.processor.isa import ABSOLUTE, FIELD, NO_WRITE, NUMERIC_OPS, RECORD_WIDTH, Op, load_kind
from jaxinfer.processor.validate import block_signature
from jaxinfer.processor.wasi import SYSCALLS, WASI_MODULE

# Compares a conditional branch right after them can take over (the branch then computes them).
COMPARES = frozenset(op for op in Op if op.name.endswith(("_EQZ", "_EQ", "_NE", "_LT_S", "_LT_U", "_GT_S", "_GT_U",
                                                          "_LE_S", "_LE_U", "_GE_S", "_GE_U")))
# Records that only compute their destination: a local.set right after one can take over its dst.
RETARGETABLE = frozenset(op for op in Op if op.name.startswith(("I32_", "I64_"))) | {
    Op.SELECT, Op.LOAD, Op.MSIZE, Op.MGROW, Op.MOV}


@dataclass
class FunctionCode:
    entry: int
    frame_size: int  # registers: the link, locals and operand slots
    params: str
    results: str


@dataclass
class Program:
    """A lowered module: one code array for all its functions and what instantiation needs."""

    code: np.ndarray  # [records, RECORD_WIDTH] int32
    functions: dict[int, FunctionCode]
    unsupported: dict[int, str]
    exports: dict[str, tuple[str, int]]
    global_types: list[tuple[str, bool]]
    global_inits: list[int]  # 64-bit patterns
    memory: tuple[int, int | None] | None  # (min pages, max pages)
    data: list[tuple[int, bytes]]
    start: int | None
    constants: list[int] = field(default_factory=list)  # the constant pool: absolute registers after the globals

    def function_index(self, name: str) -> int:
        kind, index = self.exports.get(name, (None, None))
        if kind != "func":
            raise KeyError(f"no exported function {name!r}")
        return index

    def entry_code(self, function: int, name: str) -> FunctionCode:
        """The code to start a run at `function` (called `name` in messages); Unsupported when it
        cannot run here or is an imported function (exported again), which has no code."""
        if function in self.unsupported:
            raise Unsupported(self.unsupported[function])
        if function not in self.functions:
            raise Unsupported(f"{name} defined in the module, not imported")
        return self.functions[function]


@dataclass
class _Block:
    kind: str
    height: int  # operand height below the block's params
    label_arity: int
    result_count: int
    param_count: int
    start: int = 0
    fixups: list[int] = field(default_factory=list)
    else_fixup: int | None = None
    live: bool = True


class _FunctionLowering:
    """Lowers one function body; ``calls`` collects CALL records to patch once all are lowered."""

    def __init__(self, module: Module, function_types: list[int], param_types: str, local_types: str,
                 results: str, code: list[list[int]], calls: list[tuple[int, int]],
                 host_calls: dict[int, int], constants: dict[int, int]) -> None:
        self.module = module
        self.constants = constants  # 64-bit pattern -> absolute register (shared by the whole program)
        self.aliases: dict[int, tuple[int, int]] = {}  # stack index -> (operand register, folded cost)
        self.barrier = 0  # first record after the last branch target: records before it may not be retargeted
        self.host_calls = host_calls  # imported function index -> WASI system call number
        self.function_types = function_types
        self.locals = len(param_types) + len(local_types)
        self.results = results
        self.code = code
        self.calls = calls
        self.height = 0
        self.max_height = 0
        self.reachable = True
        self.blocks: list[_Block] = [_Block("func", 0, len(results), len(results), 0)]
        for index in range(len(param_types), self.locals):
            self.emit(Op.CONST, dst=self.local(index), cost=0)

    def local(self, index: int) -> int:
        return 1 + index

    def slot(self, height: int) -> int:
        return 1 + self.locals + height

    def set_height(self, height: int) -> None:
        for index in range(height, self.height) if self.aliases else ():
            self.aliases.pop(index, None)
        self.height = height
        self.max_height = max(self.max_height, height)

    # Operands: a stack entry is in its slot, or an alias of a local, global or constant register ----------

    def push_alias(self, register: int) -> None:
        self.aliases[self.height] = (register, 1)
        self.set_height(self.height + 1)

    def take(self, count: int) -> tuple[list[int], int]:
        """The registers of the top ``count`` entries (aliases read in place) and the cost folded into them."""
        first = self.height - count
        registers = [self.aliases.get(index, (self.slot(index), 0))[0] for index in range(first, self.height)]
        return registers, sum(self.aliases.get(index, (0, 0))[1] for index in range(first, self.height))

    def materialize(self, index: int) -> None:
        register, cost = self.aliases.pop(index)
        self.emit(Op.MOV, dst=self.slot(index), a=register, cost=cost)

    def materialize_all(self) -> None:
        """Every entry into its slot: before control flow, whose targets expect values in slots."""
        for index in sorted(self.aliases):
            self.materialize(index)

    def materialize_aliases_of(self, register: int) -> None:
        for index in sorted(index for index, (aliased, _) in self.aliases.items() if aliased == register):
            self.materialize(index)

    def mark_target(self) -> None:
        self.barrier = self.here()

    def take_condition(self) -> tuple[dict[str, int], int]:
        """The top entry as a branch condition: the compare that just computed it (its record removed,
        the branch computes it) or the register, with the cost folded into the branch."""
        top = self.height - 1
        last = self.code[-1] if self.code else None
        if (top not in self.aliases and last is not None and self.here() - 1 >= self.barrier
                and last[FIELD["dst"]] == self.slot(top) and last[FIELD["op"]] in COMPARES):
            self.code.pop()
            return {"a": last[FIELD["a"]], "b": last[FIELD["b"]], "imm2": last[FIELD["op"]]}, last[FIELD["cost"]]
        (condition,), folded = self.take(1)
        return {"a": condition}, folded

    def emit(self, op: Op, *, dst: int = NO_WRITE, a: int = 0, b: int = 0, c: int = 0, imm: int = 0, imm2: int = 0,
             cost: int = 1) -> int:
        record = [0] * RECORD_WIDTH
        for name, value in (("op", op), ("dst", dst), ("a", a), ("b", b), ("c", c), ("imm", imm), ("imm2", imm2),
                            ("cost", cost)):
            record[FIELD[name]] = _as_int32(int(value))
        self.code.append(record)
        return len(self.code) - 1

    def patch(self, position: int, target: int) -> None:
        self.code[position][FIELD["imm"]] = target
        if target == self.here():
            self.mark_target()

    def here(self) -> int:
        return len(self.code)

    def lower(self, body: tuple[Instruction, ...]) -> int:
        for instruction in body:
            self.step(instruction)
        return 1 + self.locals + self.max_height

    def step(self, instruction: Instruction) -> None:
        name = instruction.name
        if name in ("block", "loop", "if", "else", "end"):
            getattr(self, "structure_" + name)(*instruction.immediates)
        elif self.reachable:
            self.operation(instruction)

    # Structure --------------------------------------------------------------------------------

    def structure_block(self, block_type: object, kind: str = "block") -> None:
        signature = block_signature(self.module, block_type)
        params, results = len(signature.params), len(signature.results)
        if not self.reachable:
            self.blocks.append(_Block(kind, self.height, 0, 0, 0, live=False))
            return
        condition: dict[str, int] = {}
        if kind == "if":
            condition, folded = self.take_condition()
            self.set_height(self.height - 1)
        self.materialize_all()
        block = _Block(kind, self.height - params, params if kind == "loop" else results, results, params,
                       start=self.here())
        self.mark_target()
        if kind == "if":
            block.else_fixup = self.emit(Op.BR_UNLESS, **condition, cost=1 + folded)
        self.blocks.append(block)

    def structure_loop(self, block_type: object) -> None:
        self.structure_block(block_type, "loop")

    def structure_if(self, block_type: object) -> None:
        self.structure_block(block_type, "if")

    def structure_else(self) -> None:
        block = self.blocks[-1]
        if not block.live:
            return
        if self.reachable:
            self.materialize_all()
            block.fixups.append(self.emit(Op.BR, cost=0))
        self.patch(block.else_fixup, self.here())
        block.else_fixup = None
        self.set_height(block.height + block.param_count)
        self.reachable = True

    def structure_end(self) -> None:
        block = self.blocks[-1]
        if self.reachable:
            self.materialize_all()
        if block.kind == "func" and self.reachable:
            self.emit_return(cost=0)
        self.blocks.pop()
        if not block.live or block.kind == "func":
            return
        for position in block.fixups + ([block.else_fixup] if block.else_fixup is not None else []):
            self.patch(position, self.here())
        self.set_height(block.height + block.result_count)
        self.mark_target()
        self.reachable = True

    # Branches ---------------------------------------------------------------------------------

    def sources(self, count: int) -> list[int]:
        return [self.slot(self.height - count + index) for index in range(count)]

    def moves_for(self, depth: int) -> list[tuple[int, int]]:
        """(destination, source) registers that carry the label's values to the target block."""
        block = self.blocks[-1 - depth]
        if block.kind == "func":  # results 1.. move down; RETURN itself writes result 0 over the link
            return [(index, source) for index, source in enumerate(self.sources(block.label_arity)) if index]
        first = self.slot(block.height)
        return [(first + index, source) for index, source in enumerate(self.sources(block.label_arity))
                if first + index != source]

    def emit_jump(self, depth: int, cost: int) -> None:
        """Moves then the jump to label ``depth`` (a return for the function's own label)."""
        block = self.blocks[-1 - depth]
        if block.kind == "func":
            results = self.sources(block.label_arity)
            first = results[0] if results else 0
            if first in range(1, len(results)):  # a move below overwrites it: keep it above the stack first
                self.max_height = max(self.max_height, self.height + 1)
                self.emit(Op.MOV, dst=self.slot(self.height), a=first, cost=0)
                first = self.slot(self.height)
            for destination, source in self.moves_for(depth):
                self.emit(Op.MOV, dst=destination, a=source, cost=0)
            self.emit(Op.RETURN, dst=0 if results else NO_WRITE, a=0, c=first, cost=cost)
            return
        for destination, source in self.moves_for(depth):
            self.emit(Op.MOV, dst=destination, a=source, cost=0)
        if block.kind == "loop":
            self.emit(Op.BR, imm=block.start, cost=cost)
        else:
            block.fixups.append(self.emit(Op.BR, cost=cost))

    def emit_return(self, cost: int) -> None:
        self.emit_jump(len(self.blocks) - 1, cost)

    def op_br(self, depth: int) -> None:
        self.materialize_all()
        self.emit_jump(depth, cost=1)
        self.reachable = False

    def op_br_if(self, depth: int) -> None:
        condition, folded = self.take_condition()
        self.set_height(self.height - 1)
        self.materialize_all()
        block = self.blocks[-1 - depth]
        if not self.moves_for(depth) and block.kind != "func":
            position = self.emit(Op.BR_IF, **condition, imm=block.start if block.kind == "loop" else 0,
                                 cost=1 + folded)
            if block.kind != "loop":
                block.fixups.append(position)
            return
        skip = self.emit(Op.BR_UNLESS, **condition, cost=1 + folded)
        self.emit_jump(depth, cost=0)
        self.patch(skip, self.here())

    def op_br_table(self, depths: tuple[int, ...], default: int) -> None:
        (index,), folded = self.take(1)
        self.set_height(self.height - 1)
        self.materialize_all()
        targets = [*depths, default]
        self.emit(Op.BR_TABLE, a=index, imm2=len(depths), cost=1 + folded)
        stubs = []
        for depth in targets:
            block = self.blocks[-1 - depth]
            if not self.moves_for(depth) and block.kind != "func":
                self.emit_jump(depth, cost=0)
            else:
                stubs.append((self.emit(Op.BR, cost=0), depth))
        for position, depth in stubs:
            self.patch(position, self.here())
            self.emit_jump(depth, cost=0)
        self.reachable = False

    # Other instructions -----------------------------------------------------------------------

    def operation(self, instruction: Instruction) -> None:
        name = instruction.name
        handler = getattr(self, "op_" + name.replace(".", "_"), None)
        if handler is not None:
            handler(*instruction.immediates)
        elif name in NUMERIC_OPS:
            self.numeric(NUMERIC_OPS[name], len(instruction.info.params))
        elif instruction.info.immediate == "memarg":
            self.memory_access(instruction)
        else:
            raise Unsupported(name)

    def op_unreachable(self) -> None:
        self.emit(Op.UNREACHABLE)
        self.reachable = False

    def op_nop(self) -> None:
        pass

    def op_return(self) -> None:
        self.materialize_all()
        self.emit_return(cost=1)
        self.reachable = False

    def op_call(self, function: int) -> None:
        signature = self.module.types[self.function_types[function]]
        base = self.height - len(signature.params)
        if function in self.host_calls:  # arguments stay where they are; the result replaces the first
            self.materialize_all()
            self.emit(Op.HOSTCALL, dst=self.slot(base) if signature.results else NO_WRITE, b=self.slot(base),
                      imm=self.host_calls[function], imm2=len(signature.params))
            self.set_height(base + len(signature.results))
            return
        arguments, _ = self.take(len(signature.params))
        for index in [index for index in self.aliases if index < base]:  # globals may change in the callee
            self.materialize(index)
        self.set_height(self.height + 1)
        for index in reversed(range(len(signature.params))):  # up one register: the callee's link goes first
            folded = self.aliases.pop(base + index, (0, 0))[1]  # an aliased argument's instruction is this move
            self.emit(Op.MOV, dst=self.slot(base + index + 1), a=arguments[index], cost=folded)
        self.calls.append((self.emit(Op.CALL, dst=self.slot(base), b=self.slot(base)), function))
        self.set_height(base + len(signature.results))

    def op_call_indirect(self, _type_index: int) -> None:
        raise Unsupported("call_indirect")

    def op_drop(self) -> None:
        if self.height - 1 in self.aliases:  # keeps the instruction count exact
            self.materialize(self.height - 1)
        self.set_height(self.height - 1)

    def produce(self, op: Op, count: int, **fields) -> None:
        """A record that consumes the top ``count`` entries and pushes its result in their first slot."""
        operands, folded = self.take(count)
        first = self.height - count
        named = dict(zip(("a", "b", "c"), operands, strict=False))
        self.set_height(first)
        self.emit(op, dst=self.slot(first), **named, cost=1 + folded, **fields)
        self.set_height(first + 1)

    def op_select(self) -> None:
        self.produce(Op.SELECT, 3)

    def op_local_get(self, index: int) -> None:
        self.push_alias(self.local(index))

    def op_local_set(self, index: int) -> None:
        self.assign(self.local(index))
        self.set_height(self.height - 1)

    def op_local_tee(self, index: int) -> None:
        self.assign(self.local(index))
        self.aliases[self.height - 1] = (self.local(index), 0)

    def op_global_get(self, index: int) -> None:
        self.push_alias(ABSOLUTE + index)

    def op_global_set(self, index: int) -> None:
        self.assign(ABSOLUTE + index)
        self.set_height(self.height - 1)

    def assign(self, register: int) -> None:
        """local.set / local.tee / global.set of the top entry: retarget the record that computed it when
        nothing else can see the difference, else a move."""
        self.materialize_aliases_of(register)
        top = self.height - 1
        last = self.code[-1] if self.code else None
        if (top not in self.aliases and last is not None and self.here() - 1 >= self.barrier
                and last[FIELD["dst"]] == self.slot(top) and Op(last[FIELD["op"]]) in RETARGETABLE):
            last[FIELD["dst"]] = _as_int32(register)
            last[FIELD["cost"]] += 1
            self.aliases[top] = (register, 0)  # the value now lives in the target (for local.tee)
            return
        (source,), folded = self.take(1)
        self.emit(Op.MOV, dst=register, a=source, cost=1 + folded)

    def constant(self, bits: int) -> None:
        if bits not in self.constants:
            self.constants[bits] = len(self.constants)
        self.push_alias(ABSOLUTE + len(self.module.globals) + self.constants[bits])

    def op_i32_const(self, value: int) -> None:
        self.constant(value & 0xFFFFFFFF)

    def op_i64_const(self, value: int) -> None:
        self.constant(value & 0xFFFFFFFFFFFFFFFF)

    def op_memory_size(self) -> None:
        self.produce(Op.MSIZE, 0)

    def op_memory_grow(self) -> None:
        self.produce(Op.MGROW, 1)

    def numeric(self, op: Op, operands: int) -> None:
        self.produce(op, operands)

    def memory_access(self, instruction: Instruction) -> None:
        info = instruction.info
        if "f32" in info.name or "f64" in info.name:
            raise Unsupported(info.name)
        _align, offset = instruction.immediates
        if info.results:
            self.produce(Op.LOAD, 1, imm=offset, imm2=load_kind(info.name, info.access_bytes))
            return
        (address, value), folded = self.take(2)
        self.set_height(self.height - 2)
        self.emit(Op.STORE, a=address, b=value, imm=offset, imm2=info.access_bytes, cost=1 + folded)


def _as_int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _constant_value(module: Module, expression: tuple[Instruction, ...], global_inits: list[int]) -> int:
    instruction = expression[0]
    if instruction.name == "global.get":
        return global_inits[instruction.immediates[0]]
    if instruction.name in ("i32.const", "i64.const"):
        return instruction.immediates[0] & 0xFFFFFFFFFFFFFFFF
    raise Unsupported(instruction.name)


def _lower_functions(module: Module, function_types: list[int], imported: int, code: list[list[int]],
                     constants: dict[int, int]
                     ) -> tuple[dict[int, FunctionCode], dict[int, str], list[tuple[int, int]]]:
    functions: dict[int, FunctionCode] = {}
    unsupported: dict[int, str] = {}
    calls: list[tuple[int, int]] = []
    host_calls: dict[int, int] = {}
    for index, entry in enumerate(module.imported("func")):
        syscall = SYSCALLS.get(entry.name) if entry.module == WASI_MODULE else None
        signature = module.types[entry.desc]
        if syscall is not None and (signature.params, signature.results) == syscall[1:]:
            host_calls[index] = syscall[0]
        else:
            unsupported[index] = f"imported function {entry.module}.{entry.name}"
    for offset, function in enumerate(module.functions):
        index = imported + offset
        signature = module.types[function.type_index]
        start, call_start = len(code), len(calls)
        lowering = _FunctionLowering(module, function_types, signature.params, function.local_types,
                                     signature.results, code, calls, host_calls, constants)
        try:
            frame_size = lowering.lower(function.body)
        except Unsupported as error:
            del code[start:]
            del calls[call_start:]
            unsupported[index] = str(error)
            continue
        functions[index] = FunctionCode(start, frame_size, signature.params, signature.results)
    return functions, unsupported, calls


def _propagate_unsupported(code: list[list[int]], functions: dict[int, FunctionCode], unsupported: dict[int, str],
                           calls: list[tuple[int, int]]) -> None:
    """A function that calls an unsupported one cannot run either (its code stays, never entered).

    One pass over the calls finds each call's caller (the function whose code holds it), then a
    worklist walks the callers of each unsupported function: linear in calls and functions, so a
    long call chain written by a model cannot stall the engine thread."""
    owners = sorted((code_.entry, index) for index, code_ in functions.items())
    entries = [entry for entry, _ in owners]
    callers: dict[int, list[int]] = {}
    for position, callee in calls:
        at = bisect.bisect_right(entries, position) - 1
        if at >= 0:
            callers.setdefault(callee, []).append(owners[at][1])
    work = list(unsupported)
    while work:
        callee = work.pop()
        for caller in callers.get(callee, ()):
            if caller not in unsupported:
                unsupported[caller] = unsupported[callee]
                work.append(caller)
    for index in unsupported:
        functions.pop(index, None)


def lower(module: Module) -> Program:
    """Lower a validated module (see validate.validate)."""
    function_types = [entry.desc for entry in module.imported("func")] + list(module.function_types)
    imported = len(module.imported("func"))
    code: list[list[int]] = []
    constants: dict[int, int] = {}
    functions, unsupported, calls = _lower_functions(module, function_types, imported, code, constants)
    for position, callee in calls:
        target = functions.get(callee)
        if target is not None:
            code[position][FIELD["imm"]] = target.entry
            code[position][FIELD["imm2"]] = target.frame_size
    _propagate_unsupported(code, functions, unsupported, calls)
    global_types, global_inits = _globals(module)
    memory = module.memories[0] if module.memories else None
    data = [(_constant_value(module, segment.offset, global_inits) & 0xFFFFFFFF, segment.payload)
            for segment in module.data]
    return Program(
        code=np.array(code, np.int32).reshape(-1, RECORD_WIDTH),
        functions=functions,
        unsupported=unsupported,
        exports=module.exports,
        global_types=global_types,
        global_inits=global_inits,
        memory=(memory.minimum, memory.maximum) if memory else None,
        data=data,
        start=module.start,
        constants=sorted(constants, key=constants.get),
    )


def _globals(module: Module) -> tuple[list[tuple[str, bool]], list[int]]:
    if module.imported("global"):
        raise Unsupported("imported global")
    if module.imported("memory") or module.imported("table"):
        raise Unsupported(f"imported {'memory' if module.imported('memory') else 'table'}")
    types, inits = [], []
    for entry in module.globals:
        if entry.value_type in "fF":
            types.append((entry.value_type, entry.mutable))
            inits.append(entry.init[0].immediates[0] if entry.init[0].name.startswith("f") else 0)
            continue
        types.append((entry.value_type, entry.mutable))
        inits.append(_constant_value(module, entry.init, inits))
    return types, inits
