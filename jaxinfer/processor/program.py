"""The lowered module, a ``Program``: one code array for all its functions, each function's entry and
frame (``FunctionCode``), and what instantiation needs (exports, globals, memory, data, constants).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxinfer.processor.binary import Unsupported


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
