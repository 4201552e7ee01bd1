"""One function's frame while it is lowered: where its link, locals and operand slots live, the
operand stack whose entries may still alias other registers, the open blocks, and the records
emitted so far (``FrameLowering``, the base of lower_function.FunctionLowering).

Register 0 of a frame is its link (return pc, caller frame pointer), written by CALL; local ``k``
is register ``1 + k`` and stack slot ``s`` of a function with ``L`` locals is register
``1 + L + s``. ``local.get``, ``global.get`` and constants are not moves: the record that consumes
them reads the local, the global or the program's constant pool (absolute registers after the
globals) directly. Entries still aliased go to their slots before control flow (moves carrying the
folded cost).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxinfer.processor.binary import Module
from jaxinfer.processor.isa import FIELD, NO_WRITE, RECORD_WIDTH, Op

# Compares a conditional branch right after them can take over (the branch then computes them).
COMPARES = frozenset(op for op in Op if op.name.endswith(("_EQZ", "_EQ", "_NE", "_LT_S", "_LT_U", "_GT_S", "_GT_U",
                                                          "_LE_S", "_LE_U", "_GE_S", "_GE_U")))


@dataclass
class Block:
    kind: str
    height: int  # operand height below the block's params
    label_arity: int
    result_count: int
    param_count: int
    start: int = 0
    fixups: list[int] = field(default_factory=list)
    else_fixup: int | None = None
    live: bool = True


class FrameLowering:
    """The registers, operand stack, blocks and emitted records of one function being lowered."""

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
        self.blocks: list[Block] = [Block("func", 0, len(results), len(results), 0)]
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
            record[FIELD[name]] = as_int32(int(value))
        self.code.append(record)
        return len(self.code) - 1

    def patch(self, position: int, target: int) -> None:
        self.code[position][FIELD["imm"]] = target
        if target == self.here():
            self.mark_target()

    def here(self) -> int:
        return len(self.code)


def as_int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value
