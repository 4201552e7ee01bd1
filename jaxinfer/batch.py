"""Offline batch runner: `python -m jaxinfer.batch --model NAME --input IN.jsonl --output OUT.jsonl`.

Each input line is {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}, with optional
per-line sampling fields. Output lines come in input order, each appended (and fsynced) once it and
the lines before it are done; a malformed line gets an output line with an `error` field naming the
problem, and every other line still runs. After a crash, `--resume` keeps the lines written and runs
the rest (docs/reliability.md).

This module is the command line and the run (the engine settings the lines need, their adapters, the
summary); the input lines are read by `batch_lines.py`, the output written by `batch_output.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from typing import Any

from tqdm import tqdm

from jaxinfer.batch_lines import UNDECODABLE_BYTE, Job, open_input, read_jobs  # noqa: F401 (UNDECODABLE_BYTE: tests)
from jaxinfer.batch_output import OrderedOutput, check_output_paths, output_record, resume_point, write_whole
from jaxinfer.config import EngineConfig, load_engine_config
from jaxinfer.engine.adapters import parse_adapter_spec
from jaxinfer.engine.metrics import EngineStats
from jaxinfer.engine.params import Request, RequestOutput, SamplingParams
from jaxinfer.engine.xla_compiles import XLA_COMPILES
from jaxinfer.errors import CheckpointError, JaxinferError, RequestError
from jaxinfer.parallel.distributed import ProcessGroup, initialize
from jaxinfer.parallel.lockstep import Follower, LeaderStopped, connect

DEFAULT_EXEC_SLOTS = 4  # processor slots when lines run programs and neither --exec-slots nor the config sets them


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.batch", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="registry name or path (GGUF, HF folder, orbax)")
    p.add_argument("--input", required=True, help="JSONL file, or - for stdin")
    p.add_argument("--output", required=True, help="JSONL file, or - for stdout")
    p.add_argument("--resume", action="store_true",
                   help="go on from the lines an interrupted run left in --output (checked against the input's ids); "
                        "without it the output is written from the start")
    p.add_argument("--config", help="engine TOML file (its [engine] table)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off (prompt and output tokens)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="0: off, in [-2, 2]")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="0: off, in [-2, 2]")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="score each prompt token (its logprob given those before it), with its K most likely ids "
                        "(0: none; at most 20)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats-json", help="write the run summary as one JSON object to this path")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=None)
    p.add_argument("--max-seqs", type=int, default=None)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--kv-store", default=None, help="L3 KV tier: a path or tensorstore kvstore URL; pages persist "
                   "across runs (written at the end of the run and on eviction)")
    p.add_argument("--kv-host-pages", type=int, default=None, help="L2 KV tier: evicted pages kept in host memory")
    p.add_argument("--draft-model", default=None, help="speculative decoding: a draft with the model's vocabulary")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="proposals per speculative round at most")
    p.add_argument("--draft-confidence", type=float, default=None,
                   help="a round stops proposing at the draft's first top probability below this")
    p.add_argument("--exec", action="store_true",
                   help="run the programs the model writes in <|exec|> blocks (the processor; per line: \"exec\")")
    p.add_argument("--exec-slots", type=int, default=None,
                   help="processor slots in the step (default: the config's, else 4 when a line runs programs in a "
                        "single process; 0: processor off)")
    p.add_argument("--adapter", default="",
                   help="LoRA adapter for every line (registry name or folder; per line: \"adapter\")")
    p.add_argument("--coordinator", default=None, help="multi-host: HOST:PORT of process 0's coordination "
                   "service, or auto (TPU pod slices); default $JAXINFER_COORDINATOR")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: processes in the group")
    p.add_argument("--process-id", type=int, default=None,
                   help="multi-host: this process (0 is the leader: it reads --input and writes --output)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def default_params(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "frequency_penalty": args.frequency_penalty,
        "presence_penalty": args.presence_penalty,
        "seed": args.seed,
        "prompt_logprobs": args.prompt_logprobs,
        "stop": tuple(args.stop),
        "exec": args.exec,
    }


def to_request(llm, job: Job) -> Request | None:
    try:
        if job.messages is not None:
            request = llm.chat_request(job.messages, job.params, str(job.id))
        else:
            request = llm.request(job.prompt, job.params, str(job.id))
        return dataclasses.replace(request, adapter=job.adapter)
    except (RequestError, ValueError) as exc:
        job.error = f"line {job.line}: {exc}"
        return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from jaxinfer.llm import LLM

    defaults = default_params(args)
    SamplingParams(**defaults)  # a bad command-line value fails before the model loads
    group = initialize(ProcessGroup.resolve(args.coordinator, args.num_processes, args.process_id))
    config = load_engine_config(args.config, **_engine_overrides(args))  # read once: the file may change meanwhile
    channel = connect(group)  # the settings are checked by LLM, with every process joined
    if isinstance(channel, Follower):  # replays the leader's steps; reads and writes nothing
        try:
            llm = LLM(args.model, config, process_group=group, lockstep=channel)
        except LeaderStopped:
            return {"process_id": group.process_id, "steps_replayed": 0}
        return {"process_id": group.process_id, "steps_replayed": llm.serve_follower()}
    try:  # whatever ends the leader's run (a bad input file included) stops the followers too
        check_output_paths(args)
        with open_input(args.input) as stream:
            jobs = read_jobs(stream, defaults)
        first = resume_point(args.output, jobs) if args.resume else 0  # a wrong file fails before the load
        llm = LLM(args.model, _with_line_needs(config, args, jobs[first:], group), process_group=group,
                  lockstep=channel)
        return _run_jobs(args, llm, jobs, first)
    finally:
        if channel is not None:
            channel.stop()


def _engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {"dtype": args.dtype, "max_seqs": args.max_seqs, "num_pages": args.num_pages,
                 "page_size": args.page_size, "kv_store": args.kv_store, "kv_host_pages": args.kv_host_pages,
                 "draft_model": args.draft_model, "num_draft_tokens": args.num_draft_tokens,
                 "draft_confidence": args.draft_confidence,
                 "exec_slots": args.exec_slots}
    return {k: v for k, v in overrides.items() if v is not None}


def _with_line_needs(config: EngineConfig, args: argparse.Namespace, jobs: list[Job],
                     group: ProcessGroup) -> EngineConfig:
    """The engine settings, plus what the lines need: the processor, and a slot per adapter they name.

    In a process group the followers never see the lines, so the lines change nothing there."""
    for job in jobs:
        job.adapter = job.adapter or args.adapter
    if group.distributed:
        return config
    needs: dict[str, Any] = {}
    runs_programs = any(job.params.exec for job in jobs if job.params is not None)  # --exec, or a line's "exec"
    if runs_programs and args.exec_slots is None and not config.exec_slots:
        needs["exec_slots"] = DEFAULT_EXEC_SLOTS
    adapters = _adapters_named(jobs)
    if adapters:  # every adapter the lines name is resident for the whole run, with those of the config
        preloaded = {parse_adapter_spec(spec)[0] for spec in config.adapters}
        needs["max_adapters"] = max(len(set(adapters) | preloaded), config.max_adapters)
    return config.replace(**needs) if needs else config


def _adapters_named(jobs: list[Job]) -> list[str]:
    return sorted({job.adapter for job in jobs if job.error is None} - {""})


def _run_jobs(args: argparse.Namespace, llm, jobs: list[Job], first: int) -> dict[str, Any]:
    """Runs the lines from position `first` on, appending their output lines in order."""
    todo = list(enumerate(jobs))[first:]  # (position, job) of the lines this run writes
    remaining = jobs[first:]
    adapters = _adapters_named(remaining)
    if adapters and llm.config.max_adapters:
        _load_adapters(llm, remaining, adapters)
    start, compiles_at_start = time.perf_counter(), XLA_COMPILES.mark()
    engine, job_of, outputs = llm.engine, {}, []
    output = OrderedOutput(args.output, first)
    try:
        engine.prefetch_guided(job.params for _, job in todo if job.error is None)
        for position, job in todo:
            _submit(llm, position, job, job_of)
            if job.error is not None:
                output.put(position, output_record(job, None))
        bar = tqdm(total=len(job_of), desc="requests", unit="req", disable=args.no_progress, file=sys.stderr)
        while engine.has_unfinished():
            for out in engine.step():
                position, job = job_of[out.index]
                output.put(position, output_record(job, out))
                outputs.append(out)
                bar.update(1)
        bar.close()
    finally:
        output.close()
    wall = time.perf_counter() - start
    engine.persist_prefix_cache()  # with an L3 store, a later run reuses this run's prefix pages
    return _summary(args, llm, remaining, outputs, wall, XLA_COMPILES.since(compiles_at_start), first)


def _submit(llm, position: int, job: Job, job_of: dict[int, tuple[int, Job]]) -> None:
    """Queues a line's request; a line that fails validation gets its error instead (it fails alone)."""
    request = to_request(llm, job) if job.error is None else None
    if request is not None:
        try:
            job_of[llm.engine.add_request(request).index] = (position, job)
        except RequestError as exc:
            job.error = f"line {job.line}: {exc}"


