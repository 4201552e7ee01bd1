"""The exec protocol in generation: control tokens, the program a sequence wrote, the text written back.

The model writes ``<|exec|>`` + a WebAssembly text module + ``<|/exec|>``; the engine runs the
module's exported ``main`` (or ``_start``) and appends ``<|result|>`` + the results + ``<|/result|>``,
or ``<|trap|>`` + the reason + ``<|/trap|>``. Only the engine writes the result and trap markers:
they are never sampled, and user text cannot produce any of the six (the tokenizer guard encodes
forged markers as plain text).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

EXEC_OPEN, EXEC_CLOSE = "<|exec|>", "<|/exec|>"
RESULT_OPEN, RESULT_CLOSE = "<|result|>", "<|/result|>"
TRAP_OPEN, TRAP_CLOSE = "<|trap|>", "<|/trap|>"
CONTROL_TOKENS = (EXEC_OPEN, EXEC_CLOSE, RESULT_OPEN, RESULT_CLOSE, TRAP_OPEN, TRAP_CLOSE)
ENTRY_POINTS = ("main", "_start")


@dataclass(frozen=True)
class ExecTokens:
    """The control tokens' ids in one tokenizer."""

    exec_open: int
    exec_close: int
    result_open: int
    result_close: int
    trap_open: int
    trap_close: int

    @classmethod
    def from_ids(cls, ids: dict[str, int]) -> ExecTokens:
        return cls(*(ids[name] for name in CONTROL_TOKENS))

    @property
    def engine_written(self) -> tuple[int, ...]:
        """Ids only the engine may write: never sampled."""
        return (self.result_open, self.result_close, self.trap_open, self.trap_close)

    @property
    def all(self) -> tuple[int, ...]:
        return (self.exec_open, self.exec_close, *self.engine_written)


def program_ids(token_ids: list[int], tokens: ExecTokens) -> list[int] | None:
    """The ids between the last ``<|exec|>`` and the closing ``<|/exec|>`` that ends ``token_ids``."""
    if not token_ids or token_ids[-1] != tokens.exec_close:
        return None
    for position in range(len(token_ids) - 2, -1, -1):
        if token_ids[position] == tokens.exec_open:
            return token_ids[position + 1 : -1]
        if token_ids[position] in (tokens.exec_close, *tokens.engine_written):
            return None
    return None


def signed(value: int, value_type: str) -> int:
    """A result's bit pattern as the signed integer a reader expects."""
    bits = 32 if value_type == "i" else 64
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def result_text(values: list[int], value_types: str, stdout: bytes = b"") -> str:
    """The text between ``<|result|>`` and ``<|/result|>``: results as signed decimals, then stdout."""
    parts = [" ".join(str(signed(value, kind)) for value, kind in zip(values, value_types, strict=True))]
    if stdout:
        parts.append(stdout.decode("utf-8", errors="replace"))
    return "\n".join(part for part in parts if part)


def module_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()
