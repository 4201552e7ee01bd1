"""Instructions per second of the embedded WebAssembly processor (jaxinfer.processor) against wasmtime.

    python tools/bench.py processor                              # defaults: a few minutes on 2 CPU cores
    python tools/bench.py processor --mac-iterations 1000000     # the issue-scale mac workload
    python tools/processor_bench.py --slots 8 --json out.json    # standalone

Two loop-heavy programs, generated as WebAssembly text for the asked size:

* ``mac``: ``main(n: i32, seed: i32) -> i64``, n iterations of a 64-bit multiply-accumulate
  (``acc += x * y`` with x and y stepped by two 64-bit LCGs seeded from ``seed``).
* ``bignum``: ``main(seed: i32) -> i64`` writes two D-digit decimal numbers (from an LCG of ``seed``)
  into linear memory as little-endian base-10^4 i32 limbs, multiplies them schoolbook-style with
  i64 products and carries, and returns an FNV-1a hash of the product's limbs.

Every result (jaxinfer and wasmtime, every slot) is checked against Python: the mac loop re-run in
Python integers, the bignum checksum from Python's own big-int product. A wrong result aborts the
benchmark before any speed is reported.

Each program runs three ways: jaxinfer with one slot (``run``), jaxinfer with ``--slots`` slots of one
batched machine (``run_slots``, a different seed per slot; the rate is reported in total and per
slot), and wasmtime. jaxinfer is called once to warm up (XLA compiles the machine for that shape; mac
warms up with n = 1, which compiles the same machine) and timed on a second call; its time still
includes the host-side decode, lowering and instantiation (milliseconds).

Instructions are counted by each runtime itself: jaxinfer's ``ExecResult.instructions`` (WebAssembly
instructions executed; block/loop/end and nop cost nothing) and wasmtime's fuel consumed
(``Config.consume_fuel``, nearly the same rule: the two agree to within a few instructions per
call). ``wasmtime`` is timed with fuel metering on (the comparable setting: jaxinfer meters fuel
too); ``wasmtime_no_fuel`` is timed with it off and rated on jaxinfer's count. wasmtime is warmed up
once; its time is the mean of repeated calls (Python call overhead included) over at least
``--wasmtime-min-seconds``.

Prints one JSON object (one line); ``--json PATH`` also writes it, indented, to PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from jaxinfer.machine_shape import EXEC_LOOPS

MASK64 = (1 << 64) - 1
LCG_X = (6364136223846793005, 1442695040888963407)  # Knuth's MMIX 64-bit LCG
LCG_Y = (2862933555777941757, 3037000493)
DIGIT_LCG = (1103515245, 12345)  # 32-bit LCG for the bignum digits
LIMB_BASE = 10_000
FNV = (0xCBF29CE484222325, 0x100000001B3)
ISSUE_SCALE = "issue-scale sizes: --mac-iterations 1000000 --bignum-digits 200 --slots 64"


@dataclass
class Program:
    """One benchmark program: its module, how to call it for a seed, and the expected result."""

    name: str
    wat: str
    size: dict
    args: Callable[[int], list[int]]
    expected: Callable[[int], int]
    memory_pages: int
    warmup: Callable[[int], list[int]] | None = None  # shorter arguments for the warm-up call (same machine shape)

    def warmup_args(self, seed: int) -> list[int]:
        return (self.warmup or self.args)(seed)


# -- mac: 64-bit multiply-accumulate -------------------------------------------------------------------
def mac_wat() -> str:
    return f"""(module
  (func (export "main") (param $n i32) (param $seed i32) (result i64)
    (local $i i32) (local $x i64) (local $y i64) (local $acc i64)
    (local.set $x (i64.extend_i32_u (local.get $seed)))
    (local.set $y (i64.xor (local.get $x) (i64.const 0x5DEECE66D)))
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
        (local.set $x (i64.add (i64.mul (local.get $x) (i64.const {LCG_X[0]})) (i64.const {LCG_X[1]})))
        (local.set $y (i64.add (i64.mul (local.get $y) (i64.const {LCG_Y[0]})) (i64.const {LCG_Y[1]})))
        (local.set $acc (i64.add (local.get $acc) (i64.mul (local.get $x) (local.get $y))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $next)))
    (local.get $acc)))
