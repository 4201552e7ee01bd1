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
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from jaxinfer.engine.engine import Engine
from jaxinfer.engine.params import Request, RequestOutput
from jaxinfer.engine.replicas import ReplicaStepFailed
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
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, with top_logprobs
    # With prompt_logprobs, on the first delta once the prompt is scored (or the final one): the scored prompt.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None
    invalid: bool = False  # the error is the request's own (INVALID_ARGUMENT), not the server's (INTERNAL)


@dataclass
class _Stream:
    request: Request
    deliver: Callable[[Delta], None]
    seq: Sequence | None = None
    detokenizer: IncrementalDetokenizer | None = None
    sent_tokens: int = 0
    sent_prompt: bool = False  # the prompt's scores (prompt_logprobs) went out
    sent_text: str = ""
    holdback: int = 0
    pending_text: str = ""  # decoded but held back (could be the start of a stop string)
    cancelled: bool = False


class QueueFull(JaxinferError):
    """The worker's queue of new requests is at its bound."""


class WorkerDead(JaxinferError):
    """The engine thread stopped on an unexpected error; the server cannot take requests."""


class EngineWorker:
    def __init__(self, engine: Engine, max_queued: int = 1024, on_dead: Callable[[str], None] | None = None):
        """`max_queued`: requests that may wait to start beyond the `max_seqs` the engine runs at once;
        `on_dead(reason)`: called on the engine thread if it stops on an unexpected error."""
        self.engine = engine
        self.on_dead = on_dead
        self.max_queued = max_queued
        self._capacity = engine.max_running  # requests that run at once (over every replica); more wait
        self._adds: queue.Queue[_Stream] = queue.Queue(maxsize=max_queued + self._capacity)
        self._aborts: queue.SimpleQueue[_Stream] = queue.SimpleQueue()  # unbounded: cancel never blocks
        self._calls: queue.SimpleQueue[tuple[Callable[[Engine], Any], Future]] = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}
        self._stop = threading.Event()
        self.dead: str | None = None  # why the engine thread stopped, if it did
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
    @property
    def waiting(self) -> int:
        """Requests waiting to start beyond the `max_seqs` the engine runs at once (negative: room left).
        Read from any thread: lengths of the scheduler's lists, off by at most a request in transit."""
        return self._adds.qsize() + self.engine.num_requests - self._capacity

    def submit(self, request: Request, deliver: Callable[[Delta], None]) -> _Stream:
        """Queues a validated request; its deltas go to `deliver` (called on the worker thread)."""
        if self.dead is not None:
            raise WorkerDead(f"the engine stopped: {self.dead}")
        self.engine.validate(request)
        stream = _Stream(request, deliver)
        try:
            if self.waiting >= self.max_queued:
                raise queue.Full
            self._adds.put_nowait(stream)
        except queue.Full:
            raise QueueFull(f"serve.max_queued: {self.max_queued} requests are waiting to start, the limit; "
                            "retry later") from None
        return stream

    def cancel(self, stream: _Stream) -> None:
        """Cancels a submitted request without blocking; its pages are freed before the next step."""
        stream.cancelled = True
        self._aborts.put(stream)

    def call(self, fn: Callable[[Engine], Any]) -> Future:
        """Runs `fn(engine)` on the worker thread between steps (adapter loads); its result or error
        arrives in the returned future."""
        if self.dead is not None:
            raise WorkerDead(f"the engine stopped: {self.dead}")
        future: Future = Future()
        self._calls.put((fn, future))
        return future

    # -- the worker thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._step()
        except Exception as exc:  # a bug outside the step: end every stream rather than leave them hanging
            log.exception("engine thread stopped")
            self.dead = f"{type(exc).__name__}: {exc}"
            if self.on_dead is not None:
                self.on_dead(self.dead)
        self._end_everything(f"engine thread stopped: {self.dead}" if self.dead else "the server stopped")

    def _end_everything(self, message: str) -> None:
        """The thread is ending: every request it holds or has queued gets `message` as its error and
        leaves the engine (its pages freed), and every queued call fails."""
        while True:
            try:
                self._adds.get_nowait().deliver(Delta("", [], [], error=message))
            except queue.Empty:
                break
        while True:
            try:
                self._abort(self._aborts.get_nowait())
            except queue.Empty:
                break
        self._fail_all(message)
        self._fail_calls(WorkerDead(f"the engine stopped: {self.dead or 'shut down'}"))

    def _fail_calls(self, error: Exception) -> None:
        """Answers every queued call with `error` (the thread is ending)."""
        while True:
            try:
                _, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _step(self) -> None:
        try:
            self._publish(self.engine.step())
        except ReplicaStepFailed as exc:  # only the failed replicas' streams end; the others go on
            log.error("engine step failed on some replicas: %s", exc, exc_info=exc)
            self._fail_all(f"engine step failed: {exc}", only=exc.failed_request)
            try:
                self._publish(exc.finished)
            except Exception as error:  # as below: end every stream, keep the thread
                log.exception("handing out a step's outputs failed")
                self._fail_all(f"engine step failed: {error}")
            if exc.all_failed:  # nothing is left to serve: the thread stops, health says NOT_SERVING
                raise RuntimeError(f"every replica has failed ({exc})") from exc
        except Exception as exc:  # the step (or handing out its tokens) failed: end every stream, not hang them
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {exc}")

    def _take_commands(self, block: bool) -> None:
        try:
            first = self._adds.get(timeout=0.05) if block else self._adds.get_nowait()
            self._add(first)
            while True:
                self._add(self._adds.get_nowait())
        except queue.Empty:
            pass
        while True:  # after the adds: a cancel may refer to a request added just now
            try:
                self._abort(self._aborts.get_nowait())
            except queue.Empty:
                break
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():  # the caller gave up (deadline, cancel): skip it
                continue
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:  # the caller gets the error, the engine goes on
                future.set_exception(exc)

    def _add(self, stream: _Stream) -> None:
        if stream.cancelled:
            return
        try:
            stream.seq = self.engine.add_request(stream.request)
        except JaxinferError as exc:  # valid when submitted, not now (an adapter unloaded in between)
            stream.deliver(Delta("", [], [], error=str(exc), invalid=True))
            return
        except Exception as exc:  # an engine bug: this request fails, the others keep running
            log.exception("could not add request %r", stream.request.request_id)
            stream.deliver(Delta("", [], [], error=f"could not add the request: {type(exc).__name__}: {exc}"))
            return
        stop = stream.request.params.stop
        stream.holdback = max((len(s) for s in stop), default=1) - 1
        stream.detokenizer = IncrementalDetokenizer(self.engine.tokenizer,
                                                    keep=self.engine.shown_special_ids(stream.request.params))
        self._streams[stream.seq.index] = stream

    def _abort(self, stream: _Stream) -> None:
        if stream.seq is not None and self._streams.get(stream.seq.index) is stream:
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
        return tokens, logprobs

    @staticmethod
    def _sent(stream: _Stream, delta: Delta) -> Delta:
        """The delta with its tokens' alternatives and the prompt's scores (when asked for), its tokens
        counted as sent."""
        upto = stream.sent_tokens + len(delta.token_ids)
        if stream.request.params.top_logprobs:
            delta.top_logprobs = stream.seq.top_logprobs[stream.sent_tokens : upto]
        seq = stream.seq
        # With the first delta once every position is scored (an id handed off from a prefill worker can
        # come before), or the final one.
        if (seq.prompt_logprobs is not None and not stream.sent_prompt
                and (delta.final is not None or None not in seq.prompt_logprobs[1:])):
            delta.prompt_logprobs = list(seq.prompt_logprobs)
            delta.prompt_top_logprobs = list(seq.prompt_top_logprobs) if seq.prompt_top_logprobs is not None else None
            stream.sent_prompt = True
        stream.sent_tokens = upto
        return delta

    def _running_delta(self, stream: _Stream) -> Delta | None:
        tokens, logprobs = self._new_tokens(stream, len(stream.seq.output_ids))
        if not tokens:
            return None
        stream.pending_text += "".join(stream.detokenizer.push(t) for t in tokens)
        cut = max(0, len(stream.pending_text) - stream.holdback)
        text, stream.pending_text = stream.pending_text[:cut], stream.pending_text[cut:]
        stream.sent_text += text
        return self._sent(stream, Delta(text, tokens, logprobs if stream.request.params.logprobs else []))

    def _final_delta(self, stream: _Stream, final: RequestOutput) -> Delta:
        tokens, logprobs = self._new_tokens(stream, len(final.token_ids))
        if final.text.startswith(stream.sent_text):
            text = final.text[len(stream.sent_text) :]
        else:  # the incremental text diverged from the full decode (byte-fallback edge cases)
            log.warning("request %s: streamed text differs from the final decode", final.request_id)
            sent, full = stream.sent_text, final.text
            pairs = enumerate(zip(sent, full, strict=False))
            common = next((i for i, (a, b) in pairs if a != b), min(len(sent), len(full)))
            text = full[common:]  # the rest from where they diverged: a client sees the difference
        return self._sent(stream, Delta(text, tokens, logprobs if stream.request.params.logprobs else [],
                                        final=final))

    def _fail_all(self, message: str, only: Callable[[int], bool] | None = None) -> None:
        """Ends every stream (`only`: those whose request index it accepts) with `message`."""
        streams = [(index, stream) for index, stream in self._streams.items() if only is None or only(index)]
        for index, _ in streams:
            del self._streams[index]
        for index, stream in streams:
            try:
                stream.deliver(Delta("", [], [], error=message))
                self.engine.abort(index)
            except Exception:  # the event loop may be closed already, or the engine broken: fail the others
                log.exception("could not fail request %d", index)
