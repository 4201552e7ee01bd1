"""Decoder for the WebAssembly binary format (1.0 sections, instructions with their immediates).

Text modules are first turned into binary by wasmtime's ``wat2wasm``; everything after that reads
the binary through this module, so there is one front end whatever the input was.
"""

from __future__ import annotations

import struct

from jaxinfer.processor.opcodes import OPCODES, VALUE_TYPE_BYTES, OpInfo
from jaxinfer.processor.wasm_module import (  # re-exported: the decoder's importers read them from here
    Function,
    FuncType,
    Global,
    Import,
    Instruction,
    Limits,
    Module,
    Segment,
)

__all__ = ["FuncType", "Function", "Global", "Import", "Instruction", "LimitExceeded", "Limits",
           "MalformedModule", "Module", "Segment", "Unsupported", "decode", "read_expression"]

MAGIC = b"\x00asm"
VERSION = b"\x01\x00\x00\x00"


class MalformedModule(ValueError):
    """The bytes are not a well-formed WebAssembly binary."""


class Unsupported(ValueError):
    """Needs an instruction or feature the machine does not implement (floats, indirect calls, and the
    encodings of later proposals: reference types, bulk memory, SIMD, multiple memories, ...)."""


class LimitExceeded(Unsupported):
    """Needs more than this machine's limits allow (memory pages, code records, registers); the
    message names the setting."""


# Opcodes of proposals after 1.0 (besides sign extension): decoded as far as to name them, never run.
LATER_OPCODES = {
    0x06: "try", 0x07: "catch", 0x08: "throw", 0x09: "rethrow", 0x0A: "throw_ref", 0x12: "return_call",
    0x13: "return_call_indirect", 0x14: "call_ref", 0x15: "return_call_ref", 0x18: "delegate", 0x19: "catch_all",
    0x1C: "select (typed)", 0x1F: "try_table", 0x25: "table.get", 0x26: "table.set", 0xD0: "ref.null",
    0xD1: "ref.is_null", 0xD2: "ref.func", 0xD3: "ref.eq", 0xD4: "ref.as_non_null", 0xD5: "br_on_null",
    0xD6: "br_on_non_null", 0xFB: "a GC instruction", 0xFC: "a bulk memory or saturating conversion instruction",
    0xFD: "a SIMD instruction", 0xFE: "a threads instruction",
}
LATER_TYPES = {0x7B: "v128", 0x70: "funcref", 0x6F: "externref", 0x64: "(ref ...)", 0x63: "(ref null ...)",
               **{code: "a reference type" for code in range(0x65, 0x75) if code not in (0x6F, 0x70)}}