"""


def mac_expected(n: int, seed: int) -> int:
    x, acc = seed, 0
    y = x ^ 0x5DEECE66D
    for _ in range(n):
        x = (x * LCG_X[0] + LCG_X[1]) & MASK64
        y = (y * LCG_Y[0] + LCG_Y[1]) & MASK64
        acc = (acc + x * y) & MASK64
    return acc


def mac_program(iterations: int) -> Program:
    return Program("mac", mac_wat(), {"iterations": iterations}, lambda seed: [iterations, seed],
                   lambda seed: mac_expected(iterations, seed), memory_pages=1, warmup=lambda seed: [1, seed])


# -- bignum: schoolbook multiplication of two D-digit numbers in linear memory ----------------------------
def limb_count(digits: int) -> int:
    return (digits + 3) // 4


def top_limb_range(digits: int) -> tuple[int, int]:
    """(lowest, span) of the most significant limb, so that the number has exactly ``digits`` digits."""
    top_digits = digits - 4 * (limb_count(digits) - 1)
    return 10 ** (top_digits - 1), 9 * 10 ** (top_digits - 1)


def bignum_fill_wat(limbs: int, low: int, span: int) -> str:
    """$fill(address, state) -> state: writes one number's limbs from the digit LCG."""
    return f"""
  (func $fill (param $p i32) (param $s i32) (result i32)
    (local $k i32) (local $limb i32)
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $k) (i32.const {limbs})))
        (local.set $s (i32.add (i32.mul (local.get $s) (i32.const {DIGIT_LCG[0]})) (i32.const {DIGIT_LCG[1]})))
        (local.set $limb (i32.rem_u (i32.shr_u (local.get $s) (i32.const 8)) (i32.const {LIMB_BASE})))
        (if (i32.eq (local.get $k) (i32.const {limbs - 1}))
          (then (local.set $limb (i32.add (i32.const {low}) (i32.rem_u (local.get $limb) (i32.const {span}))))))
        (i32.store (i32.add (local.get $p) (i32.shl (local.get $k) (i32.const 2))) (local.get $limb))
        (local.set $k (i32.add (local.get $k) (i32.const 1)))
        (br $next)))
    (local.get $s))"""


def bignum_multiply_wat(limbs: int, a: int, b: int, r: int) -> str:
    """$multiply(): r[0 .. 2L) = a * b, zeroing r first; t = r[i+j] + a[i]*b[j] + carry in i64."""
    return f"""
  (func $multiply
    (local $i i32) (local $j i32) (local $rp i32) (local $ai i64) (local $t i64) (local $carry i64)
    (block $zeroed
      (loop $zero
        (br_if $zeroed (i32.ge_u (local.get $i) (i32.const {2 * limbs})))
        (i32.store (i32.add (i32.const {r}) (i32.shl (local.get $i) (i32.const 2))) (i32.const 0))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $zero)))
    (local.set $i (i32.const 0))
    (block $rows_done
      (loop $row
        (br_if $rows_done (i32.ge_u (local.get $i) (i32.const {limbs})))
        (local.set $ai (i64.load32_u (i32.add (i32.const {a}) (i32.shl (local.get $i) (i32.const 2)))))
        (local.set $carry (i64.const 0))
        (local.set $rp (i32.add (i32.const {r}) (i32.shl (local.get $i) (i32.const 2))))
        (local.set $j (i32.const 0))
        (block $cols_done
          (loop $col
            (br_if $cols_done (i32.ge_u (local.get $j) (i32.const {limbs})))
            (local.set $t (i64.add (i64.add (i64.load32_u (local.get $rp))
              (i64.mul (local.get $ai) (i64.load32_u (i32.add (i32.const {b}) (i32.shl (local.get $j) (i32.const 2))))))
              (local.get $carry)))
            (i64.store32 (local.get $rp) (i64.rem_u (local.get $t) (i64.const {LIMB_BASE})))
            (local.set $carry (i64.div_u (local.get $t) (i64.const {LIMB_BASE})))
            (local.set $rp (i32.add (local.get $rp) (i32.const 4)))
            (local.set $j (i32.add (local.get $j) (i32.const 1)))
            (br $col)))
        (i64.store32 (local.get $rp) (local.get $carry))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $row))))"""


