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

from jaxinfer.engine.sequence import Sequence
from jaxinfer.processor.binary import MalformedModule
from jaxinfer.processor.instance import compile_module, serve_host_call
from jaxinfer.processor.isa import Status, Trap
from jaxinfer.processor.lower import Unsupported
from jaxinfer.processor.protocol import ExecTokens, module_hash, program_ids, result_text
from jaxinfer.processor.sessions import SessionMemory
from jaxinfer.processor.unit import ExecReport, ExecUnit, SlotImage
from jaxinfer.processor.validate import InvalidModule
from jaxinfer.processor.wasi import FileMapping, Syscalls
from jaxinfer.tokenizer import Tokenizer

audit = logging.getLogger("jaxinfer.audit")
DEFAULT_TENANT = "default"


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


class Executor:
    def __init__(self, unit: ExecUnit, tokens: ExecTokens, tokenizer: Tokenizer, max_instructions: int,
                 timeout_seconds: float, append_forced: Callable[[Sequence, list[int]], None],
                 files: Callable[[Sequence], FileMapping | None] = lambda seq: None,
                 sessions: SessionMemory | None = None) -> None:
        self.unit, self.tokens, self.tokenizer = unit, tokens, tokenizer
        self.sessions = sessions or SessionMemory(64 << 20, 3600.0)
        self.files = files  # the request's file mapping (tenant namespace), or None
        self.max_instructions, self.timeout_seconds = max_instructions, timeout_seconds
        self.append_forced = append_forced
        self.runs: dict[int, _Run] = {}  # slot -> run
        self.pending: list[Sequence] = []  # paused sequences whose program waits for a slot
        self.programs_run = 0
        self.traps = 0

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
            if not self.unit.free:
                return
            self.pending.remove(seq)
            self._start(seq, steps_launched)

    def _start(self, seq: Sequence, steps_launched: int) -> None:
        source = seq.exec_source
        limit = min(seq.params.exec_max_instructions or self.max_instructions, self.max_instructions)
        session = self._session_key(seq)
        snapshot = self.sessions.get(*session) if session else None
        try:
            image = self.unit.prepare(compile_module(source), limit,
                                      (snapshot.memory, snapshot.pages) if snapshot else None)
            syscalls = Syscalls(self.files(seq))
        except (MalformedModule, InvalidModule, Unsupported, ValueError, OSError) as error:
            kind = "unsupported: needs " if isinstance(error, Unsupported) else ""
            self._write_back(seq, module_hash(source), f"{kind}{error}", trap=True, instructions=0, seconds=0.0)
            return
        slot = self.unit.free.pop(0)
        self.unit.load(slot, image)
        seq.exec_slot = slot
        self.runs[slot] = _Run(seq, module_hash(source), image, syscalls, steps_launched, time.monotonic(),
                               self.timeout_seconds)

    def collect(self, report: ExecReport | None, step_number: int, steps_launched: int) -> None:
        """Serves system calls, writes back the programs that a step's report shows halted, and those
        past their wall time."""
        now = time.monotonic()
        for slot, run in list(self.runs.items()):
            if report is not None and step_number > run.loaded_after_step:
                status = int(report.status[slot])
                if status == Status.SYSCALL and self._serve(slot, run, steps_launched, now):
                    continue
                if status in (Status.DONE, Status.TRAPPED):
                    self._halted(slot, run, report, status, now)
                    continue
            if now - run.started > run.timeout:
                self._release(slot)
                self._write_back(run.seq, run.source_hash, Trap.TIMEOUT.message, trap=True, instructions=-1,
                                 seconds=now - run.started)

    def _serve(self, slot: int, run: _Run, steps_launched: int, now: float) -> bool:
        """Serves the slot's system call on the host; True when the program goes on."""
        scalars, registers, memory = self.unit.read(slot)
        outcome = serve_host_call(run.image.code, scalars, registers, memory, run.syscalls)
        if outcome.resume:
            self.unit.resume(slot, scalars, registers, memory)
            run.loaded_after_step = steps_launched  # reports of steps already launched still show SYSCALL
            return True
        self._release(slot)
        instructions = int(scalars[6])
        if outcome.trap is not None or outcome.exit_code:
            message = outcome.trap or f"exit code {outcome.exit_code}"
            self._write_back(run.seq, run.source_hash, message, True, instructions, now - run.started)
        else:
            files = run.syscalls.commit()
            session = self._session_key(run.seq)
            if session is not None:
                self.sessions.put(*session, memory, int(scalars[7]))
            text = result_text([], "", bytes(run.syscalls.stdout))
            self._write_back(run.seq, run.source_hash, text, False, instructions, now - run.started, files)
        return True

    def _session_key(self, seq: Sequence) -> tuple[str, str] | None:
        session = seq.params.exec_session
        return (seq.request.tenant or DEFAULT_TENANT, session) if session else None

    def _keep_memory(self, slot: int, seq: Sequence) -> None:
        """A session's program halted normally: its memory is the next turn's starting memory."""
        session = self._session_key(seq)
        if session is not None:
            scalars, _, memory = self.unit.read(slot)
            self.sessions.put(*session, memory, int(scalars[7]))

    def _halted(self, slot: int, run: _Run, report: ExecReport, status: int, now: float) -> None:
        instructions = int(report.executed[slot])
        if status == Status.DONE:
            self._keep_memory(slot, run.seq)
        self._release(slot)
        if status == Status.TRAPPED:
            message = Trap(int(report.trap[slot])).message
            self._write_back(run.seq, run.source_hash, message, True, instructions, now - run.started)
            return
        types = run.image.result_types
        values = [int(low) | (int(high) << 32 if kind == "I" else 0)
                  for (low, high), kind in zip(report.results[slot], types, strict=False)]
        files = run.syscalls.commit()
        text = result_text(values, types, bytes(run.syscalls.stdout))
        self._write_back(run.seq, run.source_hash, text, False, instructions, now - run.started, files)

    def _write_back(self, seq: Sequence, source_hash: str, text: str, trap: bool, instructions: int,
                    seconds: float, files: dict[str, bytes] | None = None) -> None:
        seq.exec_source = None
        self.programs_run += 1
        self.traps += trap
        audit.info(json.dumps({
            "event": "exec", "request_id": seq.request.request_id, "tenant": seq.request.tenant or DEFAULT_TENANT,
            "module_sha256": source_hash, "instructions": instructions,
            "trap" if trap else "result": text, "seconds": round(seconds, 6),
            "files_mapped": list(seq.params.exec_files),
            "files_written": {path: hashlib.sha256(data).hexdigest() for path, data in (files or {}).items()},
        }))
        if seq.finish_reason is not None:
            return
        opening, closing = ((self.tokens.trap_open, self.tokens.trap_close) if trap
                            else (self.tokens.result_open, self.tokens.result_close))
        self.append_forced(seq, [opening, *self.tokenizer.encode_user(text, field="exec result"), closing])

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