class _Reader:
    def __init__(self, data: bytes, position: int = 0, end: int | None = None) -> None:
        self.data = data
        self.position = position
        self.end = len(data) if end is None else end

    def at_end(self) -> bool:
        return self.position >= self.end

    def byte(self) -> int:
        if self.position >= self.end:
            raise MalformedModule("unexpected end")
        value = self.data[self.position]
        self.position += 1
        return value

    def raw(self, count: int) -> bytes:
        if self.position + count > self.end:
            raise MalformedModule("unexpected end")
        chunk = self.data[self.position : self.position + count]
        self.position += count
        return bytes(chunk)

    def _leb128(self, bits: int) -> tuple[int, int, int]:
        """The groups of a LEB128 number of at most ``bits`` bits: (value, bits read, last byte)."""
        result = shift = 0
        for _ in range((bits + 6) // 7):
            value = self.byte()
            result |= (value & 0x7F) << shift
            shift += 7
            if not value & 0x80:
                return result, shift, value
        raise MalformedModule("integer representation too long")

    def unsigned(self, bits: int = 32) -> int:
        result, _, _ = self._leb128(bits)
        if result >= 1 << bits:
            raise MalformedModule("integer too large")
        return result

    def signed(self, bits: int) -> int:
        result, shift, last = self._leb128(bits)
        if last & 0x40:
            result -= 1 << shift
        if not -(1 << (bits - 1)) <= result < 1 << (bits - 1):
            raise MalformedModule("integer too large")
        return result

    def name(self) -> str:
        try:
            return self.raw(self.unsigned()).decode("utf-8")
        except UnicodeDecodeError as error:
            raise MalformedModule("malformed UTF-8 encoding") from error

    def vector(self, read_item) -> list:
        return [read_item() for _ in range(self.unsigned())]

    def value_type(self) -> str:
        code = self.byte()
        if code in LATER_TYPES:
            raise Unsupported(f"the value type {LATER_TYPES[code]}")
        if code not in VALUE_TYPE_BYTES:
            raise MalformedModule(f"malformed value type 0x{code:02x}")
        return VALUE_TYPE_BYTES[code]

    def limits(self) -> Limits:
        flag = self.byte()
        if flag in (2, 3, 4, 5, 6, 7):
            raise Unsupported("shared or 64-bit memory limits" if flag < 8 else "memory limits")
        if flag not in (0, 1):
            raise MalformedModule("integer too large")
        minimum = self.unsigned()
        return Limits(minimum, self.unsigned() if flag else None)


def _read_block_type(reader: _Reader) -> object:
    code = reader.data[reader.position] if reader.position < reader.end else None
    if code in LATER_TYPES:
        raise Unsupported(f"the value type {LATER_TYPES[code]}")
    if code == 0x40:
        reader.position += 1
        return ""
    if code in VALUE_TYPE_BYTES:
        reader.position += 1
        return VALUE_TYPE_BYTES[code]
    index = reader.signed(33)
    if index < 0:
        raise MalformedModule("malformed block type")
    return index


def _read_immediates(reader: _Reader, info: OpInfo) -> tuple:
    kind = info.immediate
    if kind == "":
        return ()
    if kind == "block":
        return (_read_block_type(reader),)
    if kind in ("label", "func", "local", "global"):
        return (reader.unsigned(),)
    if kind == "labels":
        return (tuple(reader.vector(reader.unsigned)), reader.unsigned())
    if kind == "indirect":
        type_index = reader.unsigned()
        if reader.byte() != 0:
            raise MalformedModule("zero byte expected")
        return (type_index,)
    if kind == "memarg":
        flags = reader.unsigned()
        if flags >= 0x80:
            raise MalformedModule("malformed memop flags")
        if flags & 0x40:  # multiple memories: a memory index follows
            if reader.unsigned() != 0:
                raise Unsupported("multiple memories")
            flags &= ~0x40
        return (flags, reader.unsigned(64))
    if kind == "zero":
        if reader.byte() != 0:
            raise MalformedModule("zero byte expected")
        return ()
    if kind == "i32":
        return (reader.signed(32),)
    if kind == "i64":
        return (reader.signed(64),)
    if kind == "f32":
        return (struct.unpack("<I", reader.raw(4))[0],)
    return (struct.unpack("<Q", reader.raw(8))[0],)


def read_expression(reader: _Reader) -> tuple[Instruction, ...]:
    """Instructions up to and including the ``end`` that closes the expression."""
    instructions = []
    depth = 0
    while True:
        code = reader.byte()
        info = OPCODES.get(code)
        if info is None:
            if code in LATER_OPCODES:
                raise Unsupported(LATER_OPCODES[code])
            raise MalformedModule(f"illegal opcode 0x{code:02x}")
        instructions.append(Instruction(info, _read_immediates(reader, info)))
        if info.name in ("block", "loop", "if"):
            depth += 1
        elif info.name == "end":
            if depth == 0:
                return tuple(instructions)
            depth -= 1


def _read_code_entry(reader: _Reader) -> tuple[str, tuple[Instruction, ...]]:
    size = reader.unsigned()
    body = _Reader(reader.data, reader.position, reader.position + size)
    if body.end > reader.end:
        raise MalformedModule("unexpected end")
    local_types = []
    total = 0
    for _ in range(body.unsigned()):
        count = body.unsigned()
        total += count
        if total > 50_000:
            raise MalformedModule("too many locals")
        local_types.append(body.value_type() * count)
    instructions = read_expression(body)
    if not body.at_end():
        raise MalformedModule("section size mismatch")
    reader.position = body.end
    return "".join(local_types), instructions


def _read_import(reader: _Reader) -> Import:
    module, name, kind = reader.name(), reader.name(), reader.byte()
    if kind == 0:
        return Import(module, name, "func", reader.unsigned())
    if kind == 1:
        if reader.byte() != 0x70:
            raise MalformedModule("malformed element type")
        return Import(module, name, "table", reader.limits())
    if kind == 2:
        return Import(module, name, "memory", reader.limits())
    if kind == 3:
        value_type = reader.value_type()
        return Import(module, name, "global", (value_type, _read_mutability(reader)))
    raise MalformedModule("malformed import kind")


def _read_mutability(reader: _Reader) -> bool:
    flag = reader.byte()
    if flag not in (0, 1):
        raise MalformedModule("malformed mutability")
    return bool(flag)


def _read_func_type(reader: _Reader) -> FuncType:
    if reader.byte() != 0x60:
        raise MalformedModule("integer representation too long")
    params = "".join(reader.vector(reader.value_type))
    return FuncType(params, "".join(reader.vector(reader.value_type)))


def _read_table(reader: _Reader) -> Limits:
    kind = reader.byte()
    if kind in (0x6F, 0x64, 0x63, 0x40):
        raise Unsupported("a table of references other than funcref")
    if kind != 0x70:
        raise MalformedModule("malformed element type")
    return reader.limits()


def _read_global(reader: _Reader) -> Global:
    value_type = reader.value_type()
    mutable = _read_mutability(reader)
    return Global(value_type, mutable, read_expression(reader))


def _read_export(reader: _Reader) -> tuple[str, tuple[str, int]]:
    name = reader.name()
    kind = reader.byte()
    if kind > 3:
        raise MalformedModule("malformed export kind")
    return name, (("func", "table", "memory", "global")[kind], reader.unsigned())


def _read_element(reader: _Reader) -> Segment:
    flags = reader.unsigned()
    if flags > 7:
        raise MalformedModule("malformed elements segment kind")
    if flags != 0:
        raise Unsupported(f"an element segment of kind {flags} (passive, declarative or typed)")
    offset = read_expression(reader)
    return Segment(0, offset, reader.vector(reader.unsigned))


def _read_data(reader: _Reader) -> Segment | None:
    """An active data segment; a passive one (bulk memory, used only by memory.init) is skipped."""
    flags = reader.unsigned()
    if flags == 1:
        reader.raw(reader.unsigned())
        return None
    if flags == 2 and reader.unsigned() != 0:
        raise Unsupported("multiple memories")
    if flags > 2:
        raise MalformedModule("malformed data segment kind")
    offset = read_expression(reader)
    return Segment(0, offset, reader.raw(reader.unsigned()))


def _read_sections(module: Module, reader: _Reader) -> list[tuple[str, tuple[Instruction, ...]]]:
    codes: list[tuple[str, tuple[Instruction, ...]]] = []
    last_id = 0
    while not reader.at_end():
        section_id = reader.byte()
        size = reader.unsigned()
        section = _Reader(reader.data, reader.position, reader.position + size)
        if section.end > reader.end:
            raise MalformedModule("unexpected end of section or function")
        if section_id != 0:
            if section_id > 11 and section_id != 12:
                raise MalformedModule(f"malformed section id {section_id}")
            if section_id <= last_id:
                raise MalformedModule("unexpected content after last section")
            last_id = section_id
        _read_section(module, section_id, section, codes)
        if not section.at_end():
            raise MalformedModule("section size mismatch")
        reader.position = section.end
    return codes


def _read_section(module: Module, section_id: int, section: _Reader, codes: list) -> None:
    if section_id == 0:
        section.name()
        section.position = section.end
    elif section_id == 1:
        module.types = section.vector(lambda: _read_func_type(section))
    elif section_id == 2:
        module.imports = section.vector(lambda: _read_import(section))
    elif section_id == 3:
        module.function_types = section.vector(section.unsigned)
    elif section_id == 4:
        module.tables = section.vector(lambda: _read_table(section))
    elif section_id == 5:
        module.memories = section.vector(section.limits)
    elif section_id == 6:
        module.globals = section.vector(lambda: _read_global(section))
    elif section_id == 7:
        exports = section.vector(lambda: _read_export(section))
        module.exports = dict(exports)
        if len(module.exports) != len(exports):
            raise MalformedModule("duplicate export name")
    elif section_id == 8:
        module.start = section.unsigned()
    elif section_id == 9:
        module.elements = section.vector(lambda: _read_element(section))
    elif section_id == 10:
        codes.extend(section.vector(lambda: _read_code_entry(section)))
    elif section_id == 11:
        module.data = [segment for segment in section.vector(lambda: _read_data(section)) if segment is not None]
    else:
        section.unsigned()


def decode(data: bytes) -> Module:
    """Decode a binary module; raises MalformedModule with the spec's wording where it has one."""
    data = bytes(data)
    if data[:4] != MAGIC:
        raise MalformedModule("magic header not detected")
    if data[4:8] != VERSION:
        raise MalformedModule("unknown binary version")
    module = Module()
    codes = _read_sections(module, _Reader(data, 8))
    if len(codes) != len(module.function_types):
        raise MalformedModule("function and code section have inconsistent lengths")
    module.functions = [
        Function(type_index, local_types, body)
        for type_index, (local_types, body) in zip(module.function_types, codes, strict=True)
    ]
    return module
