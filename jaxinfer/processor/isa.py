"""The machine's micro-ISA: fixed-width int32 records, register-addressed, branch targets resolved.

WebAssembly's operand stack has a static height at every instruction, so lowering turns each stack
slot into a frame-relative register and each instruction into one record that reads up to three
registers and writes at most one. A record is ``RECORD_WIDTH`` int32 fields:

    op, dst, a, b, c, imm, imm2, cost

``dst``/``a``/``b``/``c`` are register offsets from the frame pointer (``dst = NO_WRITE`` writes
nothing; values from ``ABSOLUTE`` up address globals and the constant pool absolutely).
``imm``/``imm2`` are immediates: a constant's low/high words, a branch target, a memory offset
and access kind, a system call's number and argument count, or (for BR_IF/BR_UNLESS) the op of
a compare folded into the branch, which then branches on compare(a, b) instead of register a. ``cost`` is the number of
WebAssembly instructions the record accounts for: 0 for moves and jumps that lowering adds, more
than 1 when operands (``local.get``, constants) or a ``local.set`` are folded into it. Fuel and
the instruction count measure it.
"""

from __future__ import annotations

import enum

RECORD_WIDTH = 8
NO_WRITE = -1
ABSOLUTE = 1 << 24  # an operand or destination >= ABSOLUTE is register (value - ABSOLUTE): globals, constants
FIELD = {name: index for index, name in enumerate(("op", "dst", "a", "b", "c", "imm", "imm2", "cost"))}

_CONTROL = ["UNREACHABLE", "BR", "BR_IF", "BR_UNLESS", "BR_TABLE", "CALL", "RETURN", "HOSTCALL"]
_DATA = ["CONST", "MOV", "SELECT", "LOAD", "STORE", "MSIZE", "MGROW"]
_UNARY = ["EQZ", "CLZ", "CTZ", "POPCNT", "EXT8", "EXT16"]
_BINARY = ["ADD", "SUB", "MUL", "DIV_S", "DIV_U", "REM_S", "REM_U", "AND", "OR", "XOR", "SHL", "SHR_S", "SHR_U",
           "ROTL", "ROTR", "EQ", "NE", "LT_S", "LT_U", "GT_S", "GT_U", "LE_S", "LE_U", "GE_S", "GE_U"]
_I64_ONLY = ["EXT32", "WRAP", "EXTEND_S", "EXTEND_U"]

Op = enum.IntEnum(
    "Op",
    ["HALT", *_CONTROL, *_DATA]
    + [f"I32_{name}" for name in _UNARY + _BINARY]
    + [f"I64_{name}" for name in _UNARY + _BINARY + _I64_ONLY],
    start=0,
)
Op.__doc__ = "Micro-op codes. I32_*/I64_* are integer operations on 32-bit values and 64-bit pairs."


class Trap(enum.IntEnum):
    """Why a slot stopped early; the message is the WebAssembly spec's wording where it has one."""

    NONE = 0
    UNREACHABLE = 1
    DIVIDE_BY_ZERO = 2
    OVERFLOW = 3
    OUT_OF_BOUNDS = 4
    STACK_EXHAUSTED = 5
    FUEL_EXHAUSTED = 6
    MEMORY_LIMIT = 7
    TIMEOUT = 8
    QUOTA = 9  # set by the host: staged file writes past the tenant's quota

    @property
    def message(self) -> str:
        return _TRAP_MESSAGES[self]


_TRAP_MESSAGES = {
    Trap.NONE: "",
    Trap.UNREACHABLE: "unreachable",
    Trap.DIVIDE_BY_ZERO: "integer divide by zero",
    Trap.OVERFLOW: "integer overflow",
    Trap.OUT_OF_BOUNDS: "out of bounds memory access",
    Trap.STACK_EXHAUSTED: "call stack exhausted",
    Trap.FUEL_EXHAUSTED: "fuel exhausted",
    Trap.MEMORY_LIMIT: "memory limit exceeded",
    Trap.TIMEOUT: "wall timeout",
    Trap.QUOTA: "file quota exceeded",
}


class Status(enum.IntEnum):
    IDLE = 0
    RUNNING = 1
    DONE = 2
    TRAPPED = 3
    SYSCALL = 4  # stopped at a HOSTCALL record until the host serves it and resumes the slot


# LOAD's imm2: bytes | 16 when sign-extended | 32 when the result is i64.
LOAD_SIGNED = 16
LOAD_WIDE = 32


def load_kind(name: str, access_bytes: int) -> int:
    """The LOAD record's access kind for a WebAssembly load instruction name."""
    kind = access_bytes
    if name.endswith("_s"):
        kind |= LOAD_SIGNED
    if name.startswith("i64"):
        kind |= LOAD_WIDE
    return kind


NUMERIC_OPS: dict[str, Op] = {}
for _prefix in ("i32", "i64"):
    for _name in _UNARY[:4] + _BINARY:
        NUMERIC_OPS[f"{_prefix}.{_name.lower()}"] = Op[f"{_prefix.upper()}_{_name}"]
    NUMERIC_OPS[f"{_prefix}.extend8_s"] = Op[f"{_prefix.upper()}_EXT8"]
    NUMERIC_OPS[f"{_prefix}.extend16_s"] = Op[f"{_prefix.upper()}_EXT16"]
NUMERIC_OPS.update({
    "i64.extend32_s": Op.I64_EXT32, "i32.wrap_i64": Op.I64_WRAP,
    "i64.extend_i32_s": Op.I64_EXTEND_S, "i64.extend_i32_u": Op.I64_EXTEND_U,
})
