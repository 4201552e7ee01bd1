"""Evaluates the exec adapter: exact-answer accuracy on fresh held-out questions, base model versus adapter + processor.

    python tools/eval_exec.py --per-kind 20 --seed 1234 [--adapter smollm2-135m-exec] [--json out.json]

Questions come from `tools/exec_tasks.py` with a seed of their own (generated at run time; any
question that also occurs in the adapter's training set is drawn again). Both runs use greedy
decoding through `LLM.generate_chat`:
  (a) the base model alone, exec off: correct when the last integer in its answer is the answer;
  (b) base + adapter + processor, exec on: correct when the last integer after the program's
      result block is the answer. Also counted: answers with no program, programs refused by the
      validator or compiler, and programs that trapped.
Not a test: it prints a table per kind and the totals, and writes them as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from exec_tasks import KINDS, Task, make_task, make_tasks  # noqa: E402

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.processor.protocol import EXEC_OPEN, RESULT_CLOSE, TRAP_CLOSE, TRAP_OPEN  # noqa: E402

INTEGER = re.compile(r"-?\d+")
COMPILE_ERRORS = ("invalid", "malformed", "unsupported", "type mismatch", "unknown", "expected", "compile")


def held_out(per_kind: int, seed: int, training: tuple[int, int]) -> list[Task]:
    """`per_kind` fresh questions of each kind, none of them in the training set (examples, seed)."""
    seen = {task.question for task in make_tasks(*training)}
    rng, tasks = random.Random(seed), []
    for kind in KINDS:
        while sum(t.kind == kind for t in tasks) < per_kind:
            task = make_task(kind, rng)
            if task.question not in seen:
                tasks.append(task)
    return tasks


def last_integer(text: str) -> int | None:
    found = INTEGER.findall(text)
    return int(found[-1]) if found else None


def grade_exec(text: str, task: Task) -> str:
    """correct | wrong | no_program | refused | trapped for an exec-mode answer."""
    if EXEC_OPEN not in text:
        return "correct" if last_integer(text) == task.answer else "no_program"
    if TRAP_OPEN in text:
        reason = text.split(TRAP_OPEN, 1)[1].split(TRAP_CLOSE, 1)[0].lower()
        return "refused" if any(word in reason for word in COMPILE_ERRORS) else "trapped"
    if RESULT_CLOSE not in text:
        return "wrong"
    return "correct" if last_integer(text.rsplit(RESULT_CLOSE, 1)[1]) == task.answer else "wrong"


def run(llm: LLM, tasks: list[Task], adapter: str, exec_on: bool, max_tokens: int) -> tuple[list[str], list[str]]:
    """(outcome, output text) per task."""
    chats = [[{"role": "user", "content": task.question}] for task in tasks]
    # Every right program needs under 100k instructions: a runaway one traps at 1M instead of holding its slot.
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, exec=exec_on,
                            exec_max_instructions=1_000_000 if exec_on else None)
    texts = [out.text for out in llm.generate_chat(chats, params, adapter=adapter if exec_on else "")]
    if exec_on:
        return [grade_exec(text, task) for text, task in zip(texts, tasks, strict=True)], texts
    return ["correct" if last_integer(text) == task.answer else "wrong"
            for text, task in zip(texts, tasks, strict=True)], texts


def summarize(tasks: list[Task], base: list[str], adapted: list[str]) -> dict:
    report = {}
    for kind in (*KINDS, "total"):
        rows = [i for i, t in enumerate(tasks) if kind in ("total", t.kind)]
        entry = {"questions": len(rows), "base_accuracy": sum(base[i] == "correct" for i in rows) / len(rows)}
        for outcome in ("correct", "wrong", "no_program", "refused", "trapped"):
            entry[f"adapter_{outcome}"] = sum(adapted[i] == outcome for i in rows) / len(rows)
        report[kind] = entry
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--adapter", default="smollm2-135m-exec", help="registry name or folder")
    p.add_argument("--per-kind", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--training", default="4000,0", help="the adapter's training set: examples,seed (excluded)")
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    started = time.perf_counter()
    examples, training_seed = (int(x) for x in args.training.split(","))
    tasks = held_out(args.per_kind, args.seed, (examples, training_seed))
    llm = LLM(args.model, str(REPO / "configs" / "engine-cpu.toml"), exec_slots=8, max_adapters=1,
              max_lora_rank=16, max_seqs=32)
    llm.load_adapter("exec", args.adapter)
    base, base_texts = run(llm, tasks, "", False, 64)
    adapted, adapted_texts = run(llm, tasks, "exec", True, args.max_tokens)
    samples = [{"kind": t.kind, "question": t.question, "answer": t.answer, "base": b, "base_text": bt,
                "adapter": a, "adapter_text": at}
               for t, b, bt, a, at in zip(tasks, base, base_texts, adapted, adapted_texts, strict=True)]
    report = {"command": " ".join(["python", *sys.argv]), "seed": args.seed, "per_kind": args.per_kind,
              "seconds": round(time.perf_counter() - started, 1), "kinds": summarize(tasks, base, adapted),
              "samples": samples}
    print(f"{'kind':<11} {'base':>6} {'adapter':>8} {'wrong':>6} {'no prog':>8} {'refused':>8} {'trapped':>8}")
    for kind, entry in report["kinds"].items():
        print(f"{kind:<11} {entry['base_accuracy']:>6.1%} {entry['adapter_correct']:>8.1%} "
              f"{entry['adapter_wrong']:>6.1%} {entry['adapter_no_program']:>8.1%} {entry['adapter_refused']:>8.1%} "
              f"{entry['adapter_trapped']:>8.1%}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
