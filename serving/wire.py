"""Request decoding that names the field at fault: protobuf says only "bad UTF-8", clients need the field.

The servicer's methods are registered with `lenient(Message)` as their deserializer: a request that
does not parse becomes an `Undecodable` carrying a message such as
`chat.messages.content: invalid UTF-8`, which the method returns as INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_I32 = 0, 1, 2, 5


@dataclass(frozen=True)
class Undecodable:
    error: str


def lenient(message_type: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Undecodable(bad_field(message_type.DESCRIPTOR, data) or f"request: {exc}")

    return deserialize


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def bad_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The dotted path of the first string field holding invalid UTF-8, with the reason; None if none found."""
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == WIRE_VARINT:
                _, pos = _varint(data, pos)
            elif wire in (WIRE_I64, WIRE_I32):
                pos += 8 if wire == WIRE_I64 else 4
            elif wire == WIRE_LEN:
                length, pos = _varint(data, pos)
                chunk, pos = data[pos : pos + length], pos + length
                field = descriptor.fields_by_number.get(number)
                found = _check_chunk(field, chunk, prefix) if field is not None else None
                if found:
                    return found
            else:
                return f"{prefix or 'request'}: malformed wire data"
    except ValueError:
        return f"{prefix or 'request'}: truncated"
    return None


def _check_chunk(field: FieldDescriptor, chunk: bytes, prefix: str) -> str | None:
    path = f"{prefix}{field.name}"
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"{path}: invalid UTF-8 at byte {exc.start}"
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        return bad_field(field.message_type, chunk, f"{path}.")
    return None
