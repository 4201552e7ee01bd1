"""Offline batch runner: `python -m jaxinfer.batch --model NAME --input IN.jsonl --output OUT.jsonl`.

Each input line is {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}, with optional
per-line sampling fields. Output lines come in input order; a malformed line gets an output line
with an `error` field naming the problem, and every other line still runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from jaxinfer.config import EngineConfig, load_engine_config
from jaxinfer.engine.adapters import parse_adapter_spec
from jaxinfer.engine.metrics import EngineStats
from jaxinfer.engine.params import Request, RequestOutput, SamplingParams
from jaxinfer.engine.xla_compiles import XLA_COMPILES
from jaxinfer.errors import CheckpointError, JaxinferError, RequestError
from jaxinfer.parallel.distributed import ProcessGroup, initialize
from jaxinfer.parallel.lockstep import Follower, LeaderStopped, connect

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
LINE_FIELDS = {"id", "prompt", "messages", "adapter"} | SAMPLING_FIELDS
UNDECODABLE_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape decodes a non-UTF-8 byte to
DEFAULT_EXEC_SLOTS = 4  # processor slots when lines run programs and neither --exec-slots nor the config sets them


@dataclass
class Job:
    line: int
    id: Any
    prompt: str | None = None
    messages: list | None = None
    params: SamplingParams | None = None
    adapter: str = ""  # a LoRA adapter (registry name or folder) for this line; "": --adapter's
    error: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.batch", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="registry name or path (GGUF, HF folder, orbax)")
    p.add_argument("--input", required=True, help="JSONL file, or - for stdin")
    p.add_argument("--output", required=True, help="JSONL file, or - for stdout")
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


class _NonStandardNumber(Exception):
    """NaN, Infinity or -Infinity in an input line."""


def _refuse_constant(name: str) -> None:
    raise _NonStandardNumber(name)


def parse_line(number: int, text: str, defaults: dict[str, Any]) -> Job:
    """One input line as a job, or a job that carries the line's error (the other lines still run)."""
    undecodable = UNDECODABLE_BYTE.search(text)
    if undecodable is not None:  # a byte that is not UTF-8, kept by the input's surrogateescape decoding
        byte, column = ord(undecodable.group()) - 0xDC00, undecodable.start() + 1
        return Job(number, None, error=f"line {number}: invalid UTF-8 (byte 0x{byte:02x} at column {column})")
    try:
        record = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        return Job(number, None, error=f"line {number}: invalid JSON ({exc.msg}, column {exc.colno})")
    except _NonStandardNumber as exc:  # Python's json reads them, but they are not JSON: the output could not be
        return Job(number, None, error=f"line {number}: invalid JSON ({exc} is not a JSON number)")
    except ValueError:  # the one other ValueError json raises: Python's integer conversion limit
        return Job(number, None, error=f"line {number}: invalid JSON (an integer has more than "
                                       f"{sys.get_int_max_str_digits()} digits)")
    except RecursionError:
        return Job(number, None, error=f"line {number}: invalid JSON (nested deeper than the parser's recursion "
                                       "limit)")
    if not isinstance(record, dict):
        return Job(number, None, error=f"line {number}: expected a JSON object")
    job = Job(number, record.get("id", number))
    unknown = sorted(set(record) - LINE_FIELDS)
    has_prompt, has_messages = "prompt" in record, "messages" in record
    try:
        if unknown:
            raise RequestError(f"unknown field(s) {', '.join(unknown)}")
        if has_prompt == has_messages:
            raise RequestError("give exactly one of prompt or messages")
        if has_prompt and not (isinstance(record["prompt"], str | list) and record["prompt"]):
            raise RequestError('prompt: must be a non-empty string or a list of parts (strings and {"special": NAME})')
        if has_messages and not isinstance(record["messages"], list):
            raise RequestError("messages: must be a list of {role, content} objects")
        job.adapter = record.get("adapter", "")
        if not isinstance(job.adapter, str):
            raise RequestError("adapter: must be a string (a registry name or an adapter folder)")
        overrides = {k: record[k] for k in SAMPLING_FIELDS if k in record}
        if isinstance(overrides.get("stop"), list):
            overrides["stop"] = tuple(overrides["stop"])
        job.params = SamplingParams(**{**defaults, **overrides})
    except (RequestError, TypeError) as exc:
        job.error = f"line {number}: {exc}"
        return job
    job.prompt, job.messages = record.get("prompt"), record.get("messages")
    return job


def read_jobs(stream: TextIO, defaults: dict[str, Any]) -> list[Job]:
    return [parse_line(n, line, defaults) for n, line in enumerate(stream, 1) if line.strip()]


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
        with _open_input(args.input) as stream:
            jobs = read_jobs(stream, defaults)
        llm = LLM(args.model, _with_line_needs(config, args, jobs, group), process_group=group, lockstep=channel)
        return _run_jobs(args, llm, jobs)
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


