"""The generation loop and its overlap: requests in, the scheduler's chunks through the jitted step,
outputs back.

`Engine` queues requests, asks the `Scheduler` what each step computes, dispatches the step and
applies its sampled ids. It is driven step by step (`add_request`, `step`, `abort`) by a server,
or to completion by `generate`. Its other concerns are mixins, one module each: admission
(`admission.py`), the step's arrays (`batch_builder.py`), penalty slots (`penalty_slots.py`),
prompt scoring (`prompt_spans.py`), stop conditions and outputs (`outputs.py`), speculative
rounds (`spec_rounds.py`) and KV tier moves (`tier_moves.py`).

Overlapped (async) scheduling, on by default (`async_scheduling`): `step()` schedules and
dispatches step N+1 before it reads step N's sampled ids, so the host's scheduling, batch building
and post-processing of step N run while the device computes step N+1. Step N+1 reads the ids it
needs from step N's output on the device. A sequence that step N finishes has one id sampled in
vain by step N+1 (counted in `discarded_samples`); outputs are the same as with overlap off.
Sampling keys depend only on the seed and the number of tokens generated, so in float32 neither
overlap, batching nor preemption changes a request's output; in bfloat16 a recomputed
(differently batched) prefix can differ by rounding, as in any engine that recomputes. With a draft
model this holds for greedy requests; a seeded sampled request is distributed exactly as without a
draft, but which tokens it draws depends on where its speculative rounds begin (see
docs/architecture.md, "Reproducibility").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable

import numpy as np

from jaxinfer.engine.adapters import AdapterInfo, ReadAdapter
from jaxinfer.engine.admission import RequestAdmission
from jaxinfer.engine.batch_builder import StepBatchBuilder
from jaxinfer.engine.disagg import PagePublisher
from jaxinfer.engine.executor import Executor
from jaxinfer.engine.guided_rows import GuidedRows
from jaxinfer.engine.held import held_resources
from jaxinfer.engine.inflight import InflightStep
from jaxinfer.engine.metrics import EngineStats, snapshot
from jaxinfer.engine.outputs import OutputAssembly, top_pairs
from jaxinfer.engine.params import Request, RequestOutput
from jaxinfer.engine.penalty_slots import PenaltySlots
from jaxinfer.engine.prompt_spans import PromptSpans
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import ScheduledChunk, Sequence
from jaxinfer.engine.spec_rounds import SpeculativeRounds
from jaxinfer.engine.speculator import Speculator
from jaxinfer.engine.step import ModelRunner
from jaxinfer.engine.step_inputs import HostBatch
from jaxinfer.engine.tier_moves import TierMoves
from jaxinfer.kv.tiers import TieredPages
from jaxinfer.processor.protocol import CONTROL_TOKENS, ExecTokens
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.tokenizer.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)
audit = logging.getLogger("jaxinfer.audit")

__all__ = ["Engine", "EngineStats", "ScheduledChunk", "Sequence"]


def run_to_completion(engine, sequences: list[Sequence], on_finish: Callable[[RequestOutput], None] | None
                      ) -> list[RequestOutput]:
    """Steps `engine` (an Engine or a ReplicaSet) until nothing is left; outputs in `sequences` order.

    An error mid-run aborts the sequences, so no page leaks and no request stays queued."""
    outputs: dict[int, RequestOutput] = {}
    try:
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.index] = out
                if on_finish:
                    on_finish(out)
    except BaseException:
        engine.discard_inflight()
        for seq in sequences:
            engine.abort(seq.index)
        raise
    return [outputs[seq.index] for seq in sequences]


class Engine(RequestAdmission, StepBatchBuilder, PenaltySlots, GuidedRows, PromptSpans, OutputAssembly,
             SpeculativeRounds, TierMoves):
    """One engine over a runner: its state lives here, each concern's methods in the mixin named for it."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        max_model_len: int,
        prefix_caching: bool | None = None,
        async_scheduling: bool | None = None,
        tiers: TieredPages | None = None,
        first_index: int = 0,
        index_stride: int = 1,
    ):
        """Engines on one runner share its page pool (the device pages); the flags override the config.

        Requests get indices first_index, first_index + index_stride, ... (replicas keep them apart)."""
        self.runner, self.tokenizer, self.max_model_len = runner, tokenizer, max_model_len
        self.cfg = runner.cfg
        self.pool = runner.pool
        self.async_scheduling = self.cfg.async_scheduling if async_scheduling is None else async_scheduling
        caching = self.cfg.prefix_caching if prefix_caching is None else prefix_caching
        self.stats = EngineStats()
        self.scheduler = Scheduler(self.cfg, self.pool, max_model_len, caching, self.stats)
        if tiers is not None:  # evicted prefix pages go down to L2/L3 (for every engine on the runner)
            runner.tiers, self.pool.track_evictions = tiers, True
            runner.warmup_tiers()
        self.scheduler.tiers = runner.tiers  # and come back on a hit
        self.scheduler.write_pages = self._write_restored_pages
        self.scheduler.claim = self._claim_slots
        self.scheduler.on_release = self._release_slots
        runner.set_guide_eos(sorted(tokenizer.eos_ids))
        store = runner.tiers.store if runner.tiers is not None else None
        self._publisher = PagePublisher(runner, store, self.cfg.page_size, self.stats) if store is not None else None
        self.speculator: Speculator | None = None
        if runner.spec is not None:  # a draft model: every step is a speculative round, not overlapped
            self.speculator = Speculator(runner.spec, self.scheduler, self.stats, self.cfg.draft_confidence,
                                         max_model_len, self._fill_sampling)
            self.async_scheduling = False
        self._rng = random.Random(self.cfg.seed)
        self._next_index, self._index_stride = first_index - index_stride, index_stride
        self._inflight: InflightStep | None = None
        self.executor = self._make_executor()
        self._forced_finished: list[Sequence] = []  # finished by appended exec result tokens (max_tokens)
        self._scoring: set[Sequence] = set()  # sequences with prompt positions still to score

    def _make_executor(self) -> Executor | None:
        """The processor's host side, when the runner carries machine slots in its step."""
        if self.runner.exec_unit is None:
            return None
        ids = {name: self.tokenizer.token_id(name) for name in CONTROL_TOKENS}
        missing = [name for name, token in ids.items() if token is None]
        if missing:
            raise ValueError(f"the tokenizer lacks the exec control tokens {missing} (add_control_tokens)")
        return Executor(self.runner.exec_unit, ExecTokens.from_ids(ids), self.tokenizer, self.cfg, self.stats,
                        self._append_forced, self._room)

    def _room(self, seq: Sequence) -> int:
        """Tokens a sequence may still receive: what max_tokens and max_model_len leave."""
        return max(0, min(seq.params.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_known))

    @property
    def prefix_caching(self) -> bool:
        return self.scheduler.prefix_caching

    # -- LoRA adapters (on the runner: shared by every engine on it) ------------------------------
    def load_adapter(self, name: str, source: str = "", read: ReadAdapter | None = None) -> AdapterInfo:
        return self.runner.load_adapter(name, source, read)

    def unload_adapter(self, name: str) -> None:
        self.runner.unload_adapter(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.runner.adapters.list() if self.runner.adapters is not None else []

    def generate(
        self, requests: list[Request], on_finish: Callable[[RequestOutput], None] | None = None
    ) -> list[RequestOutput]:
        """Runs the requests to completion; outputs in request order."""
        self.prefetch_guided(request.params for request in requests)
        for request in requests:
            self.validate(request)
        sequences = [self._enqueue(r) for r in requests]  # all validated first: none queued if one is bad
        return run_to_completion(self, sequences, on_finish)

    def discard_inflight(self) -> None:
        """Forgets the step in flight; its sequences will recompute their last token and sample again
        (the same id: sampling keys depend only on the seed and the count of generated tokens)."""
        step, self._inflight = self._inflight, None
        for chunk in step.chunks if step is not None else ():
            if chunk.samples:
                chunk.seq.penalty_loaded = False  # the step counted its sample: reloaded before the next
                chunk.seq.inflight -= 1
                chunk.seq.num_computed = min(chunk.seq.num_computed, chunk.seq.num_tokens - 1)
        for span in step.scored if step is not None else ():  # their scores are not read: computed again
            span.seq.prompt_scored = min(span.seq.prompt_scored, span.first)
            span.seq.num_computed = min(span.seq.num_computed, span.first)
            if span.seq.finish_reason is None:
                self._scoring.add(span.seq)

    @property
    def kv_identity(self) -> str:
        """The digest of what a KV store page must match here (checkpoint and KV layout); "" without a store."""
        return self._publisher.store.identity_digest if self._publisher is not None else ""

    def metrics(self) -> dict[str, float]:
        """Counters and gauges: running, waiting, preemptions, free pages, prefix hits, per-step times."""
        s = self.scheduler
        tiers = s.tiers.gauges() if s.tiers is not None else None
        return {**snapshot(self.stats, len(s.running), len(s.waiting), self.pool.num_free, self.pool.capacity, tiers),
                **held_resources(self), **self.runner.device_bytes()}

    # -- step-wise API (what a server drives) --------------------------------------------------
    def add_request(self, request: Request) -> Sequence:
        """Validates and queues a request; its output comes from a later `step()` (or `abort`)."""
        self.validate(request)
        return self._enqueue(request)

    def _enqueue(self, request: Request) -> Sequence:
        self._record_guard(request)
        self._next_index += self._index_stride
        seq = self._new_sequence(self._next_index, request)
        if seq.scoring_prompt:
            self._scoring.add(seq)
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    @property
    def max_running(self) -> int:
        """Requests that run at once (more wait)."""
        return self.cfg.max_seqs

    @property
    def num_requests(self) -> int:
        """Requests added and not finished: running and waiting."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        """Dispatches the next step and returns the requests that finished in the one before it.

        With overlap off the step is read back at once, so its own finished requests are returned.
        """
        if self.speculator is not None:
            return self._speculative_step()
        started = time.perf_counter()
        waited = 0.0
        finished: list[RequestOutput] = []
        self._tier_upkeep()
        if self.executor is not None:  # programs written since the last step start (or trap) first
            self.executor.start_pending(self.stats.steps)
        chunks = self.scheduler.schedule() if self.scheduler.has_unfinished() else []
        launched = self._launch(chunks) if chunks else self._launch_exec_only()
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            waited += self._process(previous, finished)
        if self.scheduler.tiers is not None:
            self.runner.demote_copied_pages()
        if not self.async_scheduling and self._inflight is not None:
            launched, self._inflight = self._inflight, None
            waited += self._process(launched, finished)
        while self._forced_finished:
            self._finish(self._forced_finished.pop(), finished)
        if launched is None and previous is None:
            self._nothing_launched()
        self._account(started, waited)
        return finished

    def _launch_exec_only(self) -> InflightStep | None:
        """With programs running and no sequence to compute, a step that only advances the machine."""
        if self.executor is None or not self.executor.busy:
            return None
        result = self.runner.dispatch_exec_only()
        self.stats.steps += 1
        self.stats.exec_idle_steps += 1
        return InflightStep([], result, self.stats.steps)

    def _nothing_launched(self) -> None:
        """A step with nothing to run: fine while programs wait or run (their steps come), else wait for
        a KV store read if one is under way, else fail."""
        if self.executor is not None and (self.executor.pending or self.executor.busy):
            return
        if self.has_unfinished() and not self.scheduler.wait_for_store():
            if not self.runner.free_penalty_slots and any(s.params.penalized for s in self.scheduler.waiting):
                raise RuntimeError("no progress possible: requests with penalties wait for a slot, and every one "
                                   "of engine.max_penalized_seqs is held by another engine on this runner")
            raise RuntimeError("no progress possible: the KV page pool is too small for one sequence")

    def _account(self, started: float, waited: float) -> None:
        elapsed = time.perf_counter() - started
        self.stats.step_seconds += elapsed
        self.stats.host_seconds += elapsed - waited

    def _count_launch(self, chunks: list[ScheduledChunk], batch: HostBatch) -> None:
        """Counts a dispatched step and its chunks as computed; publishes their full pages."""
        self.stats.steps += 1
        self.stats.tokens_scheduled += sum(c.count for c in chunks)
        self.stats.padded_tokens += batch.num_tokens
        for chunk in chunks:
            seq = chunk.seq
            if chunk.start < len(seq.prompt_ids):
                self.stats.prompt_tokens_computed += min(chunk.count, len(seq.prompt_ids) - chunk.start)
            seq.num_computed = chunk.start + chunk.count
            self.scheduler.publish_pages(seq)
            if seq.request.publish_kv:
                self._publisher.publish(seq, self.stats.steps)

    def _finish(self, seq: Sequence, finished: list[RequestOutput]) -> None:
        """Publishes a prefill worker's pages, frees the sequence and records its output."""
        stored = self._publisher.finish(seq) if seq.request.publish_kv else 0
        self._release(seq)
        finished.append(dataclasses.replace(self._output(seq), stored_pages=stored))

    def abort(self, index: int) -> RequestOutput | None:
        """Cancels a queued or running request now; its pages are free before the next step."""
        seq = self.scheduler.find(index)
        if seq is None:
            return None
        self._release(seq)
        seq.finish_reason = "abort"
        self.stats.aborted += 1
        return self._output(seq)

    def _claim_slots(self, seq: Sequence) -> bool:
        """On admission, what a sequence holds besides pages: its grammar on the device, a penalty slot."""
        return self._claim_guide(seq) and self._claim_penalty_slot(seq)

    def _release_slots(self, seq: Sequence) -> None:
        self._release_guide(seq)
        self._release_penalty_slot(seq)

    def _release(self, seq: Sequence) -> None:
        """Ends a sequence's claims: its program, its pages and queue place, its adapter."""
        if self.executor is not None:
            self.executor.cancel(seq)
        self._scoring.discard(seq)
        self.scheduler.finish(seq)
        if seq.adapter is not None:
            seq.adapter.users -= 1
            seq.adapter = None

    # -- requests ----------------------------------------------------------------------------
    def _record_guard(self, request: Request) -> None:
        if request.forged_tokens:
            self.stats.forged_tokens_downgraded += request.forged_tokens
            audit.info(json.dumps({"event": "forged_control_tokens", "request_id": request.request_id,
                                   "downgraded": request.forged_tokens}))

    def _new_sequence(self, index: int, request: Request) -> Sequence:
        params = request.params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        # The text stop strings are searched in shows what the output shows (the exec markers with exec
        # on), so a stop's position cuts the final text at the same place.
        shown = self.shown_special_ids(params)
        detokenizer = IncrementalDetokenizer(self.tokenizer, keep=shown) if params.stop else None
        seq = Sequence(index=index, request=request, seed=seed, detokenizer=detokenizer)
        seq.adapter = self._adapter_of(request)
        if seq.adapter is not None:
            seq.adapter.users += 1
        seq.output_ids = list(request.generated_ids)  # generated by a prefill worker: the output so far
        seq.logprobs = list(request.generated_logprobs) or [0.0] * len(request.generated_ids)
        if params.top_logprobs:  # a prefill worker's, else none (not sampled here)
            seq.top_logprobs = list(request.generated_top_logprobs) or [[] for _ in request.generated_ids]
        self._start_guide(seq)
        if params.logit_bias:  # as arrays once, not per step
            ids, biases = zip(*params.logit_bias, strict=True)
            seq.bias = (np.array(ids, np.int32), np.array(biases, np.float32))
        if params.prompt_logprobs is not None:  # scored here, or by a prefill worker
            seq.prompt_logprobs = list(request.scored_prompt_logprobs or [None] * len(request.prompt_ids))
            if params.prompt_logprobs:
                seq.prompt_top_logprobs = list(request.scored_prompt_top_logprobs or [[] for _ in request.prompt_ids])
            if request.scored_prompt_logprobs is not None:
                seq.prompt_scored = len(request.prompt_ids) - 1
        for token in seq.output_ids if detokenizer else ():
            detokenizer.push(token)
        if self.executor is not None:  # a prompt that ends with a program runs it before generating
            self.executor.on_token(seq)
        return seq

    # -- execution ---------------------------------------------------------------------------
    def _launch(self, chunks: list[ScheduledChunk]) -> InflightStep:
        """Builds and dispatches one step; the sequences' progress counts it from now on."""
        previous = self._inflight.result if self._inflight is not None else None
        self._load_penalty_slots(chunks)
        batch = self._build_batch(chunks)
        scored = self._fill_prompt_scoring(batch, chunks)
        result = self.runner.dispatch(batch, previous)
        self._count_scored(scored)
        for row, chunk in enumerate(chunks):
            if chunk.samples:
                chunk.seq.inflight += 1
                chunk.seq.last_row = row
        self._count_launch(chunks, batch)
        return InflightStep(chunks, result, self.stats.steps, scored)

    def _process(self, step: InflightStep, finished: list[RequestOutput]) -> float:
        """Reads a step's sampled ids back and applies them; returns the seconds spent waiting for the device."""
        started = time.perf_counter()
        tokens, logprobs = step.result.fetch()
        top = step.result.fetch_top()  # read with the tokens
        waited = time.perf_counter() - started
        self._record_prompt_scores(step)  # before a sample can finish its sequence
        if self._publisher is not None:
            self._publisher.write_ready(step.number)  # not the copies queued after the step in flight
        for row, chunk in enumerate(step.chunks):
            seq = chunk.seq
            if not chunk.samples:
                continue
            seq.inflight -= 1
            if seq.finish_reason is not None or seq.exec_discard:  # finished, or paused for a program,
                seq.exec_discard = max(0, seq.exec_discard - 1)  # after this step was dispatched
                self.stats.discarded_samples += 1
                continue
            self._append(seq, int(tokens[row]), float(logprobs[row]))
            if seq.params.top_logprobs:
                count = seq.params.top_logprobs
                seq.top_logprobs.append(top_pairs(top[0][row, :count], top[1][row, :count]))
            if seq.finish_reason is not None:
                self._finish(seq, finished)
            else:
                self.scheduler.publish_pages(seq)
                if self.executor is not None:
                    self.executor.on_token(seq)
        if self.executor is not None:
            self.executor.collect(step.result.fetch_exec(), step.number, self.stats.steps)
        return waited