def bignum_checksum_wat(limbs: int, r: int) -> str:
    """$checksum() -> i64: FNV-1a over the product's 2L limbs (each limb one 64-bit word)."""
    return f"""
  (func $checksum (result i64)
    (local $k i32) (local $h i64)
    (local.set $h (i64.const {FNV[0]}))
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $k) (i32.const {2 * limbs})))
        (local.set $h (i64.mul (i64.xor (local.get $h)
          (i64.load32_u (i32.add (i32.const {r}) (i32.shl (local.get $k) (i32.const 2))))) (i64.const {FNV[1]})))
        (local.set $k (i32.add (local.get $k) (i32.const 1)))
        (br $next)))
    (local.get $h))"""


def bignum_layout(digits: int) -> tuple[int, int, int, int]:
    """Byte offsets of a, b and the product, and the memory pages they need."""
    limbs = limb_count(digits)
    a, b, r = 0, 4 * limbs, 8 * limbs
    return a, b, r, max(1, -(-(r + 8 * limbs) // 65536))


def bignum_wat(digits: int) -> str:
    limbs = limb_count(digits)
    a, b, r, pages = bignum_layout(digits)
    low, span = top_limb_range(digits)
    functions = bignum_fill_wat(limbs, low, span) + bignum_multiply_wat(limbs, a, b, r) + bignum_checksum_wat(limbs, r)
    return f"""(module
  (memory {pages}){functions}
  (func (export "main") (param $seed i32) (result i64)
    (drop (call $fill (i32.const {b}) (call $fill (i32.const {a}) (local.get $seed))))
    (call $multiply)
    (call $checksum)))
"""


def bignum_numbers(digits: int, seed: int) -> tuple[int, int]:
    """The two numbers the module writes for ``seed``, rebuilt in Python."""
    limbs = limb_count(digits)
    low, span = top_limb_range(digits)
    state, numbers = seed, []
    for _ in range(2):
        value = 0
        for k in range(limbs):
            state = (state * DIGIT_LCG[0] + DIGIT_LCG[1]) & 0xFFFFFFFF
            limb = (state >> 8) % LIMB_BASE
            if k == limbs - 1:
                limb = low + limb % span
            value += limb * LIMB_BASE**k
        assert len(str(value)) == digits
        numbers.append(value)
    return numbers[0], numbers[1]


def bignum_expected(digits: int, seed: int) -> int:
    """FNV-1a over the base-10^4 limbs of Python's own product of the two numbers."""
    a, b = bignum_numbers(digits, seed)
    product, h = a * b, FNV[0]
    for _ in range(2 * limb_count(digits)):
        product, limb = divmod(product, LIMB_BASE)
        h = ((h ^ limb) * FNV[1]) & MASK64
    return h


def bignum_program(digits: int) -> Program:
    return Program("bignum", bignum_wat(digits), {"digits": digits, "limbs": limb_count(digits)},
                   lambda seed: [seed], lambda seed: bignum_expected(digits, seed),
                   memory_pages=bignum_layout(digits)[3])


# -- measurement ----------------------------------------------------------------------------------------
def seeds(count: int) -> list[int]:
    return [(0x9E3779B9 * (k + 1)) & 0x7FFFFFFF for k in range(count)]


def rate(instructions: int, seconds: float) -> dict:
    return dict(instructions=instructions, seconds=float(f"{seconds:.4g}"),
                instructions_per_second=round(instructions / seconds, 1))


def check(program: Program, runtime: str, seed: int, value: int) -> None:
    expected = program.expected(seed)
    if value != expected:
        raise AssertionError(f"{program.name} on {runtime}, seed {seed}: got {value:#x}, expected {expected:#x}")


def jaxinfer_one_slot(program: Program, wasm: bytes, max_instructions: int, loop: str = "auto") -> dict:
    from jaxinfer.processor import run

    seed = seeds(1)[0]
    limits = dict(max_instructions=max_instructions, memory_pages=program.memory_pages, loop=loop)
    run(wasm, "main", program.warmup_args(seed), **limits)  # warm-up: XLA compiles the machine for this shape
    start = time.perf_counter()
    result = run(wasm, "main", program.args(seed), **limits)
    seconds = time.perf_counter() - start
    if result.trap:
        raise AssertionError(f"{program.name} on jaxinfer trapped: {result.trap}")
    check(program, "jaxinfer", seed, result.values[0])
    return rate(result.instructions, seconds)


def jaxinfer_slots(program: Program, wasm: bytes, slots: int, max_instructions: int, loop: str = "auto") -> dict:
    from jaxinfer.processor import run_slots

    slot_seeds = seeds(slots)
    args = [program.args(seed) for seed in slot_seeds]
    limits = dict(max_instructions=max_instructions, memory_pages=program.memory_pages, loop=loop)
    run_slots(wasm, "main", [program.warmup_args(seed) for seed in slot_seeds], **limits)  # warm-up
    start = time.perf_counter()
    results = run_slots(wasm, "main", args, **limits)
    seconds = time.perf_counter() - start
    for seed, result in zip(slot_seeds, results, strict=True):
        if result.trap:
            raise AssertionError(f"{program.name} on jaxinfer slot (seed {seed}) trapped: {result.trap}")
        check(program, f"jaxinfer {slots} slots", seed, result.values[0])
    total = rate(sum(result.instructions for result in results), seconds)
    return dict(slots=slots, **total,
                instructions_per_second_per_slot=round(total["instructions_per_second"] / slots, 1))


def wasmtime_call(wasm: bytes, fuel: bool) -> Callable[[list[int]], tuple[int, int]]:
    """A function calling ``main`` on one wasmtime instance: (result as u64, fuel consumed or 0)."""
    import wasmtime

    config = wasmtime.Config()
    config.consume_fuel = fuel
    store = wasmtime.Store(wasmtime.Engine(config))
    instance = wasmtime.Instance(store, wasmtime.Module(store.engine, wasm), [])
    main = instance.exports(store)["main"]

    def call(args: list[int]) -> tuple[int, int]:
        if fuel:
            store.set_fuel(2**62)
        value = main(store, *args)
        return value & MASK64, (2**62 - store.get_fuel()) if fuel else 0

    return call


def wasmtime_timed(program: Program, wasm: bytes, fuel: bool, min_seconds: float) -> dict:
    seed = seeds(1)[0]
    call = wasmtime_call(wasm, fuel)
    value, consumed = call(program.args(seed))  # warm-up
    check(program, "wasmtime", seed, value)
    calls, start = 0, time.perf_counter()
    while True:
        value, _ = call(program.args(seed))
        calls += 1
        seconds = time.perf_counter() - start
        if seconds >= min_seconds:
            break
    check(program, "wasmtime", seed, value)
    return dict(calls=calls, fuel_consumed=consumed, seconds_per_call=seconds / calls)


def wasmtime_rates(program: Program, wasm: bytes, instructions: int, min_seconds: float) -> tuple[dict, dict]:
    """(metered, unmetered): metered counts its own fuel; unmetered is rated on jaxinfer's count."""
    metered = wasmtime_timed(program, wasm, True, min_seconds)
    plain = wasmtime_timed(program, wasm, False, min_seconds)
    return (dict(**rate(metered["fuel_consumed"], metered["seconds_per_call"]), calls=metered["calls"]),
            dict(**rate(instructions, plain["seconds_per_call"]), calls=plain["calls"]))


def ratios(one: dict, many: dict, wasm: dict, wasm_plain: dict) -> dict:
    slots, theirs, plain = many["slots"], wasm["instructions_per_second"], wasm_plain["instructions_per_second"]
    return {
        "jaxinfer_1slot_over_wasmtime": one["instructions_per_second"] / theirs,
        f"jaxinfer_{slots}slots_total_over_wasmtime": many["instructions_per_second"] / theirs,
        f"jaxinfer_{slots}slots_per_slot_over_wasmtime": many["instructions_per_second_per_slot"] / theirs,
        "jaxinfer_1slot_over_wasmtime_no_fuel": one["instructions_per_second"] / plain,
        f"jaxinfer_{slots}slots_total_over_wasmtime_no_fuel": many["instructions_per_second"] / plain,
    }


def bench_program(program: Program, args: argparse.Namespace) -> dict:
    from jaxinfer.processor.instance import to_binary

    wasm = to_binary(program.wat)
    one = jaxinfer_one_slot(program, wasm, args.max_instructions, args.loop)
    many = jaxinfer_slots(program, wasm, args.slots, args.max_instructions, args.loop)
    wasm_rate, plain_rate = wasmtime_rates(program, wasm, one["instructions"], args.wasmtime_min_seconds)
    return dict(size=program.size, memory_pages=program.memory_pages, results_checked=1 + args.slots + 2,
                jaxinfer_1slot=one, **{f"jaxinfer_{args.slots}slots": many}, wasmtime=wasm_rate,
                wasmtime_no_fuel=plain_rate,
                ratios={k: float(f"{v:.3g}") for k, v in ratios(one, many, wasm_rate, plain_rate).items()})


def environment() -> dict:
    from importlib.metadata import version

    import jax

    return dict(jax=jax.__version__, backend=jax.default_backend(), cpus=os.cpu_count(),
                wasmtime=version("wasmtime"))


# -- command line ---------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--mac-iterations", type=int, default=100_000,
                   help="mac loop length (default %(default)s; issue scale: 1000000)")
    p.add_argument("--bignum-digits", type=int, default=200,
                   help="decimal digits of each factor (default %(default)s, the issue scale)")
    p.add_argument("--slots", type=int, default=64,
                   help="slots of the batched jaxinfer run (default %(default)s, the issue scale)")
    p.add_argument("--programs", nargs="+", choices=["mac", "bignum"], default=["mac", "bignum"])
    p.add_argument("--max-instructions", type=int, default=2**31 - 1, help="jaxinfer fuel per slot")
    p.add_argument("--loop", choices=EXEC_LOOPS, default="auto",
                   help="the machine's loop (machine.MachineShape.loop); pallas is the GPU kernel")
    p.add_argument("--wasmtime-min-seconds", type=float, default=0.2,
                   help="wasmtime is timed over repeated calls for at least this long")
    p.add_argument("--json", metavar="PATH", help="also write the JSON result (indented) to PATH")
    return p


def parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=ISSUE_SCALE))


def bench(args: argparse.Namespace) -> dict:
    builders = {"mac": lambda: mac_program(args.mac_iterations), "bignum": lambda: bignum_program(args.bignum_digits)}
    start = time.perf_counter()
    programs = {name: bench_program(builders[name](), args) for name in args.programs}
    report = dict(what="processor_bench", env=environment(), loop=args.loop, programs=programs,
                  instruction_count="jaxinfer: ExecResult.instructions; wasmtime: fuel consumed (Config.consume_fuel);"
                  " wasmtime_no_fuel: jaxinfer's count over wasmtime's unmetered time",
                  wall_s=round(time.perf_counter() - start, 1))
    print(json.dumps(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def main(argv: list[str] | None = None) -> None:
    bench(parser().parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