def _run_jobs(args: argparse.Namespace, llm, jobs: list[Job]) -> dict[str, Any]:
    adapters = _adapters_named(jobs)
    if adapters and llm.config.max_adapters:
        _load_adapters(llm, jobs, adapters)
    start, compiles_at_start = time.perf_counter(), XLA_COMPILES.mark()
    engine, job_of = llm.engine, {}
    for job in jobs:
        request = to_request(llm, job) if job.error is None else None
        if request is not None:
            try:
                job_of[engine.add_request(request).index] = job  # validates; a bad line fails alone
            except RequestError as exc:
                job.error = f"line {job.line}: {exc}"
    bar = tqdm(total=len(job_of), desc="requests", unit="req", disable=args.no_progress, file=sys.stderr)
    results: dict[int, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            results[id(job_of[out.index])] = out
            bar.update(1)
    bar.close()
    outputs = list(results.values())
    wall = time.perf_counter() - start
    engine.persist_prefix_cache()  # with an L3 store, a later run reuses this run's prefix pages
    compiles = XLA_COMPILES.since(compiles_at_start)
    _write_output(args.output, jobs, results)
    completion = sum(o.usage.completion_tokens for o in outputs)
    metrics = llm.engine.metrics()
    return {
        "requests": len(jobs),
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


def _open_input(path: str) -> TextIO:
    # Bytes that are not UTF-8 decode to lone surrogates, which `parse_line` reports for their line only.
    if path == "-":
        return os.fdopen(os.dup(sys.stdin.fileno()), encoding="utf-8", errors="surrogateescape")
    try:
        return open(path, encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        raise JaxinferError(f"--input: file not found: {path}") from None


def _write_output(path: str, jobs: list[Job], results: dict[int, Any]) -> None:
    lines = []
    for job in jobs:
        if job.error is not None:
            lines.append({"id": job.id, "error": job.error})
            continue
        out = results[id(job)]
        record = {
            "id": job.id,
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "usage": {"prompt_tokens": out.usage.prompt_tokens, "completion_tokens": out.usage.completion_tokens,
                      "cached_tokens": out.usage.cached_tokens},
        }
        if out.logprobs is not None:
            record["logprobs"] = out.logprobs
        if out.top_logprobs is not None:
            record["top_logprobs"] = _pairs(out.top_logprobs)
        if out.prompt_logprobs is not None:
            record["prompt_logprobs"] = out.prompt_logprobs  # null for the first token
        if out.prompt_top_logprobs is not None:
            record["prompt_top_logprobs"] = _pairs(out.prompt_top_logprobs)
        lines.append(record)
    text = "".join(_json_line(r) for r in lines)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    _write_whole(path, text, "--output")


def _pairs(tops: list[list[tuple[int, float]]]) -> list[list[list[int | float]]]:
    """Per token, its (id, logprob) alternatives as JSON arrays."""
    return [[[token, logprob] for token, logprob in top] for top in tops]


def _write_whole(path: str, text: str, flag: str) -> None:
    """Writes a file through a temporary file of its own in the same folder, renamed over the target, so
    a reader never sees half of it and two runs writing the same path do not share a temporary file."""
    target, tmp = Path(path), None
    try:
        descriptor, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), _file_mode(target))  # mkstemp's are 0600; an output is an ordinary file
            out.write(text)
        os.replace(tmp, target)
    except OSError as exc:
        raise JaxinferError(f"{flag}: cannot write {path} ({exc.strerror or exc})") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _file_mode(target: Path) -> int:
    """The mode a plain `open(target, "w")` would leave: the existing file's, or 0666 less the umask."""
    if target.exists():
        return target.stat().st_mode & 0o777
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process umask, read without setting it (`os.umask` would change it for other threads a moment)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def check_output_paths(args: argparse.Namespace) -> None:
    """Fails before the model loads, rather than losing a finished run's results at the end."""
    for flag, path in (("--output", args.output), ("--stats-json", args.stats_json)):
        if not path or path == "-":
            continue
        target = Path(path)
        if target.is_dir():
            raise JaxinferError(f"{flag}: {path} is a folder")
        if not target.parent.is_dir():
            raise JaxinferError(f"{flag}: folder not found: {target.parent}")
        if not os.access(target.parent, os.W_OK):
            raise JaxinferError(f"{flag}: folder not writable: {target.parent}")
        if args.input != "-" and target.exists() and Path(args.input).exists() \
                and os.path.samefile(args.input, target):
            raise JaxinferError(f"{flag}: {path} is the input file; the run would replace it")


def _json_line(record: dict[str, Any]) -> str:
    """A record as one line of UTF-8 JSON; one that holds text UTF-8 cannot carry (an id with a lone
    surrogate from a JSON escape) is written with escapes instead, so no record stops the output."""
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(record)
    return line + "\n"


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
            _write_whole(args.stats_json, json.dumps(summary) + "\n", "--stats-json")
        except JaxinferError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
