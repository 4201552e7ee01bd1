"""Validation of a decoded module by the WebAssembly typing rules (the spec's validation algorithm).

Every instruction of the 1.0 set is typed here, floats included, so a module that mixes float and
integer functions validates as a whole; which functions the machine can run is the lowering's
business. Errors use the spec tests' wording ("type mismatch", "unknown local", ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxinfer.processor.binary import FuncType, Instruction, Limits, Module

MAX_PAGES = 65536
CONSTANT_OPS = {"i32.const", "i64.const", "f32.const", "f64.const", "global.get"}


class InvalidModule(ValueError):
    """The module is well formed but breaks a validation rule."""


@dataclass
class _Frame:
    kind: str
    params: str
    results: str
    height: int
    unreachable: bool = False

    @property
    def label_types(self) -> str:
        return self.params if self.kind == "loop" else self.results


def block_signature(module: Module, block_type: object) -> FuncType:
    """The [params] -> [results] of a block type: empty, one value type, or a type index."""
    if isinstance(block_type, str):
        return FuncType("", block_type)
    if block_type >= len(module.types):
        raise InvalidModule("unknown type")
    return module.types[block_type]


class _FunctionChecker:
    def __init__(self, context: _Context, locals_: str, results: str) -> None:
        self.context = context
        self.locals = locals_
        self.results = results
        self.stack: list[str | None] = []
        self.frames: list[_Frame] = [_Frame("func", "", results, 0)]

    def push(self, types: str) -> None:
        self.stack.extend(types)

    def pop(self, expected: str | None = None) -> str | None:
        frame = self.frames[-1]
        if len(self.stack) == frame.height:
            if frame.unreachable:
                return expected
            raise InvalidModule("type mismatch")
        actual = self.stack.pop()
        if expected is not None and actual is not None and actual != expected:
            raise InvalidModule("type mismatch")
        return actual if actual is not None else expected

    def pop_types(self, types: str) -> None:
        for value_type in reversed(types):
            self.pop(value_type)

    def enter(self, kind: str, signature: FuncType) -> None:
        self.pop_types(signature.params)
        self.frames.append(_Frame(kind, signature.params, signature.results, len(self.stack)))
        self.push(signature.params)

    def leave(self) -> _Frame:
        frame = self.frames[-1]
        self.pop_types(frame.results)
        if len(self.stack) != frame.height:
            raise InvalidModule("type mismatch")
        return self.frames.pop()

    def mark_unreachable(self) -> None:
        frame = self.frames[-1]
        del self.stack[frame.height :]
        frame.unreachable = True

    def label(self, depth: int) -> _Frame:
        if depth >= len(self.frames):
            raise InvalidModule("unknown label")
        return self.frames[-1 - depth]

    def check(self, body: tuple[Instruction, ...]) -> None:
        for instruction in body:
            if not self.frames:
                raise InvalidModule("unexpected end")
            self.step(instruction)
        if self.frames:
            raise InvalidModule("unexpected end")

    def step(self, instruction: Instruction) -> None:
        info = instruction.info
        handler = getattr(self, "op_" + info.name.replace(".", "_"), None)
        if handler is not None:
            handler(*instruction.immediates)
            return
        if info.immediate == "memarg":
            self.context.require_memory()
            align, offset = instruction.immediates
            if align >= 32 or (1 << align) > info.access_bytes:
                raise InvalidModule("alignment must not be larger than natural")
            if offset >= 1 << 32:
                raise InvalidModule("offset out of range")
        self.pop_types(info.params)
        self.push(info.results)

    def op_unreachable(self) -> None:
        self.mark_unreachable()

    def op_nop(self) -> None:
        pass

    def op_block(self, block_type: object) -> None:
        self.enter("block", block_signature(self.context.module, block_type))

    def op_loop(self, block_type: object) -> None:
        self.enter("loop", block_signature(self.context.module, block_type))

    def op_if(self, block_type: object) -> None:
        self.pop("i")
        self.enter("if", block_signature(self.context.module, block_type))

    def op_else(self) -> None:
        if self.frames[-1].kind != "if":
            raise InvalidModule("else without if")
        frame = self.leave()
        self.frames.append(_Frame("else", frame.params, frame.results, len(self.stack)))
        self.push(frame.params)

    def op_end(self) -> None:
        frame = self.leave()
        if frame.kind == "if" and frame.params != frame.results:
            raise InvalidModule("type mismatch")
        self.push(frame.results)

    def op_br(self, depth: int) -> None:
        self.pop_types(self.label(depth).label_types)
        self.mark_unreachable()

    def op_br_if(self, depth: int) -> None:
        self.pop("i")
        types = self.label(depth).label_types
        self.pop_types(types)
        self.push(types)

    def op_br_table(self, depths: tuple[int, ...], default: int) -> None:
        self.pop("i")
        arity = len(self.label(default).label_types)
        for depth in depths:
            types = self.label(depth).label_types
            if len(types) != arity:
                raise InvalidModule("type mismatch")
            popped = [self.pop(value_type) for value_type in reversed(types)]
            self.stack.extend(reversed(popped))
        self.pop_types(self.label(default).label_types)
        self.mark_unreachable()

    def op_return(self) -> None:
        self.pop_types(self.results)
        self.mark_unreachable()

    def op_call(self, function: int) -> None:
        signature = self.context.function_type(function)
        self.pop_types(signature.params)
        self.push(signature.results)

    def op_call_indirect(self, type_index: int) -> None:
        if not self.context.table_count:
            raise InvalidModule("unknown table")
        if type_index >= len(self.context.module.types):
            raise InvalidModule("unknown type")
        signature = self.context.module.types[type_index]
        self.pop("i")
        self.pop_types(signature.params)
        self.push(signature.results)

    def op_drop(self) -> None:
        self.pop()

    def op_select(self) -> None:
        self.pop("i")
        first = self.pop()
        second = self.pop(first)
        result = first if first is not None else second
        self.stack.append(result)

    def local_type(self, index: int) -> str:
        if index >= len(self.locals):
            raise InvalidModule("unknown local")
        return self.locals[index]

    def op_local_get(self, index: int) -> None:
        self.push(self.local_type(index))

    def op_local_set(self, index: int) -> None:
        self.pop(self.local_type(index))

    def op_local_tee(self, index: int) -> None:
        value_type = self.local_type(index)
        self.pop(value_type)
        self.push(value_type)

    def op_global_get(self, index: int) -> None:
        self.push(self.context.global_type(index)[0])

    def op_global_set(self, index: int) -> None:
        value_type, mutable = self.context.global_type(index)
        if not mutable:
            raise InvalidModule("global is immutable")
        self.pop(value_type)

    def op_memory_size(self) -> None:
        self.context.require_memory()
        self.push("i")

    def op_memory_grow(self) -> None:
        self.context.require_memory()
        self.pop("i")
        self.push("i")


class _Context:
    def __init__(self, module: Module) -> None:
        self.module = module
        self.function_types = [entry.desc for entry in module.imported("func")] + list(module.function_types)
        self.globals = [entry.desc for entry in module.imported("global")] + [
            (entry.value_type, entry.mutable) for entry in module.globals
        ]
        self.imported_globals = len(module.imported("global"))
        self.table_count = len(module.imported("table")) + len(module.tables)
        self.memory_count = len(module.imported("memory")) + len(module.memories)

    def function_type(self, index: int) -> FuncType:
        if index >= len(self.function_types):
            raise InvalidModule("unknown function")
        type_index = self.function_types[index]
        if type_index >= len(self.module.types):
            raise InvalidModule("unknown type")
        return self.module.types[type_index]

    def global_type(self, index: int) -> tuple[str, bool]:
        if index >= len(self.globals):
            raise InvalidModule("unknown global")
        return self.globals[index]

    def require_memory(self) -> None:
        if not self.memory_count:
            raise InvalidModule("unknown memory")


def _check_limits(limits: Limits, bound: int, what: str) -> None:
    if limits.minimum > bound or (limits.maximum is not None and limits.maximum > bound):
        raise InvalidModule(f"{what} size must be at most {bound} pages (4GiB)" if what == "memory"
                            else "table size must be at most 2^32-1")
    if limits.maximum is not None and limits.maximum < limits.minimum:
        raise InvalidModule("size minimum must not be greater than maximum")


def _check_constant(context: _Context, expression: tuple[Instruction, ...], value_type: str,
                    globals_visible: int) -> None:
    body = expression[:-1]
    if any(instruction.name not in CONSTANT_OPS for instruction in body):
        raise InvalidModule("constant expression required")
    for instruction in body:
        if instruction.name == "global.get":
            index = instruction.immediates[0]
            if index >= globals_visible:
                raise InvalidModule("unknown global")
            if context.globals[index][1]:
                raise InvalidModule("constant expression required")
    checker = _FunctionChecker(context, "", value_type)
    checker.check(expression)


def _check_imports_and_tables(context: _Context) -> None:
    module = context.module
    for entry in module.imports:
        if entry.kind == "func" and entry.desc >= len(module.types):
            raise InvalidModule("unknown type")
        if entry.kind == "memory":
            _check_limits(entry.desc, MAX_PAGES, "memory")
    if context.table_count > 1:
        raise InvalidModule("multiple tables")
    if context.memory_count > 1:
        raise InvalidModule("multiple memories")
    for memory in module.memories:
        _check_limits(memory, MAX_PAGES, "memory")
    for table in module.tables:
        _check_limits(table, 2**32 - 1, "table")
    for type_index in module.function_types:
        if type_index >= len(module.types):
            raise InvalidModule("unknown type")


def _check_exports_and_segments(context: _Context) -> None:
    module = context.module
    counts = {"func": len(context.function_types), "table": context.table_count,
              "memory": context.memory_count, "global": len(context.globals)}
    for kind, index in module.exports.values():
        if index >= counts[kind]:
            raise InvalidModule(f"unknown {'function' if kind == 'func' else kind}")
    if module.start is not None:
        signature = context.function_type(module.start)
        if signature.params or signature.results:
            raise InvalidModule("start function")
    for segment in module.elements:
        if not context.table_count:
            raise InvalidModule("unknown table")
        _check_constant(context, segment.offset, "i", context.imported_globals)
        for function in segment.payload:
            context.function_type(function)
    for segment in module.data:
        context.require_memory()
        _check_constant(context, segment.offset, "i", context.imported_globals)


def validate(module: Module) -> None:
    """Raise InvalidModule naming the first rule the module breaks."""
    context = _Context(module)
    _check_imports_and_tables(context)
    for position, entry in enumerate(module.globals):
        _check_constant(context, entry.init, entry.value_type, context.imported_globals + position)
    _check_exports_and_segments(context)
    for function in module.functions:
        signature = module.types[function.type_index]
        checker = _FunctionChecker(context, signature.params + function.local_types, signature.results)
        checker.check(function.body)
