"""Lowering a validated module to a ``Program``: each function through lower_function, calls patched
to their callees' entries, unsupported functions and their callers recorded, globals, memory and
data segments collected.

A function that uses an instruction the machine does not run (floats, indirect calls, imports other
than the WASI subset of wasi.py) is recorded as unsupported with the instruction's name, and so is
every function that calls it.
"""

from __future__ import annotations

import bisect

import numpy as np

from jaxinfer.processor.binary import Instruction, Module, Unsupported
from jaxinfer.processor.isa import FIELD, RECORD_WIDTH
from jaxinfer.processor.lower_function import FunctionLowering
from jaxinfer.processor.program import FunctionCode, Program
from jaxinfer.processor.wasi import SYSCALLS, WASI_MODULE


def _constant_value(module: Module, expression: tuple[Instruction, ...], global_inits: list[int]) -> int:
    instruction = expression[0]
    if instruction.name == "global.get":
        return global_inits[instruction.immediates[0]]
    if instruction.name in ("i32.const", "i64.const"):
        return instruction.immediates[0] & 0xFFFFFFFFFFFFFFFF
    raise Unsupported(instruction.name)


def _lower_functions(module: Module, function_types: list[int], imported: int, code: list[list[int]],
                     constants: dict[int, int]
                     ) -> tuple[dict[int, FunctionCode], dict[int, str], list[tuple[int, int]]]:
    functions: dict[int, FunctionCode] = {}
    unsupported: dict[int, str] = {}
    calls: list[tuple[int, int]] = []
    host_calls: dict[int, int] = {}
    for index, entry in enumerate(module.imported("func")):
        syscall = SYSCALLS.get(entry.name) if entry.module == WASI_MODULE else None
        signature = module.types[entry.desc]
        if syscall is not None and (signature.params, signature.results) == syscall[1:]:
            host_calls[index] = syscall[0]
        else:
            unsupported[index] = f"imported function {entry.module}.{entry.name}"
    for offset, function in enumerate(module.functions):
        index = imported + offset
        signature = module.types[function.type_index]
        start, call_start = len(code), len(calls)
        lowering = FunctionLowering(module, function_types, signature.params, function.local_types,
                                     signature.results, code, calls, host_calls, constants)
        try:
            frame_size = lowering.lower(function.body)
        except Unsupported as error:
            del code[start:]
            del calls[call_start:]
            unsupported[index] = str(error)
            continue
        functions[index] = FunctionCode(start, frame_size, signature.params, signature.results)
    return functions, unsupported, calls


def _propagate_unsupported(code: list[list[int]], functions: dict[int, FunctionCode], unsupported: dict[int, str],
                           calls: list[tuple[int, int]]) -> None:
    """A function that calls an unsupported one cannot run either (its code stays, never entered).

    One pass over the calls finds each call's caller (the function whose code holds it), then a
    worklist walks the callers of each unsupported function: linear in calls and functions, so a
    long call chain written by a model cannot stall the engine thread."""
    owners = sorted((code_.entry, index) for index, code_ in functions.items())
    entries = [entry for entry, _ in owners]
    callers: dict[int, list[int]] = {}
    for position, callee in calls:
        at = bisect.bisect_right(entries, position) - 1
        if at >= 0:
            callers.setdefault(callee, []).append(owners[at][1])
    work = list(unsupported)
    while work:
        callee = work.pop()
        for caller in callers.get(callee, ()):
            if caller not in unsupported:
                unsupported[caller] = unsupported[callee]
                work.append(caller)
    for index in unsupported:
        functions.pop(index, None)


def lower(module: Module) -> Program:
    """Lower a validated module (see validate.validate)."""
    function_types = [entry.desc for entry in module.imported("func")] + list(module.function_types)
    imported = len(module.imported("func"))
    code: list[list[int]] = []
    constants: dict[int, int] = {}
    functions, unsupported, calls = _lower_functions(module, function_types, imported, code, constants)
    for position, callee in calls:
        target = functions.get(callee)
        if target is not None:
            code[position][FIELD["imm"]] = target.entry
            code[position][FIELD["imm2"]] = target.frame_size
    _propagate_unsupported(code, functions, unsupported, calls)
    global_types, global_inits = _globals(module)
    memory = module.memories[0] if module.memories else None
    data = [(_constant_value(module, segment.offset, global_inits) & 0xFFFFFFFF, segment.payload)
            for segment in module.data]
    return Program(
        code=np.array(code, np.int32).reshape(-1, RECORD_WIDTH),
        functions=functions,
        unsupported=unsupported,
        exports=module.exports,
        global_types=global_types,
        global_inits=global_inits,
        memory=(memory.minimum, memory.maximum) if memory else None,
        data=data,
        start=module.start,
        constants=sorted(constants, key=constants.get),
    )


def _globals(module: Module) -> tuple[list[tuple[str, bool]], list[int]]:
    if module.imported("global"):
        raise Unsupported("imported global")
    if module.imported("memory") or module.imported("table"):
        raise Unsupported(f"imported {'memory' if module.imported('memory') else 'table'}")
    types, inits = [], []
    for entry in module.globals:
        if entry.value_type in "fF":
            types.append((entry.value_type, entry.mutable))
            inits.append(entry.init[0].immediates[0] if entry.init[0].name.startswith("f") else 0)
            continue
        types.append((entry.value_type, entry.mutable))
        inits.append(_constant_value(module, entry.init, inits))
    return types, inits
