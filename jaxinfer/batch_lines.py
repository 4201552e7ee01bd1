"""The batch runner's input: the JSONL file read (non-UTF-8 bytes kept for their line's error) and each line
parsed and checked into a `Job`; a malformed line's job carries its error, and every other line still runs.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, fields
from typing import Any, TextIO

from jaxinfer.engine.params import SamplingParams
from jaxinfer.errors import JaxinferError, RequestError

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
LINE_FIELDS = {"id", "prompt", "messages", "adapter"} | SAMPLING_FIELDS
UNDECODABLE_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape decodes a non-UTF-8 byte to


@dataclass
class Job:
    line: int
    id: Any
    prompt: str | None = None
    messages: list | None = None
    params: SamplingParams | None = None
    adapter: str = ""  # a LoRA adapter (registry name or folder) for this line; "": --adapter's
    error: str | None = None


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


def open_input(path: str) -> TextIO:
    # Bytes that are not UTF-8 decode to lone surrogates, which `parse_line` reports for their line only.
    if path == "-":
        return os.fdopen(os.dup(sys.stdin.fileno()), encoding="utf-8", errors="surrogateescape")
    try:
        return open(path, encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        raise JaxinferError(f"--input: file not found: {path}") from None
