"""Exec mode in generation: a sequence's program runs on the processor's slots inside the step.

When a request with exec on has just produced ``<|exec|>`` ... ``<|/exec|>`` (sampled, or at the
end of its prompt), the sequence pauses: the host compiles the module, loads it into a free slot of
the runner's ``ExecUnit``, and each following step advances it on device. When a step's report
shows the slot halted, the result (or trap) is appended to the sequence as
``<|result|>...<|/result|>`` (or ``<|trap|>...<|/trap|>``) tokens, which the scheduler then
computes like a prompt chunk, so the next sampled token attends to them. Compile errors, limits and
the wall timeout become traps with their own messages. Every run goes to the audit log.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.engine.metrics import EngineStats
from jaxinfer.engine.params import Request
from jaxinfer.engine.sequence import Sequence
from jaxinfer.processor.binary import LimitExceeded
from jaxinfer.processor.instance import compile_module, serve_host_call, trace_lines
from jaxinfer.processor.isa import Status, Trap
from jaxinfer.processor.lower import Unsupported
from jaxinfer.processor.machine_state import SCALAR
from jaxinfer.processor.protocol import ExecTokens, module_hash, program_ids, result_text
from jaxinfer.processor.sessions import SessionMemory
from jaxinfer.processor.unit import ExecReport, ExecUnit, SlotImage
from jaxinfer.processor.wasi import FileMapping, Syscalls
from jaxinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)
audit = logging.getLogger("jaxinfer.audit")
DEFAULT_TENANT = "default"
MAX_CHARS_PER_TOKEN = 32  # result text is cut to this many characters per token of room before it is encoded


@dataclass
class _Run:
    """A program in a slot."""

    seq: Sequence
    source_hash: str
    image: SlotImage
    syscalls: Syscalls
    loaded_after_step: int  # reports of steps launched up to this one predate the load (or the last resume)
    started: float
    timeout: float


def tenant_of(request: Request) -> str:
    return request.tenant or DEFAULT_TENANT


def file_mapping(cfg: EngineConfig, request: Request) -> FileMapping | None:
    """The files a request's programs see: its tenant's namespace under engine.exec_files_root."""
    if not request.params.exec_files:
        return None
    return FileMapping(Path(cfg.exec_files_root), tenant_of(request), request.params.exec_files,
                       cfg.exec_quota_bytes)


class Executor:
    def __init__(self, unit: ExecUnit, tokens: ExecTokens, tokenizer: Tokenizer, cfg: EngineConfig,
                 stats: EngineStats, append_forced: Callable[[Sequence, list[int]], None],
                 room: Callable[[Sequence], int]) -> None:
        """``append_forced`` appends engine-written tokens to a sequence; ``room`` says how many it may
        still receive (max_tokens, max_model_len)."""
        self.unit, self.tokens, self.tokenizer, self.cfg, self.stats = unit, tokens, tokenizer, cfg, stats
        self.append_forced, self.room = append_forced, room
        self.sessions = SessionMemory(cfg.exec_session_bytes, cfg.exec_session_ttl_seconds)
        self.runs: dict[int, _Run] = {}  # slot -> run
        self.pending: list[Sequence] = []  # paused sequences whose program waits for a slot

    @property
    def busy(self) -> bool:
        return bool(self.runs)

    def on_token(self, seq: Sequence) -> None:
        """Pauses ``seq`` when its newest known token closes an exec block."""
        if not seq.params.exec or seq.finish_reason is not None:
            return
        ids = program_ids(seq.tokens(0, seq.num_known), self.tokens)
        if ids is None:
            return
        seq.exec_source = self.tokenizer.decode(ids, skip_special_tokens=False)
        seq.exec_discard = seq.inflight  # a sample already in flight follows <|/exec|>: it is dropped
        self.pending.append(seq)

    def start_pending(self, steps_launched: int) -> None:
        """Compiles waiting programs and loads them into free slots (a compile error is a trap at once)."""
        for seq in list(self.pending):
            if seq.finish_reason is not None:
                self.pending.remove(seq)
                continue
            if seq.inflight:  # the sample drawn after <|/exec|> must be dropped before anything is appended
                continue
            if not self.unit.free:
                return
            self.pending.remove(seq)
            self._start(seq, steps_launched)

    def _start(self, seq: Sequence, steps_launched: int) -> None:
        source = seq.exec_source
        cap = self.cfg.exec_max_instructions
        limit = min(seq.params.exec_max_instructions or cap, cap)
        session = self._session_key(seq)
        snapshot = self.sessions.get(*session) if session else None
        try:
            compiled = compile_module(source)
            base = (snapshot.memory, snapshot.pages) if snapshot and compiled.program.memory else None
            image = self.unit.prepare(compiled, limit, base, trace=True, memory_pages=seq.params.exec_memory_pages)
            syscalls = Syscalls(file_mapping(self.cfg, seq.request),
                                running=lambda: [run.syscalls for run in self.runs.values()])
        except (ValueError, OSError) as error:  # malformed, invalid, unsupported, or a file that went away
            self._reject(seq, module_hash(source), _rejection(error))
            return
        except Exception as error:  # a bug here fails this program only, never the step the batch shares
            log.exception("preparing a program of request %d failed", seq.index)
            self._reject(seq, module_hash(source), f"internal error: {type(error).__name__}: {error}")
            return
        slot = self.unit.free.pop(0)
        self.unit.load(slot, image)
        seq.exec_slot = slot
        cap = self.cfg.exec_timeout_seconds
        timeout = min(seq.params.exec_timeout_seconds or cap, cap)
        self.runs[slot] = _Run(seq, module_hash(source), image, syscalls, steps_launched, time.monotonic(), timeout)

    def collect(self, report: ExecReport | None, step_number: int, steps_launched: int) -> None:
        """Serves system calls, writes back the programs that a step's report shows halted, and those
        past their wall time."""
        now = time.monotonic()
        for slot, run in list(self.runs.items()):
            if report is not None and step_number > run.loaded_after_step:
                scalars = report.scalars[slot]
                status = scalars[SCALAR["status"]]
                if status == Status.SYSCALL:
                    self._serve(slot, run, steps_launched)
                    continue
                if status == Status.TRAPPED:
                    self._end(slot, scalars, Trap(int(scalars[SCALAR["trap"]])).message)
                    continue
                if status == Status.DONE:
                    types = run.image.result_types
                    values = [int(low) | (int(high) << 32 if kind == "I" else 0)
                              for (low, high), kind in zip(report.results[slot], types, strict=False)]
                    self._end(slot, scalars, None, result_text(values, types, bytes(run.syscalls.stdout)))
                    continue
            if now - run.started > run.timeout:
                self._end(slot, self.unit.scalars(slot), Trap.TIMEOUT.message)

    def _serve(self, slot: int, run: _Run, steps_launched: int) -> None:
        """Serves the slot's system call on the host: the program goes on, exits or traps."""
        scalars, registers, memory = self.unit.read(slot)
        outcome = serve_host_call(run.image.code, scalars, registers, memory, run.syscalls)
        if outcome.resume:
            self.unit.resume(slot, scalars, registers, memory)
            run.loaded_after_step = steps_launched  # reports of steps already launched still show SYSCALL
        elif outcome.trap is not None or outcome.exit_code:
            self._end(slot, scalars, outcome.trap or f"exit code {outcome.exit_code}")
        else:  # proc_exit(0)
            self._end(slot, scalars, None, result_text([], "", bytes(run.syscalls.stdout)), memory)

    def _session_key(self, seq: Sequence) -> tuple[str, str] | None:
        session = seq.params.exec_session
        return (tenant_of(seq.request), session) if session else None

    def _end(self, slot: int, scalars: np.ndarray, trap: str | None, text: str = "",
             memory: np.ndarray | None = None) -> None:
        """A program ended (``trap`` None: normally, with ``text``): commit its files and session memory
        on success, write its result or trap back into the sequence, and audit it. ``memory`` is read
        from the device only when a session keeps it."""
        run = self.runs[slot]
        instructions = int(scalars[SCALAR["executed"]])
        trace = trace_lines(self.unit.trace_rows(slot, int(scalars[SCALAR["traced"]])))
        session = self._session_key(run.seq)
        if trap is None and session is not None and memory is None:
            memory = self.unit.memory(slot)
        self._release(slot)
        files: dict[str, bytes] = {}
        if trap is None:
            try:
                files = run.syscalls.commit()
            except OSError as error:
                trap = f"file commit failed: {error.strerror or error}"
        pages = int(scalars[SCALAR["pages"]])
        if trap is None and session is not None and pages:  # a program without memory leaves none to carry
            self.sessions.put(*session, memory, pages)
        branches = int(scalars[SCALAR["branches"]])
        context = (trap if trap is not None else text) + self._trace_text(run, instructions, branches, trace)
        self._audit(run, trap, text, instructions, branches, trace, files)
        self._write_back(run.seq, context, trap is not None)

    def _trace_text(self, run: _Run, instructions: int, branches: int, trace: list[str]) -> str:
        """What of the trace enters the context: nothing, a summary, or the trace lines up to the token limit."""
        mode = run.seq.params.exec_trace
        if mode == "summary":
            touched = ", ".join(sorted(run.syscalls.touched))
            return f"\n[trace] {instructions} instructions, {branches} branches taken" + (
                f", files: {touched}" if touched else "")
        if mode != "full":
            return ""
        cap, limit = self.cfg.exec_max_trace_tokens, run.seq.params.exec_max_trace_tokens
        kept, budget = [], min(cap if limit is None else limit, cap)
        for line in trace:
            budget -= len(self.tokenizer.encode_plain(line + "\n"))
            if budget < 0:
                break
            kept.append(line)
        cut = len(trace) - len(kept)
        full = len(trace) >= self.unit.shape.trace_entries  # the device buffer filled: later records are not kept
        note = f"\n[trace] {cut} more rows not shown" if cut else ""
        return "\n" + "\n".join(kept) + note + (f"\n[trace] stopped after {len(trace)} rows" if full else "")

    def _audit(self, run: _Run, trap: str | None, text: str, instructions: int, branches: int, trace: list[str],
               files: dict[str, bytes]) -> None:
        seq = run.seq
        audit.info(json.dumps({
            "event": "exec", "request_id": seq.request.request_id, "tenant": tenant_of(seq.request),
            "module_sha256": run.source_hash, "instructions": instructions, "branches": branches,
            "trap" if trap is not None else "result": trap if trap is not None else text,
            "seconds": round(time.monotonic() - run.started, 6),
            "files_mapped": list(seq.params.exec_files), "files_touched": sorted(run.syscalls.touched),
            "files_written": {path: hashlib.sha256(data).hexdigest() for path, data in files.items()},
            "trace": trace,
        }))

    def _write_back(self, seq: Sequence, text: str, trap: bool) -> None:
        seq.exec_source = None
        self.stats.exec_programs += 1
        self.stats.exec_traps += trap
        if seq.finish_reason is not None:
            return
        opening, closing = ((self.tokens.trap_open, self.tokens.trap_close) if trap
                            else (self.tokens.result_open, self.tokens.result_close))
        room = self.room(seq)
        content = self.tokenizer.encode_plain(text[: max(0, room - 2) * MAX_CHARS_PER_TOKEN])[: max(0, room - 2)]
        self.append_forced(seq, [opening, *content, closing][:room])

    def _reject(self, seq: Sequence, source_hash: str, message: str) -> None:
        """A program that could not start (malformed, invalid, unsupported, a bad file mapping)."""
        audit.info(json.dumps({"event": "exec", "request_id": seq.request.request_id,
                               "tenant": tenant_of(seq.request), "module_sha256": source_hash,
                               "instructions": 0, "trap": message}))
        self._write_back(seq, message, True)

    def _release(self, slot: int) -> None:
        run = self.runs.pop(slot)
        run.seq.exec_slot = None
        self.unit.stop(slot)
        self.unit.free.append(slot)

    def cancel(self, seq: Sequence) -> None:
        """A finished or aborted sequence gives its slot back (its program is stopped)."""
        if seq in self.pending:
            self.pending.remove(seq)
        if seq.exec_slot is not None:
            self._release(seq.exec_slot)
        seq.exec_source = None


def _rejection(error: Exception) -> str:
    """What a program that could not start writes back: a limit, a missing feature, or the error."""
    if isinstance(error, LimitExceeded):
        return f"limit: {error}"
    return f"unsupported: needs {error}" if isinstance(error, Unsupported) else str(error)
