"""One OpenAI generation call on the engine worker: its prompts times `n` choices, collected or streamed.

Each choice is one engine request. The `n` choices of a prompt are submitted together: the
scheduler lets the later ones wait for the prompt pages the first one is computing, so they share
them instead of computing the prompt `n` times. With a `seed`, choice j samples with seed + j (the
same seed for each would give `n` equal choices). A call that ends early (a client disconnect, an
error in one choice) cancels every choice still running, so their pages are free before the next
step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from jaxinfer.engine.params import MAX_SEED, Request, SamplingParams
from jaxinfer.errors import JaxinferError, RequestError
from serving.convert import submit_refusal
from serving.openai_format import ChoiceState
from serving.service import InferenceService
from serving.tenants import Tenant
from serving.worker import Delta, QueueFull, WorkerDead


class CallFailed(Exception):
    """A call ended without its output: `status` is the HTTP status, the message says why."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    if choice == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + choice) % (MAX_SEED + 1))


def fan_out(prompts: Sequence[Request], n: int, tenant: Tenant, adapter: str, call_id: str) -> list[Request]:
    """Every prompt's `n` choices as engine requests, in choice-index order (prompt i, choice j: i * n + j)."""
    requests = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            requests.append(dataclasses.replace(prompt, params=choice_params(prompt.params, j),
                                                request_id=f"{call_id}-{i * n + j}", cache_salt=tenant.cache_salt,
                                                tenant=tenant.name, adapter=adapter))
    return requests


@dataclass
class Update:
    """A choice's new output (`delta`) as the call's consumer sees it, with the choice's state after it."""

    choice: ChoiceState
    delta: Delta


class GenerationCall:
    """The engine requests of one HTTP call; iterate `updates()` for each choice's deltas as they come."""

    def __init__(self, service: InferenceService, tenant: Tenant, requests: list[Request],
                 disconnected: Callable[[], Awaitable[None]]):
        self.service, self.tenant, self.requests = service, tenant, requests
        self.disconnected = disconnected  # returns once the client has gone
        self.choices = [ChoiceState(index) for index in range(len(requests))]
        self.started = time.perf_counter()
        self._queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        self._streams: list = []  # the worker's handles, to cancel them
        self._last_token: list[float | None] = [None] * len(requests)
        self._status: list[str] = ["cancelled"] * len(requests)
        self._finished = False

    def submit(self) -> None:
        """Submits every choice, or none: a refusal cancels those submitted and raises CallFailed."""
        loop = asyncio.get_running_loop()
        try:
            for index, request in enumerate(self.requests):
                self._streams.append(self.service.worker.submit(request, self._deliverer(loop, index)))
        except JaxinferError as exc:
            self._cancel_all()
            if isinstance(exc, RequestError):  # the front end names the field it came from, and counts it
                raise
            self.service.count(submit_refusal(exc)[0])  # the metrics status gRPC gives the same refusal
            status, code = refusal_status(exc)
            raise CallFailed(status, str(exc), code=code) from None

    def _deliverer(self, loop: asyncio.AbstractEventLoop, index: int) -> Callable[[Delta], None]:
        def deliver(delta: Delta) -> None:  # on the worker thread; a closed loop means nobody listens
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._queue.put_nowait, (index, delta))
        return deliver

    async def updates(self) -> AsyncIterator[Update]:
        """Each delta as it arrives, until every choice has its final output. A failed choice raises
        CallFailed; a client that disconnects ends the iteration. Either way the rest are cancelled."""
        watcher = asyncio.ensure_future(self.disconnected())
        getter: asyncio.Future | None = None
        remaining = len(self.requests)
        try:
            while remaining:
                getter = asyncio.ensure_future(self._queue.get())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return
                index, delta = getter.result()
                if delta.error is not None:
                    self._status[index] = "invalid" if delta.invalid else "error"
                    raise CallFailed(400 if delta.invalid else 500, delta.error)
                choice = self._apply(index, delta)
                if delta.final is not None:
                    remaining -= 1
                    self._status[index] = "ok"
                yield Update(choice, delta)
        finally:
            watcher.cancel()
            if getter is not None:
                getter.cancel()
            self.finish()

    def _apply(self, index: int, delta: Delta) -> ChoiceState:
        choice = self.choices[index]
        choice.text += delta.text
        choice.token_ids += delta.token_ids
        choice.logprobs += delta.logprobs
        choice.top_logprobs += delta.top_logprobs
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs, choice.prompt_top_logprobs = delta.prompt_logprobs, delta.prompt_top_logprobs
        choice.final = delta.final or choice.final
        self._last_token[index] = self.service.observe_latency(delta, self.started, self._last_token[index])
        return choice

    def finish(self) -> None:
        """Cancels the choices still running and counts every choice's outcome, once (also for a stream
        whose response never started: a client gone before the first byte)."""
        if self._finished:
            return
        self._finished = True
        self._cancel_all()
        seconds = time.perf_counter() - self.started
        for index, choice in enumerate(self.choices):
            self.service.count(self._status[index], choice.final)
            self.service.log_request(self.requests[index].request_id, self.tenant.name, self._status[index],
                                     choice.final, seconds)

    def _cancel_all(self) -> None:
        for index, stream in enumerate(self._streams):
            if self.choices[index].final is None and not stream.cancelled:
                self.service.worker.cancel(stream)


def refusal_status(error: JaxinferError) -> tuple[int, str | None]:
    """(HTTP status, OpenAI error code) of a request the engine thread would not take."""
    if isinstance(error, WorkerDead):
        return 503, "engine_stopped"
    if isinstance(error, QueueFull):
        return 429, "queue_full"
    return 500, None
