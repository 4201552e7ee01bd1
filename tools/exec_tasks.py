"""Arithmetic and small-algorithm questions whose answers are WebAssembly text (WAT) programs.

Each task pairs a question (several phrasings, the numbers in plain decimal digits) with one fixed
program template per kind, the numbers substituted, and the exact answer computed in Python. Every
program exports `main` with no parameters and returns one i64, which the embedded processor
(`jaxinfer.processor`) prints as a signed decimal; every answer lies in the signed i64 range.

The programs are the targets a small model (SmolLM2-135M, LoRA) learns to write token by token, so
they are as short as the folded S-expression style allows: one line, locals named `$a $b $n $p $t
$r` (declared only where used, in that order), loops `(loop $l ... (br_if $l ...))`, the result in
`$r` where there is a loop (gcd and fibonacci return `$a`).

    python tools/exec_tasks.py --check 50 --seed 0   # run the programs (wasmtime + our processor)
    python tools/exec_tasks.py --show 2 --seed 0     # print examples
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1

HEAD = '(module (func (export "main") (result i64)'
ODD = "(i32.wrap_i64 (i64.and (local.get {v}) (i64.const 1)))"  # i32 condition: the low bit of an i64 local


@dataclass
class Task:
    kind: str
    question: str
    program: str
    answer: int


def _digits(rng: random.Random, low: int, high: int, cap: int | None = None) -> int:
    """A random integer with a random number of decimal digits in [low, high], at most `cap`."""
    if cap is not None:
        high = min(high, len(str(cap)))
    count = rng.randint(low, high)
    top = 10**count - 1
    return rng.randint(10 ** (count - 1), top if cap is None else min(top, cap))


def _module(locals_: str, body: str) -> str:
    return f"{HEAD}{' ' + locals_ if locals_ else ''} {body}))"


def _decls(*names: str) -> str:
    return " ".join(f"(local ${name} i64)" for name in names)


def _const(value: int) -> str:
    return f"(i64.const {value})"


def _count_down(var: str) -> str:
    """The loop's last instruction: decrement `var` and repeat while it is not zero."""
    return f"(br_if $l (i64.ne (local.tee ${var} (i64.sub (local.get ${var}) (i64.const 1))) (i64.const 0)))"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _to_base(n: int, base: int) -> int:
    """n's base-`base` digits read as a decimal integer."""
    result, place = 0, 1
    while n:
        result, place, n = result + n % base * place, place * 10, n // base
    return result


