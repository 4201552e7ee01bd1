"""The WebAssembly 1.0 instruction set (plus sign-extension ops): opcode bytes, immediates, types.

One table drives the decoder (which immediates follow an opcode), the validator (the operand
types an instruction pops and pushes) and the lowering (which instructions the machine runs).
Types are single letters: ``i`` i32, ``I`` i64, ``f`` f32, ``F`` f64.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

VALUE_TYPE_BYTES = {0x7F: "i", 0x7E: "I", 0x7D: "f", 0x7C: "F"}
TYPE_NAMES = {"i": "i32", "I": "i64", "f": "f32", "F": "f64"}


@dataclass(frozen=True)
class OpInfo:
    """One opcode: its text name, the kind of immediate after it, and its stack signature."""

    name: str
    # "", "block", "label", "labels", "func", "indirect", "local", "global", "memarg", "zero", or a value type name
    immediate: str
    params: str = ""
    results: str = ""
    special: bool = False  # typing handled by the validator's own rule (control, locals, calls, ...)

    @property
    def access_bytes(self) -> int:
        """Bytes a load or store touches: the width in its name, else its value type's size."""
        match = re.search(r"(?:load|store)(8|16|32)", self.name)
        if match:
            return int(match.group(1)) // 8
        return 8 if self.name[1:3] == "64" else 4


def _table() -> dict[int, OpInfo]:
    ops: dict[int, OpInfo] = {}

    def add(code: int, name: str, immediate: str = "", sig: str = "", special: bool = False) -> None:
        params, _, results = sig.partition(":")
        ops[code] = OpInfo(name, immediate, params, results, special)

    for code, name, imm in [
        (0x00, "unreachable", ""), (0x01, "nop", ""), (0x02, "block", "block"), (0x03, "loop", "block"),
        (0x04, "if", "block"), (0x05, "else", ""), (0x0B, "end", ""), (0x0C, "br", "label"),
        (0x0D, "br_if", "label"), (0x0E, "br_table", "labels"), (0x0F, "return", ""), (0x10, "call", "func"),
        (0x11, "call_indirect", "indirect"), (0x1A, "drop", ""), (0x1B, "select", ""),
        (0x20, "local.get", "local"), (0x21, "local.set", "local"), (0x22, "local.tee", "local"),
        (0x23, "global.get", "global"), (0x24, "global.set", "global"),
        (0x3F, "memory.size", "zero"), (0x40, "memory.grow", "zero"),
    ]:
        add(code, name, imm, special=True)
    loads = ["i32.load:i", "i64.load:I", "f32.load:f", "f64.load:F", "i32.load8_s:i", "i32.load8_u:i",
             "i32.load16_s:i", "i32.load16_u:i", "i64.load8_s:I", "i64.load8_u:I", "i64.load16_s:I",
             "i64.load16_u:I", "i64.load32_s:I", "i64.load32_u:I"]
    for offset, entry in enumerate(loads):
        name, result = entry.split(":")
        add(0x28 + offset, name, "memarg", "i:" + result)
    stores = ["i32.store:i", "i64.store:I", "f32.store:f", "f64.store:F", "i32.store8:i", "i32.store16:i",
              "i64.store8:I", "i64.store16:I", "i64.store32:I"]
    for offset, entry in enumerate(stores):
        name, value = entry.split(":")
        add(0x36 + offset, name, "memarg", "i" + value + ":")
    add(0x41, "i32.const", "i32", ":i")
    add(0x42, "i64.const", "i64", ":I")
    add(0x43, "f32.const", "f32", ":f")
    add(0x44, "f64.const", "f64", ":F")
    int_compares = ["eq", "ne", "lt_s", "lt_u", "gt_s", "gt_u", "le_s", "le_u", "ge_s", "ge_u"]
    float_compares = ["eq", "ne", "lt", "gt", "le", "ge"]
    add(0x45, "i32.eqz", "", "i:i")
    for offset, name in enumerate(int_compares):
        add(0x46 + offset, "i32." + name, "", "ii:i")
    add(0x50, "i64.eqz", "", "I:i")
    for offset, name in enumerate(int_compares):
        add(0x51 + offset, "i64." + name, "", "II:i")
    for offset, name in enumerate(float_compares):
        add(0x5B + offset, "f32." + name, "", "ff:i")
        add(0x61 + offset, "f64." + name, "", "FF:i")
    int_unary = ["clz", "ctz", "popcnt"]
    int_binary = ["add", "sub", "mul", "div_s", "div_u", "rem_s", "rem_u", "and", "or", "xor", "shl", "shr_s",
                  "shr_u", "rotl", "rotr"]
    for base, prefix, t in ((0x67, "i32.", "i"), (0x79, "i64.", "I")):
        for offset, name in enumerate(int_unary):
            add(base + offset, prefix + name, "", f"{t}:{t}")
        for offset, name in enumerate(int_binary):
            add(base + 3 + offset, prefix + name, "", f"{t}{t}:{t}")
    float_unary = ["abs", "neg", "ceil", "floor", "trunc", "nearest", "sqrt"]
    float_binary = ["add", "sub", "mul", "div", "min", "max", "copysign"]
    for base, prefix, t in ((0x8B, "f32.", "f"), (0x99, "f64.", "F")):
        for offset, name in enumerate(float_unary):
            add(base + offset, prefix + name, "", f"{t}:{t}")
        for offset, name in enumerate(float_binary):
            add(base + 7 + offset, prefix + name, "", f"{t}{t}:{t}")
    conversions = [
        "i32.wrap_i64:I:i", "i32.trunc_f32_s:f:i", "i32.trunc_f32_u:f:i", "i32.trunc_f64_s:F:i",
        "i32.trunc_f64_u:F:i", "i64.extend_i32_s:i:I", "i64.extend_i32_u:i:I", "i64.trunc_f32_s:f:I",
        "i64.trunc_f32_u:f:I", "i64.trunc_f64_s:F:I", "i64.trunc_f64_u:F:I", "f32.convert_i32_s:i:f",
        "f32.convert_i32_u:i:f", "f32.convert_i64_s:I:f", "f32.convert_i64_u:I:f", "f32.demote_f64:F:f",
        "f64.convert_i32_s:i:F", "f64.convert_i32_u:i:F", "f64.convert_i64_s:I:F", "f64.convert_i64_u:I:F",
        "f64.promote_f32:f:F", "i32.reinterpret_f32:f:i", "i64.reinterpret_f64:F:I", "f32.reinterpret_i32:i:f",
        "f64.reinterpret_i64:I:F", "i32.extend8_s:i:i", "i32.extend16_s:i:i", "i64.extend8_s:I:I",
        "i64.extend16_s:I:I", "i64.extend32_s:I:I",
    ]
    for offset, entry in enumerate(conversions):
        name, params, results = entry.split(":")
        add(0xA7 + offset, name, "", f"{params}:{results}")
    return ops


OPCODES: dict[int, OpInfo] = _table()
BY_NAME: dict[str, OpInfo] = {info.name: info for info in OPCODES.values()}
