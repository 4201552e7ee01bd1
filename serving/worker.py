"""The engine's own thread: it alone touches the engine, fed by a bounded command queue, and streams deltas out.

The gRPC event loop never waits on the device. It submits a request (or a cancellation) as a
command; the worker applies commands between steps, runs `Engine.step()` while there is work, and
after each step hands every stream its new tokens and text through `deliver`, a thread-safe
callback (the server passes `loop.call_soon_threadsafe` into an asyncio queue). A cancellation
is applied before the next step, so the request's pages are free within one step.

Stop strings are never streamed: while a request with stop strings runs, the last
`len(longest stop) - 1` characters are held back; the final message carries the remainder of the
engine's own output text, so the concatenated deltas equal `LLM.generate`'s text.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from jaxinfer.engine.engine import Engine
from jaxinfer.engine.params import Request, RequestOutput
from jaxinfer.engine.sequence import Sequence
from jaxinfer.errors import JaxinferError
from jaxinfer.tokenizer.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """New output of one request since its previous delta; `final` carries the finished output."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    final: RequestOutput | None = None
    error: str | None = None


@dataclass
class _Stream:
    request: Request
    deliver: Callable[[Delta], None]
    seq: Sequence | None = None
    detokenizer: IncrementalDetokenizer | None = None
    sent_tokens: int = 0
    sent_text: str = ""
    holdback: int = 0
    pending_text: str = ""  # decoded but held back (could be the start of a stop string)


@dataclass
class _Command:
    kind: str  # add | abort
    stream: _Stream


class QueueFull(JaxinferError):
    """The worker's command queue is at its bound."""


class EngineWorker:
    def __init__(self, engine: Engine, max_queued: int = 1024):
        self.engine = engine
        self._commands: queue.Queue[_Command] = queue.Queue(maxsize=max_queued)
        self._streams: dict[int, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # -- called from other threads ----------------------------------------------------------
    def submit(self, request: Request, deliver: Callable[[Delta], None]) -> _Stream:
        """Queues a validated request; its deltas go to `deliver` (called on the worker thread)."""
        self.engine.validate(request.prompt_ids, request.params)
        stream = _Stream(request, deliver)
        try:
            self._commands.put_nowait(_Command("add", stream))
        except queue.Full:
            raise QueueFull(f"engine queue: {self._commands.maxsize} commands pending, the limit") from None
        return stream

    def cancel(self, stream: _Stream) -> None:
        """Cancels a submitted request; its pages are freed before the next step."""
        self._commands.put(_Command("abort", stream))

    # -- the worker thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished()
            self._apply_commands(block=not busy)
            if not self.engine.has_unfinished():
                continue
            try:
                finished = self.engine.step()
            except Exception as exc:  # the step failed: end every stream rather than hang them
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {exc}")
                continue
            self._publish(finished)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Command) -> None:
        stream = command.stream
        if command.kind == "add":
            try:
                stream.seq = self.engine.add_request(stream.request)
            except JaxinferError as exc:
                stream.deliver(Delta("", [], [], error=str(exc)))
                return
            stop = stream.request.params.stop
            stream.holdback = max((len(s) for s in stop), default=1) - 1
            stream.detokenizer = IncrementalDetokenizer(self.engine.tokenizer)
            self._streams[stream.seq.index] = stream
        elif command.kind == "abort" and stream.seq is not None and stream.seq.index in self._streams:
            del self._streams[stream.seq.index]
            self.engine.abort(stream.seq.index)

    def _publish(self, finished: list[RequestOutput]) -> None:
        done = {out.index: out for out in finished}
        for index, stream in list(self._streams.items()):
            final = done.get(index)
            delta = self._final_delta(stream, final) if final else self._running_delta(stream)
            if final:
                del self._streams[index]
            if delta is not None:
                stream.deliver(delta)

    def _new_tokens(self, stream: _Stream, upto: int) -> tuple[list[int], list[float]]:
        seq = stream.seq
        tokens = seq.output_ids[stream.sent_tokens : upto]
        logprobs = seq.logprobs[stream.sent_tokens : upto]
        stream.sent_tokens = upto
        return tokens, logprobs

    def _running_delta(self, stream: _Stream) -> Delta | None:
        tokens, logprobs = self._new_tokens(stream, len(stream.seq.output_ids))
        if not tokens:
            return None
        stream.pending_text += "".join(stream.detokenizer.push(t) for t in tokens)
        cut = max(0, len(stream.pending_text) - stream.holdback)
        text, stream.pending_text = stream.pending_text[:cut], stream.pending_text[cut:]
        stream.sent_text += text
        return Delta(text, tokens, logprobs if stream.request.params.logprobs else [])

    def _final_delta(self, stream: _Stream, final: RequestOutput) -> Delta:
        tokens, logprobs = self._new_tokens(stream, len(final.token_ids))
        if final.text.startswith(stream.sent_text):
            text = final.text[len(stream.sent_text) :]
        else:  # the incremental text diverged from the full decode (byte-fallback edge cases)
            log.warning("request %s: streamed text differs from the final decode", final.request_id)
            text = ""
        return Delta(text, tokens, logprobs if stream.request.params.logprobs else [], final=final)

    def _fail_all(self, message: str) -> None:
        for index, stream in list(self._streams.items()):
            self.engine.abort(index)
            stream.deliver(Delta("", [], [], error=message))
        self._streams.clear()
