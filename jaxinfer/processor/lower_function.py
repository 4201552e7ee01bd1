"""Lowering one validated function body to micro-ISA records (isa.py), instruction by instruction:
blocks, branches, calls, locals and globals, constants, numeric and memory instructions.

A ``local.set`` right after a computation retargets that record's destination. A call shifts its
arguments up one register (moves of cost 0) to make room for the callee's link; RETURN reads the
link and writes the first result over it in the same record. Branches that carry values become
explicit moves followed by a jump; ``br_table`` becomes an indexed jump into a table of jumps. Code
after an unconditional branch is not emitted. An instruction the machine does not run raises
Unsupported with its name. A call to an imported WASI function is a HOSTCALL record.
"""

from __future__ import annotations

from jaxinfer.processor.binary import Instruction, Unsupported
from jaxinfer.processor.isa import ABSOLUTE, FIELD, NO_WRITE, NUMERIC_OPS, Op, load_kind
from jaxinfer.processor.lower_frame import Block, FrameLowering, as_int32
from jaxinfer.processor.validate import block_signature

# Records that only compute their destination: a local.set right after one can take over its dst.
RETARGETABLE = frozenset(op for op in Op if op.name.startswith(("I32_", "I64_"))) | {
    Op.SELECT, Op.LOAD, Op.MSIZE, Op.MGROW, Op.MOV}


class FunctionLowering(FrameLowering):
    """Lowers one function body; ``calls`` collects CALL records to patch once all are lowered."""

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
            self.blocks.append(Block(kind, self.height, 0, 0, 0, live=False))
            return
        condition: dict[str, int] = {}
        if kind == "if":
            condition, folded = self.take_condition()
            self.set_height(self.height - 1)
        self.materialize_all()
        block = Block(kind, self.height - params, params if kind == "loop" else results, results, params,
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
            last[FIELD["dst"]] = as_int32(register)
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