def _summary(args: argparse.Namespace, llm, jobs: list[Job], outputs: list[RequestOutput], wall: float,
             compiles: int, resumed: int) -> dict[str, Any]:
    completion = sum(o.usage.completion_tokens for o in outputs)
    metrics = llm.engine.metrics()
    return {
        "requests": len(jobs),
        "resumed_lines": resumed,  # output lines an earlier run had written (--resume), not run again
        "errors": sum(1 for j in jobs if j.error),
        "prompt_tokens": sum(o.usage.prompt_tokens for o in outputs),
        "completion_tokens": completion,
        "cached_prompt_tokens": sum(o.usage.cached_tokens for o in outputs),
        **cached_by_tier(sum(o.usage.cached_tokens for o in outputs), llm.engine.stats),
        "forged_tokens_downgraded": llm.engine.stats.forged_tokens_downgraded,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(completion / wall, 2) if wall > 0 else 0.0,
        "steps": llm.engine.stats.steps,
        "tokens_per_step": round(metrics["tokens_per_step"], 1),
        "host_fraction": round(metrics["host_fraction"], 4),
        "preemptions": llm.engine.stats.preemptions,
        "spec_proposed": llm.engine.stats.spec_proposed,
        "exec_programs": llm.engine.stats.exec_programs,
        "exec_traps": llm.engine.stats.exec_traps,
        "exec_idle_steps": llm.engine.stats.exec_idle_steps,
        "spec_accepted": llm.engine.stats.spec_accepted,
        "spec_draft_refilled_tokens": llm.engine.stats.spec_draft_refilled_tokens,
        "load_s": round(llm.load_seconds, 3),
        "warmup_s": round(llm.warmup_seconds, 3),
        "xla_compiles_after_warmup": compiles,  # XLA programs of any kind compiled (or loaded) during the run
        "model": str(args.model),
    }


