"""The generation loop: requests in, the scheduler's chunks through the jitted step, outputs back.

`Engine` validates and queues requests, asks the `Scheduler` what each step computes, builds the
step's padded arrays, dispatches it, and post-processes the sampled ids: stop conditions (EOS,
stop ids, stop strings, lengths), logprobs, outputs. It is driven step by step (`add_request`,
`step`, `abort`) by a server, or to completion by `generate`.

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
import itertools
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from jaxinfer.engine.adapters import AdapterInfo, ReadAdapter
from jaxinfer.engine.disagg import PagePublisher
from jaxinfer.engine.executor import Executor, file_mapping
from jaxinfer.engine.metrics import EngineStats, snapshot
from jaxinfer.engine.params import Request, RequestOutput, SamplingParams, Usage
from jaxinfer.engine.sampler import MAX_BANNED
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import ScheduledChunk, Sequence, prefix_salt
from jaxinfer.engine.speculator import Round, Speculator
from jaxinfer.engine.step import HostBatch, ModelRunner, StepResult
from jaxinfer.errors import RequestError
from jaxinfer.kv.tiers import HostPage, TieredPages
from jaxinfer.processor.protocol import CONTROL_TOKENS, ExecTokens
from jaxinfer.processor.wasi import FileAccessError
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.tokenizer.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)
audit = logging.getLogger("jaxinfer.audit")

__all__ = ["Engine", "EngineStats", "ScheduledChunk", "Sequence"]


@dataclass(frozen=True)
class _ScoredSpan:
    """Prompt positions [first, first + count) of a sequence, scored at [offset, offset + count) of a batch."""

    seq: Sequence
    offset: int
    first: int
    count: int


@dataclass
class _InflightStep:
    chunks: list[ScheduledChunk]
    result: StepResult
    number: int  # the count of steps launched, this one included
    scored: list[_ScoredSpan] = dataclasses.field(default_factory=list)  # prompt positions it scores


def _check_token_ids(name: str, ids: Iterable[object], vocab: int) -> None:
    """Every id an integer (not a float, bool or string) inside the vocabulary."""
    for i, token in enumerate(ids):
        if not isinstance(token, Integral) or isinstance(token, bool):
            raise RequestError(f"{name}[{i}]: must be an integer token id, got {token!r:.40}")
        if not 0 <= token < vocab:
            raise RequestError(f"{name}[{i}]: {token} is outside the vocabulary [0, {vocab})")


def _is_logprob(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and -math.inf <= value <= 0


def _pairs(ids: np.ndarray, logprobs: np.ndarray) -> list[tuple[int, float]]:
    """One position's alternatives, as read back from the step, in the outputs' form: (id, logprob) pairs."""
    return list(zip(ids.tolist(), logprobs.tolist(), strict=True))


def _alternatives(pairs: object, count: int, vocab: int) -> bool:
    """Whether `pairs` is `count` (id, logprob) pairs with ids in the vocabulary."""
    return (isinstance(pairs, list | tuple) and len(pairs) == count
            and all(isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], Integral)
                    and not isinstance(p[0], bool) and 0 <= p[0] < vocab and _is_logprob(p[1]) for p in pairs))


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


class Engine:
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
        self.scheduler.claim = self._claim_penalty_slot
        self.scheduler.on_release = self._release_penalty_slot
        store = runner.tiers.store if runner.tiers is not None else None
        self._publisher = PagePublisher(runner, store, self.cfg.page_size, self.stats) if store is not None else None
        self.speculator: Speculator | None = None
        if runner.spec is not None:  # a draft model: every step is a speculative round, not overlapped
            self.speculator = Speculator(runner.spec, self.scheduler, self.stats, self.cfg.draft_confidence,
                                         max_model_len, self._fill_sampling)
            self.async_scheduling = False
        self._rng = random.Random(self.cfg.seed)
        self._next_index, self._index_stride = first_index - index_stride, index_stride
        self._inflight: _InflightStep | None = None
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

    # -- public -----------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Raises RequestError naming the field and the limit for a request the engine cannot run."""
        self._check_prompt(request.prompt_ids, request.params)
        self._check_handoff(request)
        self._check_files(request)
        self._adapter_of(request)

    def adapter_name(self, request: Request) -> str:
        """The adapter a request runs with: its own, or engine.exec_adapter for exec requests ("": none)."""
        return request.adapter or (self.cfg.exec_adapter if request.params.exec else "")

    def prefix_salt(self, request: Request) -> str:
        """The prefix-cache namespace a request's pages get (see `Sequence.cache_salt`)."""
        return prefix_salt(request, self._adapter_of(request))

    def _adapter_of(self, request: Request) -> AdapterInfo | None:
        """The loaded adapter a request runs with; RequestError naming the field that named it."""
        name = self.adapter_name(request)
        if not name:
            return None
        if self.runner.adapters is None:
            raise RequestError("adapter: this engine serves no LoRA adapters (engine.max_adapters is 0)")
        if self.speculator is not None:
            raise RequestError("adapter: not available with speculative decoding (engine.draft_model)")
        return self.runner.adapters.slot_of(name, "adapter" if request.adapter else "engine.exec_adapter")

    # -- LoRA adapters (on the runner: shared by every engine on it) ------------------------------
    def load_adapter(self, name: str, source: str = "", read: ReadAdapter | None = None) -> AdapterInfo:
        return self.runner.load_adapter(name, source, read)

    def unload_adapter(self, name: str) -> None:
        self.runner.unload_adapter(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.runner.adapters.list() if self.runner.adapters is not None else []

    def _check_files(self, request: Request) -> None:
        mapping = file_mapping(self.cfg, request)
        if mapping is None:
            return
        if not self.cfg.exec_files_root:
            raise RequestError("exec_files: this engine maps no files (engine.exec_files_root is empty)")
        try:
            mapping.check()
        except FileAccessError as error:  # check turns every OS complaint into FileAccessError
            raise RequestError(str(error)) from error

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("prompt: must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt: {len(prompt_ids)} tokens, the limit is {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len} leaves room for one generated token)"
            )
        if len(self._stop_ids(params)) + len(self._exec_banned(params)) > MAX_BANNED:
            raise RequestError(f"stop_token_ids: with the model's EOS ids (and the exec control tokens) at most "
                               f"{MAX_BANNED} ids can be held back")
        if params.exec and self.executor is None:
            raise RequestError("exec: this engine runs no programs (engine.exec_slots is 0)")
        if params.exec and params.prompt_logprobs is not None:  # its result can end it before the prompt is computed
            raise RequestError("prompt_logprobs: not available with exec (a prompt that ends with a program gets its "
                               "result before the prompt is computed)")
        if params.exec_trace == "full" and self.executor is not None and not self.cfg.exec_trace_entries:
            raise RequestError("exec_trace: full needs engine.exec_trace_entries > 0")
        # What a speculative round does not compute: program steps, alternatives, penalty counts per proposal.
        unspeculated = (["exec"] * params.exec + ["top_logprobs"] * bool(params.top_logprobs)
                        + ["prompt_logprobs"] * (params.prompt_logprobs is not None)
                        + ["logit_bias"] * bool(params.logit_bias) + params.active_penalties)
        if unspeculated and self.speculator is not None:
            raise RequestError(f"{unspeculated[0]}: not available with speculative decoding (engine.draft_model)")
        for name in ("top_logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.runner.model_cfg.vocab_size:
                raise RequestError(f"{name}: at most the vocabulary's {self.runner.model_cfg.vocab_size} ids, "
                                   f"got {getattr(params, name)}")
        self._check_penalties(params)
        vocab = self.runner.model_cfg.vocab_size
        _check_token_ids("prompt_token_ids", prompt_ids, vocab)
        _check_token_ids("stop_token_ids", params.stop_token_ids, vocab)
        outside = next((token for token, _ in params.logit_bias if token >= vocab), None)
        if outside is not None:
            raise RequestError(f"logit_bias[{outside}]: {outside} is outside the vocabulary [0, {vocab})")
        # Every request must fit the pool alone, so preemption always leaves one that can finish.
        prompt_pages = math.ceil((len(prompt_ids) + 1) / self.cfg.page_size)
        if prompt_pages > self.pool.capacity:
            raise RequestError(
                f"prompt: {len(prompt_ids)} tokens and one generated need {prompt_pages} KV pages of "
                f"{self.cfg.page_size} tokens, the pool has {self.pool.capacity}")
        longest = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        pages_needed = math.ceil(longest / self.cfg.page_size)
        if pages_needed > self.pool.capacity:
            raise RequestError(
                f"max_tokens: the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{pages_needed} KV pages of {self.cfg.page_size} tokens, the pool has {self.pool.capacity}"
            )

    def _check_penalties(self, params: SamplingParams) -> None:
        if not params.penalized:
            return
        field = params.active_penalties[0]
        if params.exec:
            raise RequestError(f"{field}: not available with exec (a program's result is not counted)")
        if not self.cfg.penalty_slots:
            raise RequestError(f"{field}: this engine keeps no token counts (engine.max_penalized_seqs is 0)")

    def _check_handoff(self, request: Request) -> None:
        """The fields of disaggregated prefill and decode (engine/disagg.py)."""
        generated, vocab = request.generated_ids, self.runner.model_cfg.vocab_size
        if len(generated) >= request.params.max_tokens:
            raise RequestError(f"generated_ids: {len(generated)} ids already generated, max_tokens is "
                               f"{request.params.max_tokens}")
        if len(request.prompt_ids) + len(generated) >= self.max_model_len:
            raise RequestError(f"generated_ids: prompt plus generated ids reach max_model_len {self.max_model_len}")
        _check_token_ids("generated_ids", generated, vocab)
        if request.generated_logprobs and len(request.generated_logprobs) != len(generated):
            raise RequestError("generated_logprobs: one per generated id is required")
        if request.generated_top_logprobs and len(request.generated_top_logprobs) != len(generated):
            raise RequestError("generated_top_logprobs: one list per generated id is required")
        bad = next((i for i, x in enumerate(request.generated_logprobs) if not _is_logprob(x)), None)
        if bad is not None:
            raise RequestError(f"generated_logprobs[{bad}]: must be a log-probability (a number <= 0), got "
                               f"{request.generated_logprobs[bad]!r:.40}")
        self._check_scored_prompt(request, vocab)
        if request.publish_kv or request.stored_pages:
            if self._publisher is None:
                raise RequestError("publish_kv / stored_pages: this engine has no KV store (engine.kv_store)")
            if not self.prefix_caching:
                raise RequestError("publish_kv / stored_pages: the engine's prefix cache is off")

    @staticmethod
    def _check_scored_prompt(request: Request, vocab: int) -> None:
        """A prefill worker's prompt scores: one per prompt token (None for the first), as asked."""
        scored, tops = request.scored_prompt_logprobs, request.scored_prompt_top_logprobs
        k = request.params.prompt_logprobs
        if scored is None and tops is None:
            return
        if k is None or scored is None or (tops is not None) != bool(k):
            raise RequestError("scored_prompt_logprobs: given only with prompt_logprobs (with their alternatives "
                               "when prompt_logprobs > 0)")
        if len(scored) != len(request.prompt_ids) or (tops is not None and len(tops) != len(scored)):
            raise RequestError(f"scored_prompt_logprobs: one entry per prompt token ({len(request.prompt_ids)}) "
                               "is required")
        if scored[0] is not None:
            raise RequestError(f"scored_prompt_logprobs[0]: must be null (the first token has no context), got "
                               f"{scored[0]!r:.40}")
        bad = next((i for i, x in enumerate(scored[1:], 1) if not _is_logprob(x)), None)
        if bad is not None:
            raise RequestError(f"scored_prompt_logprobs[{bad}]: must be a log-probability (a number <= 0), got "
                               f"{scored[bad]!r:.40}")
        bad = next((i for i, top in enumerate(tops or []) if not _alternatives(top, 0 if i == 0 else k, vocab)), None)
        if bad is not None:
            raise RequestError(f"scored_prompt_top_logprobs[{bad}]: must be {'empty' if bad == 0 else f'{k}'} (id, "
                               f"logprob) pairs with ids in the vocabulary, got {tops[bad]!r:.60}")

    def generate(
        self, requests: list[Request], on_finish: Callable[[RequestOutput], None] | None = None
    ) -> list[RequestOutput]:
        """Runs the requests to completion; outputs in request order."""
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
        return snapshot(self.stats, len(s.running), len(s.waiting), self.pool.num_free, self.pool.capacity, tiers)

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

    def _launch_exec_only(self) -> _InflightStep | None:
        """With programs running and no sequence to compute, a step that only advances the machine."""
        if self.executor is None or not self.executor.busy:
            return None
        result = self.runner.dispatch_exec_only()
        self.stats.steps += 1
        self.stats.exec_idle_steps += 1
        return _InflightStep([], result, self.stats.steps)

    def _append_forced(self, seq: Sequence, ids: list[int]) -> None:
        """Appends tokens the engine wrote (an exec result): computed like a prompt chunk, never sampled."""
        for token in ids:
            seq.output_ids.append(token)
            seq.logprobs.append(0.0)
            if seq.params.top_logprobs:
                seq.top_logprobs.append([])
            if seq.detokenizer:
                seq.detokenizer.push(token)
        if seq.detokenizer:  # stop strings match what the model writes, not a program's output
            seq.stop_search_from = len(seq.detokenizer.text)
        if len(seq.output_ids) >= seq.params.max_tokens or seq.num_known >= self.max_model_len:
            seq.finish_reason = "length"
            self._forced_finished.append(seq)
        else:
            self.executor.on_token(seq)

    def _tier_upkeep(self) -> None:
        """Pages evicted since the last step (by another engine, or a test) go down first; a due sweep runs."""
        if self.scheduler.tiers is not None:
            self._demote_evicted()
            self.scheduler.tiers.maybe_sweep()

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

    # -- speculative decoding (engine/speculator.py) -------------------------------------------
    def _speculative_step(self) -> list[RequestOutput]:
        """One synchronous round: schedule, propose with the draft, verify with the target, apply."""
        started = time.perf_counter()
        finished: list[RequestOutput] = []
        self._tier_upkeep()
        chunks = self.scheduler.schedule(self.speculator.budget) if self.scheduler.has_unfinished() else []
        if not chunks:
            self._nothing_launched()
            return finished
        plan = self.speculator.plan(chunks)
        drafting = time.perf_counter()
        self.speculator.refill(plan.chunks, self.runner.empty_batch)
        self.speculator.propose(plan, self.runner.empty_batch, self.runner.bucket_for)
        self.stats.spec_draft_seconds += time.perf_counter() - drafting
        batch = self._build_batch(plan.chunks, plan.drafts)
        result = self.runner.spec.verify(batch, self._verify_arrays(plan, batch.num_tokens), plan.proposals)
        self._count_launch(plan.chunks, batch)
        waiting = time.perf_counter()
        tokens, counts, logprobs = result.fetch()
        waited = time.perf_counter() - waiting
        if self._publisher is not None:
            self._publisher.write_ready()
        for row, chunk in enumerate(plan.chunks):
            if chunk.samples:
                self._apply_round(chunk.seq, tokens[row, : counts[row]], logprobs[row], finished)
        self.stats.spec_proposed += sum(len(d) for d in plan.drafts)
        self.stats.spec_rounds += sum(1 for d in plan.drafts if d)
        self._account(started, waited)
        return finished

    def _verify_arrays(self, plan: Round, num_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where each row's scored positions are in the flat batch, and the proposals as arrays."""
        logits_rows, draft_tokens, num_proposed = self.runner.spec.empty_spec(num_tokens)
        cursor = 0
        for row, (chunk, drafts) in enumerate(zip(plan.chunks, plan.drafts, strict=True)):
            last = cursor + chunk.count - 1  # the chunk's last token, then one position per proposal
            logits_rows[row] = np.minimum(last + np.arange(logits_rows.shape[1]), last + len(drafts))
            draft_tokens[row, : len(drafts)] = drafts
            num_proposed[row] = len(drafts)
            cursor += chunk.count + len(drafts)
        return logits_rows, draft_tokens, num_proposed

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

    def _apply_round(self, seq: Sequence, tokens: np.ndarray, logprobs: np.ndarray,
                     finished: list[RequestOutput]) -> None:
        """Appends the accepted proposals (their KV is valid) and the drawn token; frees rejected pages."""
        accepted = len(tokens) - 1  # a row that proposed nothing has one token: accepted is 0
        self.stats.spec_accepted += accepted
        for j, token in enumerate(tokens):
            self._append(seq, int(token), float(logprobs[j]))
            if j < accepted:
                seq.num_computed += 1
            if seq.finish_reason is not None:
                break
        if seq.finish_reason is not None:
            self._finish(seq, finished)
            return
        self.scheduler.trim(seq)
        self.scheduler.publish_pages(seq)

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

    def _release(self, seq: Sequence) -> None:
        """Ends a sequence's claims: its program, its pages and queue place, its adapter."""
        if self.executor is not None:
            self.executor.cancel(seq)
        self._scoring.discard(seq)
        self.scheduler.finish(seq)
        if seq.adapter is not None:
            seq.adapter.users -= 1
            seq.adapter = None

    # -- KV tiers ----------------------------------------------------------------------------
    def flush_tiers(self) -> None:
        """Demotes every page evicted so far to the lower tiers now (waits for their copies and writes)."""
        self._demote_evicted()
        if self.scheduler.tiers is not None and self.scheduler.tiers.store is not None:
            self.scheduler.tiers.store.flush()

    def _demote_evicted(self) -> None:
        self.runner.copy_evicted_pages()
        self.runner.demote_copied_pages()

    def persist_prefix_cache(self) -> None:
        """Moves every cached page no request uses down to L3 (when there is one), e.g. before exit."""
        if self.scheduler.tiers is None or self.scheduler.tiers.store is None:
            return
        with self.pool.hold(keep_free=0):  # evicts every cached page that no sequence holds
            self.flush_tiers()
        self.scheduler.tiers.persist()

    def _write_restored_pages(self, pages: list[tuple[int, HostPage | np.ndarray]]) -> None:
        """Writes pages restored from L2/L3 into their device pages, after copying out what their
        allocation evicted (the copy is enqueued first, so it reads the old content)."""
        self.runner.copy_evicted_pages()
        self.runner.import_pages(pages)

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

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        eos = [] if params.ignore_eos else sorted(self.tokenizer.eos_ids)
        return list(dict.fromkeys([*eos, *params.stop_token_ids]))

    # -- execution ---------------------------------------------------------------------------
    def _launch(self, chunks: list[ScheduledChunk]) -> _InflightStep:
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
        return _InflightStep(chunks, result, self.stats.steps, scored)

    def _build_batch(self, chunks: list[ScheduledChunk], drafts: list[list[int]] | None = None) -> HostBatch:
        """The step's padded arrays; `drafts[row]` (speculative proposals) follow that row's chunk.

        Per row only lists are gathered; the arrays are then filled whole, which keeps the host's share
        of a batch-256 step small (docs/benchmarks.md, "The host's share of a step at batch 256")."""
        drafts = drafts or [[] for _ in chunks]
        rows, seqs = len(chunks), [c.seq for c in chunks]
        counts = np.array([c.count + len(d) for c, d in zip(chunks, drafts, strict=True)], np.int32)
        ends = np.cumsum(counts, dtype=np.int32)
        total = int(ends[-1]) if rows else 0
        batch = self.runner.empty_batch(self.runner.bucket_for(total))
        row_of_token = np.repeat(np.arange(rows, dtype=np.int32), counts)
        firsts = ends - counts
        positions = np.arange(total, dtype=np.int32) + np.repeat(np.array([c.start for c in chunks], np.int32) - firsts,
                                                                 counts)
        batch.tokens[:total] = self._known_tokens(chunks, drafts, ends, batch.from_prev)
        batch.positions[:total] = positions
        batch.seq_rows[:total] = row_of_token
        pages = [seq.pages for seq in seqs]
        pages_per_row = np.array([len(p) for p in pages], np.int32)
        page_rows = np.repeat(np.arange(rows, dtype=np.int32), pages_per_row)
        page_columns = np.arange(page_rows.size, dtype=np.int32) - np.repeat(np.cumsum(pages_per_row) - pages_per_row,
                                                                              pages_per_row)
        batch.page_table[page_rows, page_columns] = np.fromiter(itertools.chain.from_iterable(pages), np.int32,
                                                                page_rows.size)
        page_size = self.cfg.page_size
        page_index = positions // page_size
        assert (page_index < pages_per_row[row_of_token]).all(), "a scheduled position has no page"
        batch.write_slots[:total] = batch.page_table[row_of_token, page_index] * page_size + positions % page_size
        batch.logits_rows[:rows] = ends - 1
        batch.adapters[:total] = np.repeat(np.array([seq.adapter_slot for seq in seqs], np.int32), counts)
        self._fill_sampling_rows(batch, 0, seqs, [seq.num_generated for seq in seqs])
        self._fill_penalties(batch, chunks)
        # Padding tokens read (never write) the last real row, so a trailing prefill tile stays one sequence.
        batch.seq_rows[total:] = rows - 1
        batch.positions[total:] = 0
        return batch

    @staticmethod
    def _known_tokens(chunks: list[ScheduledChunk], drafts: list[list[int]], ends: np.ndarray,
                      from_prev: np.ndarray) -> list[int]:
        """The chunks' ids then their drafts, row after row; an id still on the device (the newest, sampled
        by the step in flight) is a 0 here and `from_prev` points at that step's row instead."""
        known: list[int] = []
        for chunk, draft, end in zip(chunks, drafts, ends, strict=True):
            seq = chunk.seq
            known += seq.tokens(chunk.start, chunk.count)
            if len(known) < end - len(draft):
                assert len(known) == end - len(draft) - 1 and seq.inflight == 1, "only the newest id can be unknown"
                known.append(0)
                from_prev[end - len(draft) - 1] = seq.last_row
            known += draft
        return known

    def _fill_sampling(self, batch: HostBatch, row: int, seq: Sequence, step: int) -> None:
        """A row's sampling settings, for the sample drawn after `step` generated ids."""
        self._fill_sampling_rows(batch, row, [seq], [step])

    def _fill_sampling_rows(self, batch: HostBatch, first_row: int, seqs: list[Sequence], steps: list[int]) -> None:
        """Sampling settings of rows `first_row`, ... for `seqs`, each for the sample drawn after its `steps` ids."""
        params = [seq.params for seq in seqs]
        rows = slice(first_row, first_row + len(seqs))
        batch.temperature[rows] = [p.temperature for p in params]
        batch.top_p[rows] = [p.top_p for p in params]
        batch.min_p[rows] = [p.min_p for p in params]
        batch.top_k[rows] = np.minimum([p.top_k for p in params], self.runner.model_cfg.vocab_size)
        batch.seed[rows] = [seq.seed for seq in seqs]
        batch.step[rows] = steps
        batch.top_logprobs[rows] = [p.top_logprobs for p in params]
        for row, seq in enumerate(seqs, first_row):
            p = seq.params
            banned = self._stop_ids(p) if seq.num_generated < p.min_tokens else []  # EOS and stop ids not yet
            banned += self._exec_banned(p)
            if banned:
                batch.banned[row, : len(banned)] = banned
            if seq.bias is not None:
                batch.bias_ids[row, : seq.bias[0].size], batch.bias_values[row, : seq.bias[0].size] = seq.bias

    # -- prompt logprobs (engine/prompt_logprobs.py) ---------------------------------------------
    def _fill_prompt_scoring(self, batch: HostBatch, chunks: list[ScheduledChunk]) -> list[_ScoredSpan]:
        """Asks the step to score the prompt positions of the chunks that no earlier step scored."""
        if not self._scoring:  # the common case costs no walk over the batch
            return []
        spans, offset = [], 0
        for chunk in chunks:
            if chunk.seq in self._scoring:
                span = self._score_chunk(batch, chunk, offset)
                spans += [span] if span is not None else []
            offset += chunk.count
        return spans

    def _count_scored(self, spans: list[_ScoredSpan]) -> None:
        """After the dispatch: the positions the step scores count as asked for."""
        for span in spans:
            span.seq.prompt_scored = span.first + span.count
            if not span.seq.scoring_prompt:
                self._scoring.discard(span.seq)

    @staticmethod
    def _score_chunk(batch: HostBatch, chunk: ScheduledChunk, offset: int) -> _ScoredSpan | None:
        """Targets for the chunk's positions from the sequence's first unscored one (position p: token p + 1)."""
        seq = chunk.seq
        assert chunk.start <= seq.prompt_scored, "a prompt position was skipped unscored"
        first, end = seq.prompt_scored, min(chunk.start + chunk.count, len(seq.prompt_ids) - 1)
        if first >= end:
            return None
        at = offset + first - chunk.start
        batch.prompt_targets[at : at + end - first] = seq.prompt_ids[first + 1 : end + 1]
        batch.prompt_alternatives[at : at + end - first] = seq.params.prompt_logprobs
        return _ScoredSpan(seq, at, first, end - first)

    @staticmethod
    def _record_prompt_scores(step: _InflightStep) -> None:
        """Writes a read-back step's prompt scores into their sequences."""
        if not step.scored:
            return
        values, ids, logprobs = step.result.fetch_prompt()
        for span in step.scored:
            seq, rows = span.seq, slice(span.offset, span.offset + span.count)
            seq.prompt_logprobs[span.first + 1 : span.first + 1 + span.count] = values[rows].tolist()
            k = seq.params.prompt_logprobs
            if k:
                seq.prompt_top_logprobs[span.first + 1 : span.first + 1 + span.count] = [
                    _pairs(row_ids, row_logprobs) for row_ids, row_logprobs in zip(ids[rows, :k], logprobs[rows, :k],
                                                                                   strict=True)]

    # -- penalties -----------------------------------------------------------------------------
    def _claim_penalty_slot(self, seq: Sequence) -> bool:
        """On admission, a slot for a sequence with penalties; False while none is free (engines that
        share a runner share its max_seqs slots)."""
        if not seq.params.penalized or seq.penalty_slot is not None:
            return True
        seq.penalty_slot = self.runner.acquire_penalty_slot()
        return seq.penalty_slot is not None

    def _load_penalty_slots(self, chunks: list[ScheduledChunk]) -> None:
        """Loads the counts of each scheduled sequence whose slot does not hold them yet (just admitted,
        or its step in flight was discarded): the host knows all its ids then, none is in flight."""
        if not self.runner.penalty_slots_in_use:  # the common case costs no walk over the batch
            return
        for chunk in chunks:
            seq = chunk.seq
            if seq.penalty_slot is not None and not seq.penalty_loaded:
                assert seq.inflight == 0, "counts are loaded only when the host knows every id"
                self.runner.load_penalties(seq.penalty_slot, seq.prompt_ids, seq.output_ids)
                seq.penalty_loaded = True

    def _release_penalty_slot(self, seq: Sequence) -> None:
        if seq.penalty_slot is not None:
            self.runner.release_penalty_slot(seq.penalty_slot)
            seq.penalty_slot, seq.penalty_loaded = None, False

    def _fill_penalties(self, batch: HostBatch, chunks: list[ScheduledChunk]) -> None:
        """The rows whose sample is kept and that use penalties: their slot (where the step counts the
        sample) and settings. Other rows keep -1: nothing counted, logits unchanged."""
        if not self.runner.penalty_slots_in_use:
            return
        for row, chunk in enumerate(chunks):
            p = chunk.seq.params
            if chunk.samples and chunk.seq.penalty_slot is not None:
                batch.penalty_slot[row] = chunk.seq.penalty_slot
                batch.repetition_penalty[row] = p.repetition_penalty
                batch.frequency_penalty[row] = p.frequency_penalty
                batch.presence_penalty[row] = p.presence_penalty

    def _exec_banned(self, params: SamplingParams) -> list[int]:
        """Exec control ids a request may not sample: result and trap markers always, exec markers with exec off."""
        if self.executor is None:
            return []
        tokens = self.executor.tokens
        return list(tokens.engine_written) + ([] if params.exec else [tokens.exec_open, tokens.exec_close])

    def _process(self, step: _InflightStep, finished: list[RequestOutput]) -> float:
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
                seq.top_logprobs.append(_pairs(top[0][row, :count], top[1][row, :count]))
            if seq.finish_reason is not None:
                self._finish(seq, finished)
            else:
                self.scheduler.publish_pages(seq)
                if self.executor is not None:
                    self.executor.on_token(seq)
        if self.executor is not None:
            self.executor.collect(step.result.fetch_exec(), step.number, self.stats.steps)
        return waited

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        p = seq.params
        seq.output_ids.append(token)
        seq.logprobs.append(logprob)
        delta = seq.detokenizer.push(token) if seq.detokenizer else ""
        generated = len(seq.output_ids)
        if generated >= p.min_tokens:
            if (token in self.tokenizer.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
                seq.finish_reason = "stop"
                return
            if delta and self._hit_stop_string(seq, len(delta)):
                seq.finish_reason = "stop"
                return
        if generated >= p.max_tokens or seq.num_known >= self.max_model_len:
            seq.finish_reason = "length"

    def _hit_stop_string(self, seq: Sequence, new_chars: int) -> bool:
        """Searches only the text the newest characters could have completed a stop string in."""
        text = seq.detokenizer.text
        # Each string only where the new characters could complete it (text before min_tokens was
        # allowed to contain stop strings and must not stop generation later), and never starting in
        # a result block the engine wrote.
        floor = seq.stop_search_from
        hits = [i for s in seq.params.stop
                if (i := text.find(s, max(floor, len(text) - new_chars - len(s) + 1))) >= 0]
        if hits:
            seq.stop_at = min(hits)
            return True
        return False

    def shown_special_ids(self, params: SamplingParams) -> frozenset[int]:
        """Special ids that stay in a request's text: the exec markers when exec is on."""
        return frozenset(self.executor.tokens.all) if params.exec and self.executor is not None else frozenset()

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.output_ids, keep=self.shown_special_ids(seq.params))
        if seq.stop_at is not None:
            text = text[: seq.stop_at]
        return RequestOutput(
            index=seq.index,
            prompt_token_ids=seq.prompt_ids,
            text=text,
            token_ids=list(seq.output_ids),
            finish_reason=seq.finish_reason or "length",
            usage=Usage(len(seq.prompt_ids), len(seq.output_ids), max(seq.cached_tokens, 0)),
            logprobs=list(seq.logprobs) if seq.params.logprobs else None,
            top_logprobs=list(seq.top_logprobs) if seq.params.top_logprobs else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None,
            prompt_top_logprobs=list(seq.prompt_top_logprobs) if seq.prompt_top_logprobs is not None else None,
            request_id=seq.request.request_id,
            forged_tokens=seq.request.forged_tokens,
        )
