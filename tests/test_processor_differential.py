"""Differential tests of the embedded WebAssembly processor (jaxinfer.processor) against wasmtime.

Hypothesis generates small i32/i64 WAT functions -- straight-line expression trees of every integer
binary/unary/compare/conversion op over parameters and edge constants, and structured ones adding
select, if/else with results, bounded counter loops, br_if/br_table out of value-carrying blocks,
direct calls to generated helpers, globals, early return, unreachable, and linear-memory stores/loads
(all widths, signed/unsigned, offsets, out-of-bounds addresses, memory.size/grow) -- and runs each in
wasmtime (fuel enabled, a fresh instance per argument set) and in jaxinfer (one batched ``run_slots``
machine for all argument sets). Both must agree on the result bit patterns or on the trap kind.
A fixed table checks every single op on all pairs of edge values; fixed programs check fuel and call
stack exhaustion; and a mutation check shows the comparison helper does report a flipped op.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import pytest
import wasmtime
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from jaxinfer.processor import run, run_slots

SLOTS = 8  # argument sets per generated program; a fixed count keeps one jitted machine shape
MEMORY_PAGES = 2  # modules declare (memory 1 2): one page to start, grow to two
JAX_FUEL = 200_000
WASMTIME_FUEL = 10_000_000
MASK = {"i32": (1 << 32) - 1, "i64": (1 << 64) - 1}
EDGES = {
    "i32": [0, 1, -1, 2, 31, 32, 33, 63, 64, 0x7FFFFFFF, -0x80000000, -2],
    "i64": [0, 1, -1, 31, 32, 63, 64, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x7FFFFFFFFFFFFFFF, -(1 << 63)],
}
ADDRESSES = [0, 1, 3, 8, 100, 65528, 65532, 65534, 65535, 65536, 65540, 131064, 131071, 131072, -1, -4]
OFFSETS = [0, 0, 1, 2, 4, 7, 65535, 65536, 4294967295]
TRAPS = {
    wasmtime.TrapCode.INTEGER_DIVISION_BY_ZERO: "integer divide by zero",
    wasmtime.TrapCode.INTEGER_OVERFLOW: "integer overflow",
    wasmtime.TrapCode.MEMORY_OUT_OF_BOUNDS: "out of bounds memory access",
    wasmtime.TrapCode.UNREACHABLE: "unreachable",
    wasmtime.TrapCode.STACK_OVERFLOW: "call stack exhausted",
    wasmtime.TrapCode.OUT_OF_FUEL: "fuel exhausted",
}

BINARY = ["add", "sub", "mul", "div_s", "div_u", "rem_s", "rem_u", "and", "or", "xor", "shl", "shr_s", "shr_u",
          "rotl", "rotr"]
TRAPPING = ["div_s", "div_u", "rem_s", "rem_u"]
SHIFTS = ["shl", "shr_s", "shr_u", "rotl", "rotr"]
COMPARE = ["eq", "ne", "lt_s", "lt_u", "gt_s", "gt_u", "le_s", "le_u", "ge_s", "ge_u"]
UNARY = {"i32": ["clz", "ctz", "popcnt", "extend8_s", "extend16_s"],
         "i64": ["clz", "ctz", "popcnt", "extend8_s", "extend16_s", "extend32_s"]}
STORES = {"i32": ["store", "store8", "store16"], "i64": ["store", "store8", "store16", "store32"]}
LOADS = {"i32": ["load", "load8_s", "load8_u", "load16_s", "load16_u"],
         "i64": ["load", "load8_s", "load8_u", "load16_s", "load16_u", "load32_s", "load32_u"]}

# (result bit patterns, None) or ((), trap message)
Outcome = tuple[tuple[int, ...], str | None]
Helper = tuple[str, tuple[str, ...], str]  # name, param types, result type

# Fixed profile: the same examples on every run, sized so the whole file takes well under a minute.
DIFFERENTIAL = settings(derandomize=True, deadline=None, max_examples=250, database=None,
                        phases=[Phase.explicit, Phase.generate, Phase.shrink],
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------- running both sides


@functools.cache
def wasmtime_engine() -> wasmtime.Engine:
    config = wasmtime.Config()
    config.consume_fuel = True
    return wasmtime.Engine(config)


def signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def wasmtime_outcomes(wat: str, func: str, param_types: list[str], args_per_slot: list[list[int]],
                      fuel: int = WASMTIME_FUEL) -> list[Outcome]:
    """Reference outcomes: a fresh wasmtime instance (memory, globals) for every argument set."""
    engine = wasmtime_engine()
    module = wasmtime.Module(engine, wat)
    outcomes = []
    for args in args_per_slot:
        store = wasmtime.Store(engine)
        store.set_fuel(fuel)
        export = wasmtime.Instance(store, module, []).exports(store)[func]
        assert isinstance(export, wasmtime.Func)
        call_args = [signed(value, int(kind[1:])) for value, kind in zip(args, param_types, strict=True)]
        try:
            results = export(store, *call_args)
        except wasmtime.Trap as trap:
            outcomes.append(((), TRAPS.get(trap.trap_code, f"wasmtime: {trap.trap_code}")))
            continue
        results = [] if results is None else results if isinstance(results, list) else [results]
        kinds = export.type(store).results
        outcomes.append((tuple(value & MASK[str(kind)] for value, kind in zip(results, kinds, strict=True)), None))
    return outcomes


def jaxinfer_outcomes(wat: str, func: str, args_per_slot: list[list[int]],
                      max_instructions: int = JAX_FUEL) -> list[Outcome]:
    results = run_slots(wat, func, args_per_slot, max_instructions=max_instructions, memory_pages=MEMORY_PAGES)
    return [((), result.trap) if result.trap else (tuple(result.values), None) for result in results]


def mismatches(reference_wat: str, subject_wat: str, func: str, param_types: list[str],
               args_per_slot: list[list[int]]) -> list[str]:
    """Run ``reference_wat`` in wasmtime and ``subject_wat`` in jaxinfer; describe every disagreement."""
    expected = wasmtime_outcomes(reference_wat, func, param_types, args_per_slot)
    got = jaxinfer_outcomes(subject_wat, func, args_per_slot)
    return [f"args={args}: wasmtime={want} jaxinfer={have}"
            for args, want, have in zip(args_per_slot, expected, got, strict=True) if want != have]


def assert_agrees(wat: str, func: str, param_types: list[str], args_per_slot: list[list[int]]) -> None:
    problems = mismatches(wat, wat, func, param_types, args_per_slot)
    assert not problems, "\n".join([wat, *problems])


# ---------------------------------------------------------------- program generation


@dataclass
class Scope:
    """What an expression may refer to while it is generated (mutated as locals are declared)."""

    variables: dict[str, list[str]]
    results: tuple[str, ...]
    structured: bool
    helpers: list[Helper] = field(default_factory=list)
    locals_declared: list[tuple[str, str]] = field(default_factory=list)
    in_loop: bool = False

    def new_local(self, kind: str) -> str:
        name = f"$l{len(self.locals_declared)}"
        self.locals_declared.append((name, kind))
        return name


def const(kind: str) -> st.SearchStrategy[str]:
    bits = int(kind[1:])
    values = st.sampled_from(EDGES[kind]) | st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    return values.map(lambda value: f"({kind}.const {value})")


@st.composite
def leaf(draw: st.DrawFn, scope: Scope, kind: str) -> str:
    names = scope.variables[kind]
    choices = ["const"] + (["var"] if names else []) + (["global"] if scope.structured else [])
    if kind == "i32" and scope.structured:
        choices.append("memory.size")
    choice = draw(st.sampled_from(choices))
    if choice == "var":
        return f"(local.get {draw(st.sampled_from(names))})"
    if choice == "global":
        return f"(global.get $g{kind[1:]})"
    if choice == "memory.size":
        return "(memory.size)"
    return draw(const(kind))


@st.composite
def straight(draw: st.DrawFn, scope: Scope, kind: str, depth: int) -> str:
    """One operator node: binary, unary, compare/eqz (i32 results), conversion or select."""
    sub = functools.partial(expr, scope, depth=depth - 1)
    forms = ["binary", "binary", "unary", "convert", "select"] + (["compare", "eqz"] if kind == "i32" else [])
    form = draw(st.sampled_from(forms))
    if form == "binary":
        op = draw(st.sampled_from(BINARY))
        # a bare parameter or constant divisor/shift amount often hits 0, -1 or a big count
        right = draw(leaf(scope, kind) if op in TRAPPING + SHIFTS and draw(st.booleans()) else sub(kind))
        overflow = op == "div_s" and draw(st.integers(0, 3)) == 0  # INT_MIN / -1 traps
        left = f"({kind}.const {-(1 << (int(kind[1:]) - 1))})" if overflow else draw(sub(kind))
        return f"({kind}.{op} {left} {right})"
    if form == "unary":
        return f"({kind}.{draw(st.sampled_from(UNARY[kind]))} {draw(sub(kind))})"
    if form == "compare":
        operand = draw(st.sampled_from(["i32", "i64"]))
        return f"({operand}.{draw(st.sampled_from(COMPARE))} {draw(sub(operand))} {draw(sub(operand))})"
    if form == "eqz":
        operand = draw(st.sampled_from(["i32", "i64"]))
        return f"({operand}.eqz {draw(sub(operand))})"
    if form == "convert":
        if kind == "i32":
            return f"(i32.wrap_i64 {draw(sub('i64'))})"
        return f"(i64.extend_i32_{draw(st.sampled_from('su'))} {draw(sub('i32'))})"
    return f"(select {draw(sub(kind))} {draw(sub(kind))} {draw(sub('i32'))})"


@st.composite
def address(draw: st.DrawFn, scope: Scope, depth: int) -> str:
    choice = draw(st.integers(0, 3))
    if choice <= 1:
        return f"(i32.const {draw(st.sampled_from(ADDRESSES))})"
    if choice == 2:
        return f"(i32.and {draw(expr(scope, 'i32', depth - 1))} (i32.const 0x1FFFF))"
    return draw(expr(scope, "i32", depth - 1))


@st.composite
def memory_access(draw: st.DrawFn, scope: Scope, kind: str, depth: int) -> str:
    """A store of any width then a load of ``kind`` near the same address (or anywhere)."""
    stored = draw(st.sampled_from(["i32", "i64"]))
    where = draw(address(scope, depth))
    again = where if draw(st.booleans()) else draw(address(scope, depth))
    store = f"({stored}.{draw(st.sampled_from(STORES[stored]))} offset={draw(st.sampled_from(OFFSETS))}"
    store += f" {where} {draw(expr(scope, stored, depth - 1))})"
    load = f"({kind}.{draw(st.sampled_from(LOADS[kind]))} offset={draw(st.sampled_from(OFFSETS))} {again})"
    return f"(block (result {kind}) {store} {load})"


@st.composite
def counter_loop(draw: st.DrawFn, scope: Scope, kind: str, depth: int) -> str:
    """acc = init; i = 0; do { acc = body(acc, i); i++ } while (i <u bound); acc -- bound is small."""
    acc, counter = scope.new_local(kind), scope.new_local("i32")
    init = draw(expr(scope, kind, depth - 1))
    inner = Scope({**scope.variables, kind: [*scope.variables[kind], acc], "i32": [*scope.variables["i32"], counter]},
                  scope.results, scope.structured, scope.helpers, scope.locals_declared, in_loop=True)
    body = draw(expr(inner, kind, min(depth - 1, 2)))
    bound = draw(st.integers(0, 6))
    return (f"(block (result {kind}) (local.set {acc} {init}) (local.set {counter} (i32.const 0))"
            f" (loop (local.set {acc} {body}) (local.set {counter} (i32.add (local.get {counter}) (i32.const 1)))"
            f" (br_if 0 (i32.lt_u (local.get {counter}) (i32.const {bound})))) (local.get {acc}))")


@st.composite
def branch_table(draw: st.DrawFn, scope: Scope, kind: str, depth: int) -> str:
    """br_table out of three nested value-carrying blocks; each landing point transforms the value."""
    sub = functools.partial(expr, scope, depth=depth - 1)
    index = draw(sub("i32"))
    if draw(st.booleans()):
        index = f"(i32.and {index} (i32.const 3))"
    targets = " ".join(str(draw(st.integers(0, 2))) for _ in range(draw(st.integers(0, 3))))
    return (f"(block (result {kind}) (block (result {kind}) (block (result {kind})"
            f" {draw(sub(kind))} {index} (br_table {targets} {draw(st.integers(0, 2))}))"
            f" {draw(sub(kind))} ({kind}.add) (br 1)) {draw(sub(kind))} ({kind}.xor))")


@st.composite
def control(draw: st.DrawFn, scope: Scope, kind: str, depth: int) -> str:
    """A structured node: if/else, br_if, br_table, loop, call, memory, global, return, unreachable."""
    sub = functools.partial(expr, scope, depth=depth - 1)
    forms = ["if", "br_if", "br_table", "memory", "global", "drop", "return", "unreachable"]
    forms += [] if scope.in_loop else ["loop"]
    forms += ["call"] if any(result == kind for _, _, result in scope.helpers) else []
    forms += ["grow"] if kind == "i32" else []
    form = draw(st.sampled_from(forms))
    if form == "if":
        return f"(if (result {kind}) {draw(sub('i32'))} (then {draw(sub(kind))}) (else {draw(sub(kind))}))"
    if form == "br_if":
        return f"(block (result {kind}) (drop (br_if 0 {draw(sub(kind))} {draw(sub('i32'))})) {draw(sub(kind))})"
    if form == "br_table":
        return draw(branch_table(scope, kind, depth))
    if form == "loop":
        return draw(counter_loop(scope, kind, depth))
    if form == "memory":
        return draw(memory_access(scope, kind, depth))
    if form == "global":
        return f"(block (result {kind}) (global.set $g{kind[1:]} {draw(sub(kind))}) {draw(sub(kind))})"
    if form == "drop":
        return f"(block (result {kind}) (drop {draw(sub(draw(st.sampled_from(['i32', 'i64']))))}) (nop)" \
               f" {draw(sub(kind))})"
    if form == "return":
        values = " ".join(draw(sub(result)) for result in scope.results)
        return f"(block (result {kind}) (if {draw(sub('i32'))} (then (return {values}))) {draw(sub(kind))})"
    if form == "unreachable":
        return f"(if (result {kind}) {draw(sub('i32'))} (then {draw(sub(kind))}) (else (unreachable)))"
    if form == "grow":
        amount = draw(sub("i32"))
        return f"(memory.grow {amount if draw(st.booleans()) else f'(i32.and {amount} (i32.const 1))'})"
    name, params, _ = draw(st.sampled_from([helper for helper in scope.helpers if helper[2] == kind]))
    return f"(call {name} {' '.join(draw(sub(param)) for param in params)})"


@st.composite
def expr(draw: st.DrawFn, scope: Scope, kind: str, depth: int) -> str:
    choice = draw(st.integers(0, 4)) if depth > 0 else 0
    if choice == 0:
        return draw(leaf(scope, kind))
    if scope.structured and choice >= 3:
        return draw(control(scope, kind, depth))
    return draw(straight(scope, kind, depth))


MAIN_PARAMS = ("i32", "i32", "i64", "i64")
HELPERS: list[Helper] = [("$h32", ("i32", "i64"), "i32"), ("$h64", ("i64", "i32"), "i64")]


def function_text(header: str, params: list[str], scope: Scope, body: str) -> str:
    declared = " ".join(f"(param $p{index} {kind})" for index, kind in enumerate(params))
    results = " ".join(scope.results)
    local_text = " ".join(f"(local {name} {kind})" for name, kind in scope.locals_declared)
    return f"  (func {header} {declared} (result {results}) {local_text}\n    {body})"


def param_scope(params: list[str], results: tuple[str, ...], structured: bool, helpers: list[Helper]) -> Scope:
    variables: dict[str, list[str]] = {"i32": [], "i64": []}
    for index, kind in enumerate(params):
        variables[kind].append(f"$p{index}")
    return Scope(variables, results, structured, list(helpers))


@st.composite
def programs(draw: st.DrawFn, structured: bool, params: tuple[str, ...] = MAIN_PARAMS,
             results: tuple[str, ...] = ("i32", "i64")) -> str:
    """A module exporting ``main(params) -> results``; structured ones add two helpers it may call."""
    parts = ["(module", "  (memory 1 2)", "  (global $g32 (mut i32) (i32.const 7))",
             "  (global $g64 (mut i64) (i64.const -9))"]
    for name, helper_params, result in HELPERS if structured else []:
        scope = param_scope(list(helper_params), (result,), structured, [])
        body = draw(expr(scope, result, 2))
        parts.append(function_text(name, list(helper_params), scope, body))
    scope = param_scope(list(params), results, structured, HELPERS if structured else [])
    depth = 4 if len(results) <= 2 else 2
    bodies = [draw(expr(scope, kind, depth)) for kind in results]
    parts.append(function_text('(export "main")', list(params), scope, " ".join(bodies)))
    return "\n".join([*parts, ")"])


def argument(kind: str) -> st.SearchStrategy[int]:
    bits = int(kind[1:])
    return st.sampled_from(EDGES[kind]) | st.integers(0, (1 << bits) - 1) | st.integers(-8, 8)


ARG_SETS = st.lists(st.tuples(*(argument(kind) for kind in MAIN_PARAMS)).map(list), min_size=SLOTS, max_size=SLOTS)


# ---------------------------------------------------------------- the tests


@DIFFERENTIAL
@given(wat=programs(structured=False), args_per_slot=ARG_SETS)
def test_straight_line_programs_match_wasmtime(wat: str, args_per_slot: list[list[int]]) -> None:
    assert_agrees(wat, "main", list(MAIN_PARAMS), args_per_slot)


@DIFFERENTIAL
@given(wat=programs(structured=True), args_per_slot=ARG_SETS)
def test_structured_programs_match_wasmtime(wat: str, args_per_slot: list[list[int]]) -> None:
    assert_agrees(wat, "main", list(MAIN_PARAMS), args_per_slot)


def op_bodies(kind: str) -> dict[str, str]:
    """Every single op of ``kind`` applied to (local 0, local 1), its value returned as ``kind``."""
    widen = "{}" if kind == "i32" else "(i64.extend_i32_u {})"
    bodies = {op: f"({kind}.{op} (local.get 0) (local.get 1))" for op in BINARY}
    bodies |= {op: f"({kind}.{op} (local.get 0))" for op in UNARY[kind]}
    bodies |= {op: widen.format(f"({kind}.{op} (local.get 0) (local.get 1))") for op in COMPARE}
    bodies["eqz"] = widen.format(f"({kind}.eqz (local.get 0))")
    bodies["convert"] = ("(i32.wrap_i64 (i64.extend_i32_s (local.get 0)))" if kind == "i32"
                         else "(i64.extend_i32_u (i32.wrap_i64 (local.get 0)))")
    return bodies


def op_table_module(kind: str) -> tuple[str, list[str]]:
    """Export "all" returns every op that cannot trap at once; each trapping op gets its own export."""
    bodies = op_bodies(kind)
    total = [op for op in bodies if op not in TRAPPING]
    header = f"(param {kind} {kind})"
    funcs = [f'  (func (export "all") {header} (result{f" {kind}" * len(total)})',
             *(f"    {bodies[op]}" for op in total), "  )"]
    funcs += [f'  (func (export "{op}") {header} (result {kind}) {bodies[op]})' for op in TRAPPING]
    return "\n".join(["(module", *funcs, ")"]), total


def per_op_differences(prefix: str, names: list[str], args: list[int], want: Outcome, have: Outcome) -> list[str]:
    """Name each op whose value (or trap) differs, for one argument pair of the op table."""
    if want == have:
        return []
    if want[1] or have[1]:
        return [f"{prefix}{'/'.join(names)}{tuple(args)}: wasmtime={want} jaxinfer={have}"]
    return [f"{prefix}{name}{tuple(args)}: wasmtime={expected} jaxinfer={got}"
            for name, expected, got in zip(names, want[0], have[0], strict=True) if expected != got]


@pytest.mark.parametrize("export", ["all", *TRAPPING])
@pytest.mark.parametrize("kind", ["i32", "i64"])
def test_every_op_on_edge_pairs_matches_wasmtime(kind: str, export: str) -> None:
    wat, names = op_table_module(kind)
    names = names if export == "all" else [export]
    pairs = [list(pair) for pair in itertools.product(EDGES[kind], repeat=2)]
    expected = wasmtime_outcomes(wat, export, [kind, kind], pairs)
    got = jaxinfer_outcomes(wat, export, pairs)
    problems = [problem for args, want, have in zip(pairs, expected, got, strict=True)
                for problem in per_op_differences(f"{kind}.", names, args, want, have)]
    assert not problems, "\n".join(problems)


INFINITE_LOOP = """(module
  (func (export "main") (param i32) (result i32)
    (loop $spin (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br $spin))
    (local.get 0)))"""

RUNAWAY_RECURSION = """(module
  (func $down (export "main") (param i64) (result i64)
    (i64.add (call $down (i64.add (local.get 0) (i64.const 1))) (i64.const 1))))"""


def test_infinite_loop_exhausts_fuel_in_both() -> None:
    assert wasmtime_outcomes(INFINITE_LOOP, "main", ["i32"], [[0]], fuel=10_000) == [((), "fuel exhausted")]
    result = run(INFINITE_LOOP, "main", [0], max_instructions=1_000)
    assert result.trap == "fuel exhausted"
    assert result.values == []
    assert result.instructions <= 1_000


def test_runaway_recursion_exhausts_the_call_stack_in_both() -> None:
    assert wasmtime_outcomes(RUNAWAY_RECURSION, "main", ["i64"], [[0]]) == [((), "call stack exhausted")]
    assert run(RUNAWAY_RECURSION, "main", [0]).trap == "call stack exhausted"


MUTANT_BASE = """(module
  (memory 1 2)
  (func (export "main") (param i32 i32 i64 i64) (result i32 i64)
    (i32.store8 offset=3 (i32.const 65532) (local.get 0))
    (i32.{} (i32.{} offset=3 (i32.const 65532)) (local.get 1))
    (i64.{} (local.get 2) (local.get 3))))"""

# name -> (reference ops, ops jaxinfer runs instead, an argument set on which they differ); ops fill MUTANT_BASE
MUTANTS = {
    "add->sub": (("div_s", "load8_s", "add"), ("div_s", "load8_s", "sub"), [5, 3, 2, 2]),
    "div_s->div_u": (("div_s", "load8_s", "mul"), ("div_u", "load8_s", "mul"), [-7, 2, 1, 1]),
    "load8_s->load8_u": (("add", "load8_s", "mul"), ("add", "load8_u", "mul"), [0x80, 0, 1, 1]),
    "rem_u trap->and": (("rem_u", "load8_s", "shl"), ("and", "load8_s", "shl"), [1, 0, 1, 1]),
    "shr_s->rotr": (("add", "load8_s", "shr_s"), ("add", "load8_s", "rotr"), [0, 0, -2, 1]),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_comparison_detects_a_flipped_op(name: str) -> None:
    reference, subject, args = MUTANTS[name]
    reference_wat, subject_wat = MUTANT_BASE.format(*reference), MUTANT_BASE.format(*subject)
    assert mismatches(reference_wat, reference_wat, "main", list(MAIN_PARAMS), [args]) == []
    assert len(mismatches(reference_wat, subject_wat, "main", list(MAIN_PARAMS), [args])) == 1


SIGNATURES = st.tuples(st.lists(st.sampled_from(["i32", "i64"]), max_size=3).map(tuple),
                       st.lists(st.sampled_from(["i32", "i64"]), min_size=1, max_size=4).map(tuple))


def with_caller(wat: str, params: tuple[str, ...], results: tuple[str, ...]) -> str:
    """Add export "caller": the same signature, forwarding its params to main through a direct call."""
    forwarded = " ".join(f"(local.get {index})" for index in range(len(params)))
    declared = f"(param{''.join(f' {kind}' for kind in params)}) (result{''.join(f' {kind}' for kind in results)})"
    caller = f'  (func (export "caller") {declared} (call 2 {forwarded}))'  # main is function 2 (after helpers)
    return wat[: wat.rindex(")")] + caller + "\n)"


@settings(DIFFERENTIAL, max_examples=80)
@given(data=st.data(), signature=SIGNATURES)
def test_multi_value_functions_match_wasmtime(data: st.DataObject, signature: tuple[tuple[str, ...], ...]) -> None:
    """Functions of random arity returning 1-4 values, invoked directly and through a call."""
    params, results = signature
    wat = with_caller(data.draw(programs(structured=True, params=params, results=results)), params, results)
    args_per_slot = data.draw(st.lists(st.tuples(*(argument(kind) for kind in params)).map(list),
                                       min_size=SLOTS, max_size=SLOTS))
    for export in ("main", "caller"):
        assert_agrees(wat, export, list(params), args_per_slot)
