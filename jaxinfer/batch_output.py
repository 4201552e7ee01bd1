"""The batch runner's output: the output lines in input order (a result or an error per line) as UTF-8 JSONL,
written whole through a temporary file, with the output paths checked before the model loads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from jaxinfer.batch_lines import Job
from jaxinfer.errors import JaxinferError


def write_output(path: str, jobs: list[Job], results: dict[int, Any]) -> None:
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
    write_whole(path, text, "--output")


def _pairs(tops: list[list[tuple[int, float]]]) -> list[list[list[int | float]]]:
    """Per token, its (id, logprob) alternatives as JSON arrays."""
    return [[[token, logprob] for token, logprob in top] for top in tops]


def write_whole(path: str, text: str, flag: str) -> None:
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