def _collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n, steps = (3 * n + 1 if n & 1 else n // 2), steps + 1
    return steps


def _fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _sum(rng: random.Random) -> Task:
    values = [_digits(rng, 6, 15) for _ in range(rng.choice((2, 3)))]
    listed = ", ".join(map(str, values[:-1])) + f" and {values[-1]}"
    question = rng.choice(
        (
            f"What is {' + '.join(map(str, values))}?",
            f"Add {listed}.",
            f"Compute the sum of {listed}.",
            f"Calculate {' + '.join(map(str, values))}.",
        )
    )
    expr = _const(values[0])
    for value in values[1:]:
        expr = f"(i64.add {expr} {_const(value)})"
    return Task("sum", question, _module("", expr), sum(values))


def _product(rng: random.Random) -> Task:
    a, b = _digits(rng, 4, 9), _digits(rng, 4, 9)
    question = rng.choice(
        (f"What is {a} * {b}?", f"Multiply {a} by {b}.", f"Compute the product of {a} and {b}.",
         f"What is {a} times {b}?")
    )
    return Task("product", question, _module("", f"(i64.mul {_const(a)} {_const(b)})"), a * b)


def _difference(rng: random.Random) -> Task:
    a, b = _digits(rng, 6, 15), _digits(rng, 6, 15)
    question = rng.choice(
        (f"What is {a} - {b}?", f"Subtract {b} from {a}.", f"Compute {a} minus {b}.", f"Calculate {a} - {b}.")
    )
    return Task("difference", question, _module("", f"(i64.sub {_const(a)} {_const(b)})"), a - b)


def _power(rng: random.Random) -> Task:
    a = rng.randint(2, 20)
    b = rng.randint(2, max(e for e in range(2, 64) if a**e <= I64_MAX))
    question = rng.choice(
        (f"What is {a}^{b}?", f"Compute {a} to the power of {b}.", f"Calculate {a} raised to the {_ordinal(b)} power.")
    )
    body = (
        f"(local.set $b {_const(b)}) (local.set $r (i64.const 1)) "
        f"(loop $l (local.set $r (i64.mul (local.get $r) {_const(a)})) {_count_down('b')}) (local.get $r)"
    )
    return Task("power", question, _module(_decls("b", "r"), body), a**b)


def _modpow(rng: random.Random) -> Task:
    a, b = rng.randint(2, 10**6), rng.randint(1, 10**6)
    m = _digits(rng, 2, 10, cap=(1 << 31) - 1)
    question = rng.choice(
        (
            f"What is {a}^{b} mod {m}?",
            f"Compute {a} to the power of {b}, modulo {m}.",
            f"What is the remainder of {a}^{b} divided by {m}?",
        )
    )
    body = (
        f"(local.set $a {_const(a)}) (local.set $b {_const(b)}) (local.set $r (i64.const 1)) "
        f"(loop $l (if {ODD.format(v='$b')} (then (local.set $r (i64.rem_u (i64.mul (local.get $r) (local.get $a)) "
        f"{_const(m)})))) (local.set $a (i64.rem_u (i64.mul (local.get $a) (local.get $a)) {_const(m)})) "
        "(br_if $l (i64.ne (local.tee $b (i64.shr_u (local.get $b) (i64.const 1))) (i64.const 0)))) (local.get $r)"
    )
    return Task("modpow", question, _module(_decls("a", "b", "r"), body), pow(a, b, m))


def _gcd(rng: random.Random) -> Task:
    g = _digits(rng, 1, 6)  # a common factor, so that the answer is rarely 1
    a, b = g * rng.randint(1, 10**12 // g), g * rng.randint(1, 10**12 // g)
    question = rng.choice(
        (
            f"What is the greatest common divisor of {a} and {b}?",
            f"Compute gcd({a}, {b}).",
            f"Find the GCD of {a} and {b}.",
        )
    )
    body = (
        f"(local.set $a {_const(a)}) (local.set $b {_const(b)}) "
        "(loop $l (local.set $t (i64.rem_u (local.get $a) (local.get $b))) (local.set $a (local.get $b)) "
        "(br_if $l (i64.ne (local.tee $b (local.get $t)) (i64.const 0)))) (local.get $a)"
    )
    return Task("gcd", question, _module(_decls("a", "b", "t"), body), math.gcd(a, b))


def _digit_sum(rng: random.Random) -> Task:
    n = _digits(rng, 10, 18)
    question = rng.choice(
        (
            f"What is the sum of the digits of {n}?",
            f"Compute the digit sum of {n}.",
            f"Add up the decimal digits of {n}.",
        )
    )
    body = (
        f"(local.set $a {_const(n)}) (loop $l (local.set $r (i64.add (local.get $r) "
        "(i64.rem_u (local.get $a) (i64.const 10)))) "
        "(br_if $l (i64.ne (local.tee $a (i64.div_u (local.get $a) (i64.const 10))) (i64.const 0)))) (local.get $r)"
    )
    return Task("digit_sum", question, _module(_decls("a", "r"), body), sum(map(int, str(n))))


def _base(rng: random.Random) -> Task:
    base = rng.randint(2, 9)
    n = _digits(rng, 2, 7, cap=min(10**6, base**19 - 1))  # 19 base-b digits read in decimal are < 2^63
    question = rng.choice(
        (f"Write {n} in base {base}.", f"Convert {n} to base {base}.", f"What is {n} in base {base}?")
    )
    body = (
        f"(local.set $a {_const(n)}) (local.set $p (i64.const 1)) (loop $l (local.set $r (i64.add (local.get $r) "
        f"(i64.mul (i64.rem_u (local.get $a) {_const(base)}) (local.get $p)))) "
        "(local.set $p (i64.mul (local.get $p) (i64.const 10))) "
        f"(br_if $l (i64.ne (local.tee $a (i64.div_u (local.get $a) {_const(base)})) (i64.const 0)))) (local.get $r)"
    )
    return Task("base", question, _module(_decls("a", "p", "r"), body), _to_base(n, base))


def _fibonacci_task(rng: random.Random) -> Task:
    n = rng.randint(10, 90)
    question = rng.choice(
        (
            f"What is the {_ordinal(n)} Fibonacci number?",
            f"Compute the Fibonacci number F({n}), where F(1) = F(2) = 1.",
            f"Find the {_ordinal(n)} term of the Fibonacci sequence 1, 1, 2, 3, 5, ...",
        )
    )
    body = (
        f"(local.set $b (i64.const 1)) (local.set $n {_const(n)}) "
        "(loop $l (local.set $t (i64.add (local.get $a) (local.get $b))) (local.set $a (local.get $b)) "
        f"(local.set $b (local.get $t)) {_count_down('n')}) (local.get $a)"
    )
    return Task("fibonacci", question, _module(_decls("a", "b", "n", "t"), body), _fibonacci(n))


def _collatz(rng: random.Random) -> Task:
    n = rng.randint(2, 10**6)
    question = rng.choice(
        (
            f"How many steps does the Collatz sequence starting at {n} take to reach 1?",
            f"Starting from {n}, how many Collatz steps (n -> n/2 if even, 3n+1 if odd) are needed to reach 1?",
            f"Count the Collatz steps from {n} down to 1.",
        )
    )
    body = (
        f"(local.set $a {_const(n)}) (loop $l (local.set $r (i64.add (local.get $r) (i64.const 1))) "
        f"(if {ODD.format(v='$a')} (then (local.set $a (i64.add (i64.mul (local.get $a) (i64.const 3)) "
        "(i64.const 1)))) (else (local.set $a (i64.shr_u (local.get $a) (i64.const 1))))) "
        "(br_if $l (i64.ne (local.get $a) (i64.const 1)))) (local.get $r)"
    )
    return Task("collatz", question, _module(_decls("a", "r"), body), _collatz_steps(n))


MAKERS: dict[str, Callable[[random.Random], Task]] = {
    "sum": _sum,
    "product": _product,
    "power": _power,
    "modpow": _modpow,
    "gcd": _gcd,
    "digit_sum": _digit_sum,
    "base": _base,
    "fibonacci": _fibonacci_task,
    "collatz": _collatz,
    "difference": _difference,
}
KINDS: tuple[str, ...] = tuple(MAKERS)


def make_task(kind: str, rng: random.Random) -> Task:
    task = MAKERS[kind](rng)
    assert I64_MIN <= task.answer <= I64_MAX, task
    return task


def make_tasks(n: int, seed: int, kinds: Sequence[str] = KINDS) -> list[Task]:
    """n tasks, round-robin over `kinds`, the same list for the same seed."""
    rng = random.Random(seed)
    return [make_task(kinds[i % len(kinds)], rng) for i in range(n)]


def answer_sentence(task: Task) -> str:
    return f"The answer is {task.answer}."


def _signed(bits: int) -> int:
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def run_wasmtime(program: str) -> int:
    import wasmtime

    store = wasmtime.Store()
    instance = wasmtime.Instance(store, wasmtime.Module(store.engine, wasmtime.wat2wasm(program)), [])
    return instance.exports(store)["main"](store)


def run_processor(program: str) -> int | str:
    """The program's result on our processor, or its trap message."""
    from jaxinfer.processor import run

    result = run(program, "main", [])
    return f"trap: {result.trap}" if result.trap else _signed(result.values[0])


def _token_counter() -> Callable[[str], int] | None:
    try:
        from jaxinfer.tokenizer import load

        tokenizer = load("smollm2-135m")
    except Exception as error:  # the token report is optional
        print(f"(token counts skipped: {error})")
        return None
    return lambda text: len(tokenizer.encode_plain(text))


def check(per_kind: int, seed: int, on_processor: int) -> int:
    """Run every task's program on wasmtime and the first `on_processor` of each kind on our processor."""
    sys.path.insert(0, str(REPO))
    tasks = make_tasks(per_kind * len(KINDS), seed)
    count_tokens = _token_counter()
    failures = 0
    for kind in KINDS:
        mine = [task for task in tasks if task.kind == kind]
        passed = processed = 0
        for index, task in enumerate(mine):
            results = [run_wasmtime(task.program)]
            if index < on_processor:
                results.append(run_processor(task.program))
                processed += results[-1] == task.answer
            ok = all(result == task.answer for result in results)
            passed += ok
            if not ok:
                failures += 1
                print(f"MISMATCH {kind}: {task.question} expected {task.answer}, got {results}\n  {task.program}")
        line = f"{kind:10s} wasmtime {passed}/{len(mine)}  processor {processed}/{min(on_processor, len(mine))}"
        if count_tokens:
            counts = [count_tokens(task.program) for task in mine]
            line += f"  tokens avg {sum(counts) / len(counts):.1f} max {max(counts)}"
        print(line, flush=True)
    print("OK" if failures == 0 else f"{failures} mismatches")
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", type=int, metavar="N", help="check N tasks per kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processor", type=int, default=3, metavar="K",
                        help="with --check: run the first K tasks of each kind on our processor too")
    parser.add_argument("--show", type=int, metavar="N", help="print N example tasks per kind")
    args = parser.parse_args(argv)
    if args.show:
        for task in make_tasks(args.show * len(KINDS), args.seed):
            print(f"[{task.kind}] {task.question}\n{task.program}\n{answer_sentence(task)}\n")
    if args.check:
        return check(args.check, args.seed, args.processor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
