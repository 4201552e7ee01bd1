"""The decoded WebAssembly module: its types, limits, instructions, imports, globals, functions and
segments, as `binary.decode` builds them and the validator, lowering and instance read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxinfer.processor.opcodes import OpInfo


@dataclass(frozen=True)
class FuncType:
    params: str
    results: str


@dataclass(frozen=True)
class Limits:
    minimum: int
    maximum: int | None


@dataclass(frozen=True)
class Instruction:
    info: OpInfo
    immediates: tuple = ()

    @property
    def name(self) -> str:
        return self.info.name


@dataclass(frozen=True)
class Import:
    module: str
    name: str
    kind: str  # "func" | "table" | "memory" | "global"
    desc: object  # type index | Limits | (value type, mutable)


@dataclass(frozen=True)
class Global:
    value_type: str
    mutable: bool
    init: tuple[Instruction, ...]


@dataclass(frozen=True)
class Function:
    type_index: int
    local_types: str
    body: tuple[Instruction, ...]


@dataclass(frozen=True)
class Segment:
    """An element or data segment: the index space it fills, its offset expression and payload."""

    index: int
    offset: tuple[Instruction, ...]
    payload: object  # list of function indices | bytes


@dataclass
class Module:
    types: list[FuncType] = field(default_factory=list)
    imports: list[Import] = field(default_factory=list)
    function_types: list[int] = field(default_factory=list)
    tables: list[Limits] = field(default_factory=list)
    memories: list[Limits] = field(default_factory=list)
    globals: list[Global] = field(default_factory=list)
    exports: dict[str, tuple[str, int]] = field(default_factory=dict)
    start: int | None = None
    elements: list[Segment] = field(default_factory=list)
    data: list[Segment] = field(default_factory=list)
    functions: list[Function] = field(default_factory=list)

    def imported(self, kind: str) -> list[Import]:
        return [entry for entry in self.imports if entry.kind == kind]
