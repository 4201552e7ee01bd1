"""The batch runner's output: one UTF-8 JSON line per input line, in input order (a result or an error),
appended as the requests finish and made durable line group by line group (flushed and fsynced), so
a crash loses only the lines still in flight; `--resume` finds where a cut-off output ends and goes
on from there. Also the output paths' checks before the model loads, and `write_whole` for files
written at once (the stats summary).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from jaxinfer.batch_lines import Job
from jaxinfer.errors import JaxinferError


def output_record(job: Job, out: Any) -> dict[str, Any]:
    """A line's output record: its error, or its request's text, ids, finish reason, usage and scores."""
    if job.error is not None:
        return {"id": job.id, "error": job.error}
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
    return record


class OrderedOutput:
    """Takes each line's record as it is done, in any order, and appends the records in input order:
    a record waits only for the lines before it. Each group of lines appended is flushed and fsynced
    before the next, so what a crash leaves is a prefix of the full output (plus at most one cut line)."""

    def __init__(self, path: str, first: int = 0):
        """`first`: the position of the first line to write (lines before it are in the file already)."""
        self.path, self.next, self._ready = path, first, {}
        self._file: IO[str] = sys.stdout if path == "-" else _open_for_append(path, truncate=first == 0)

    def put(self, position: int, record: dict[str, Any]) -> None:
        self._ready[position] = _json_line(record)
        group = []
        while self.next in self._ready:
            group.append(self._ready.pop(self.next))
            self.next += 1
        if group:
            self._append("".join(group))

    def _append(self, text: str) -> None:
        try:
            self._file.write(text)
            self._file.flush()
            if self._file is not sys.stdout:
                os.fsync(self._file.fileno())
        except OSError as exc:
            raise JaxinferError(f"--output: cannot write {self.path} ({exc.strerror or exc})") from None

    def close(self) -> None:
        if self._file is not sys.stdout:
            self._file.close()


def _open_for_append(path: str, truncate: bool) -> IO[str]:
    target = Path(path)
    created = not target.exists()
    try:
        stream = open(target, "w" if truncate else "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        if created:  # the new name itself survives a crash only once its folder is synced
            folder = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
    except OSError as exc:
        raise JaxinferError(f"--output: cannot write {path} ({exc.strerror or exc})") from None
    return stream


def resume_point(path: str, jobs: list[Job]) -> int:
    """How many output lines an earlier run of these jobs left whole in `path` (0: none, or no file).

    Each must carry the id of the input line at its position, else the file is not this input's
    output and is left untouched. A last line cut by a crash (no newline) is removed."""
    if path == "-":
        raise JaxinferError("--resume: needs an --output file (stdout cannot be resumed)")
    target = Path(path)
    if not target.exists():
        return 0
    data = target.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    lines = whole.decode("utf-8", errors="replace").splitlines()
    if len(lines) > len(jobs):
        raise JaxinferError(f"--resume: {path} has {len(lines)} lines, more than the input's {len(jobs)}; "
                            "it is not this input's output")
    for number, (line, job) in enumerate(zip(lines, jobs[: len(lines)], strict=True), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or record.get("id", object()) != job.id:
            raise JaxinferError(f"--resume: line {number} of {path} is not the output of input line {job.line} "
                                f"(id {job.id!r}); it is not this input's output")
    if len(whole) < len(data):
        os.truncate(target, len(whole))
    return len(lines)


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