def _load_adapters(llm, jobs: list[Job], adapters: list[str]) -> None:
    """Loads each adapter under the name the lines give it; lines naming one that fails get its error."""
    failed, loaded = {}, {info.name for info in llm.list_adapters()}  # engine.adapters are loaded at start
    for name in adapters:
        if name in loaded:
            continue
        try:
            llm.load_adapter(name, name)
        except (CheckpointError, RequestError) as exc:
            failed[name] = str(exc)
    for job in jobs:
        if job.error is None and job.adapter in failed:
            job.error = f"line {job.line}: adapter: {failed[job.adapter]}"


def cached_by_tier(cached: int, stats: EngineStats) -> dict[str, int]:
    """Cached prompt tokens split by the tier they came from (device pages, host memory, the store)."""
    l2, l3 = stats.prefix_hit_tokens_l2, stats.prefix_hit_tokens_l3
    return {"cached_tokens_l1": cached - l2 - l3, "cached_tokens_l2": l2, "cached_tokens_l3": l3}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s", force=True)  # orbax adds a root handler on import
    try:
        summary = run(args)
    except JaxinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "steps_replayed" in summary:  # a follower of a process group
        print(f"process {summary['process_id']}: replayed {summary['steps_replayed']} steps", file=sys.stderr)
        return 0
    print(
        f"{summary['requests']} requests ({summary['errors']} errors), {summary['prompt_tokens']} prompt + "
        f"{summary['completion_tokens']} completion tokens in {summary['wall_s']:.1f}s "
        f"({summary['tokens_per_s']:.1f} tokens/s)",
        file=sys.stderr,
    )
    if summary["xla_compiles_after_warmup"]:  # each one stalled the run; warm-up should have made it
        print(f"warning: {summary['xla_compiles_after_warmup']} XLA programs compiled after warm-up", file=sys.stderr)
    if args.stats_json:
        try:
            write_whole(args.stats_json, json.dumps(summary) + "\n", "--stats-json")
        except JaxinferError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
