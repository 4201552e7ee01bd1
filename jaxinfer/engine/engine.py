"""The generation loop: a first-come-first-served batcher over the page pool and the jitted step.

Each step takes one decode token from every running sequence, then fills the rest of the token
budget with prompt chunks, oldest request first. A sequence that needs a page when none is free
preempts the newest running sequence, which gives its pages back and later recomputes its
prompt and output so far. Sampling keys depend only on the seed and the number of tokens generated,
so in float32 the output does not change; in bfloat16 a recomputed (differently batched) prefix can
differ by rounding, as in any engine that recomputes.

Prefix cache: on admission a sequence takes the longest chain of cached full pages (keys from
`kv/prefix_cache.py`) and computes only the rest; every page a step fills is published. When the
first missing page is being computed by a running sequence (one long system prompt shared by a
batch), the newcomer waits for it instead of computing it again. The engine runs step by step
(`add_request`, `step`, `abort`); overlapped scheduling comes with the full scheduler.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jaxinfer.engine.params import Request, RequestOutput, SamplingParams, Usage
from jaxinfer.engine.sampler import MAX_BANNED
from jaxinfer.engine.step import HostBatch, ModelRunner
from jaxinfer.errors import RequestError
from jaxinfer.kv.prefix_cache import chain_keys
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.tokenizer.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)
audit = logging.getLogger("jaxinfer.audit")


@dataclass(eq=False)  # identity: `in running` and `remove` must not compare whole token lists
class Sequence:
    index: int
    request: Request
    seed: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of the full pages computed
    pending_keys: list[bytes] = field(default_factory=list)  # keys this sequence will publish
    num_computed: int = 0  # tokens whose K/V are in the cache
    cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission (-1: not yet)
    finish_reason: str | None = None
    detokenizer: IncrementalDetokenizer | None = None  # streams the output text (for stop strings)
    stop_at: int | None = None  # where a stop string starts in the decoded output
    arrival: int = 0  # admission order, for preempting the newest

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def tokens(self, start: int, count: int) -> list[int]:
        """Tokens at positions [start, start + count) of prompt + output, without copying the rest."""
        split = len(self.prompt_ids)
        if start >= split:
            return self.output_ids[start - split : start - split + count]
        return (self.prompt_ids[start : start + count] + self.output_ids)[:count]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed in this step
    count: int
    samples: bool = False  # the chunk reaches the sequence's last token, so its row's sample is kept

    def __post_init__(self) -> None:
        self.samples = self.start + self.count == self.seq.num_tokens


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens_computed: int = 0
    preemptions: int = 0
    step_seconds: float = 0.0
    forged_tokens_downgraded: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    aborted: int = 0


class Engine:
    def __init__(
        self, runner: ModelRunner, tokenizer: Tokenizer, max_model_len: int, prefix_caching: bool | None = None
    ):
        """Engines on one runner share its page pool (the device pages); `prefix_caching` overrides the config."""
        self.runner, self.tokenizer, self.max_model_len = runner, tokenizer, max_model_len
        self.cfg = runner.cfg
        self.pool = runner.pool
        self.prefix_caching = self.cfg.prefix_caching if prefix_caching is None else prefix_caching
        self._pending: dict[bytes, Sequence] = {}  # page key -> the running sequence that will compute it
        self.stats = EngineStats()
        self._rng = random.Random(self.cfg.seed)
        self._arrivals = 0
        self._next_index = -1
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []

    # -- public -----------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("prompt: must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt: {len(prompt_ids)} tokens, the limit is {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len} leaves room for one generated token)"
            )
        if len(self._stop_ids(params)) > MAX_BANNED:
            raise RequestError(f"stop_token_ids: with the model's EOS ids at most {MAX_BANNED} ids can be held back")
        vocab = self.runner.model_cfg.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt_token_ids: {bad} is outside the vocabulary [0, {vocab})")
        # Every request must fit the pool alone, so preemption always leaves one that can finish.
        longest = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        pages_needed = math.ceil(longest / self.cfg.page_size)
        if pages_needed > self.pool.capacity:
            raise RequestError(
                f"max_tokens: the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{pages_needed} KV pages of {self.cfg.page_size} tokens, the pool has {self.pool.capacity}"
            )

    def generate(
        self, requests: list[Request], on_finish: Callable[[RequestOutput], None] | None = None
    ) -> list[RequestOutput]:
        """Runs the requests to completion; outputs in request order."""
        for request in requests:
            self.validate(request.prompt_ids, request.params)
        sequences = [self._enqueue(r) for r in requests]  # all validated first: none queued if one is bad
        outputs: dict[int, RequestOutput] = {}
        try:
            while self.has_unfinished():
                for out in self.step():
                    outputs[out.index] = out
                    if on_finish:
                        on_finish(out)
        except BaseException:
            for seq in sequences:  # an error mid-run must not leak pages or leave requests queued
                self.abort(seq.index)
            raise
        return [outputs[seq.index] for seq in sequences]

    # -- step-wise API (what a server drives) --------------------------------------------------
    def add_request(self, request: Request) -> Sequence:
        """Validates and queues a request; its output comes from a later `step()` (or `abort`)."""
        self.validate(request.prompt_ids, request.params)
        return self._enqueue(request)

    def _enqueue(self, request: Request) -> Sequence:
        self._record_guard(request)
        self._next_index += 1
        seq = self._new_sequence(self._next_index, request)
        self._waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the requests that finished in it."""
        if not self.has_unfinished():
            return []
        chunks = self._schedule(self._waiting, self._running)
        if not chunks:
            raise RuntimeError("no progress possible: the KV page pool is too small for one sequence")
        self._execute(chunks)
        finished = []
        for seq in [c.seq for c in chunks if c.seq.finish_reason]:
            self._running.remove(seq)
            self._release(seq)
            finished.append(self._output(seq))
        return finished

    def abort(self, index: int) -> RequestOutput | None:
        """Cancels a queued or running request now; its pages are free before the next step."""
        for queue in (self._waiting, self._running):
            seq = next((s for s in queue if s.index == index), None)
            if seq is not None:
                queue.remove(seq)
                self._release(seq)
                seq.finish_reason = "abort"
                self.stats.aborted += 1
                return self._output(seq)
        return None

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.pages)
        seq.pages, seq.page_keys, seq.num_computed = [], [], 0
        for key in seq.pending_keys:
            if self._pending.get(key) is seq:
                del self._pending[key]
        seq.pending_keys = []

    # -- scheduling --------------------------------------------------------------------------
    def _record_guard(self, request: Request) -> None:
        if request.forged_tokens:
            self.stats.forged_tokens_downgraded += request.forged_tokens
            audit.info(json.dumps({"event": "forged_control_tokens", "request_id": request.request_id,
                                   "downgraded": request.forged_tokens}))

    def _new_sequence(self, index: int, request: Request) -> Sequence:
        params = request.params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        detokenizer = IncrementalDetokenizer(self.tokenizer) if params.stop else None
        return Sequence(index=index, request=request, seed=seed, detokenizer=detokenizer)

    def _pages_for(self, seq: Sequence, upto: int) -> bool:
        """Makes sure `seq` owns pages for positions < upto; False if the pool cannot."""
        needed = math.ceil(upto / self.cfg.page_size) - len(seq.pages)
        if needed <= 0:
            return True
        pages = self.pool.allocate(needed)
        if pages is None:
            return False
        seq.pages += pages
        return True

    def _attach_prefix(self, seq: Sequence) -> bool:
        """Takes the longest cached prefix; False (nothing taken) when the next page is in flight.

        At least one token is always left to compute, so the step has a row to sample from. If the
        first page still missing is being computed by a running sequence (a shared system prompt
        in one batch), waiting for it is cheaper than computing it twice.
        """
        page_size = self.cfg.page_size
        keys = chain_keys(seq.tokens(0, seq.num_tokens), page_size, seq.request.cache_salt)
        usable = (seq.num_tokens - 1) // page_size if self.prefix_caching else 0
        pages = self.pool.lookup(keys[:usable])
        owner = self._pending.get(keys[len(pages)]) if len(pages) < usable else None
        if owner is not None and owner is not seq:
            self.pool.free(pages)
            return False
        seq.pages, seq.page_keys, seq.num_computed = pages, keys[: len(pages)], len(pages) * page_size
        seq.pending_keys = [k for k in keys[len(pages) :] if self._pending.setdefault(k, seq) is seq]
        if seq.cached_tokens < 0:
            seq.cached_tokens = min(seq.num_computed, len(seq.prompt_ids))
            self.stats.prefix_queried_tokens += len(seq.prompt_ids)
            self.stats.prefix_hit_tokens += seq.cached_tokens
        return True

    def _publish_pages(self, seq: Sequence) -> None:
        """Registers the pages this step filled, so later requests can reuse them."""
        page_size, done = self.cfg.page_size, len(seq.page_keys)
        full = seq.num_computed // page_size
        if full <= done or not self.prefix_caching:
            return
        tokens = seq.tokens(done * page_size, (full - done) * page_size)
        start = seq.page_keys[-1] if seq.page_keys else b""
        for i, key in enumerate(chain_keys(tokens, page_size, seq.request.cache_salt, start), start=done):
            self.pool.register(seq.pages[i], key)
            if self._pending.get(key) is seq:
                del self._pending[key]
            seq.page_keys.append(key)

    def _preempt(self, victim: Sequence, running: list[Sequence], waiting: deque[Sequence]) -> None:
        running.remove(victim)
        self._release(victim)
        waiting.appendleft(victim)
        self.stats.preemptions += 1
        log.info("preempted request %d (%d tokens to recompute)", victim.index, victim.num_tokens)

    def _schedule(self, waiting: deque[Sequence], running: list[Sequence]) -> list[ScheduledChunk]:
        budget = self.cfg.max_tokens_per_step
        chunks: list[ScheduledChunk] = []
        for seq in sorted(running, key=lambda s: s.arrival):
            if seq not in running or budget == 0:
                continue
            count = min(seq.num_tokens - seq.num_computed, budget)
            while not self._pages_for(seq, seq.num_computed + count):
                victim = max(running, key=lambda s: s.arrival)
                # The newest is never scheduled yet in this step (running is walked oldest first).
                self._preempt(victim, running, waiting)
                if victim is seq:
                    break
            if seq in running:
                chunks.append(ScheduledChunk(seq, seq.num_computed, count))
                budget -= count
        deferred: list[Sequence] = []  # their next prefix page is being computed by a running sequence
        while waiting and budget > 0 and len(running) < self.cfg.max_seqs:
            seq = waiting.popleft()
            if not self._attach_prefix(seq):
                deferred.append(seq)
                continue
            count = min(seq.num_tokens - seq.num_computed, budget)
            if not self._pages_for(seq, seq.num_computed + count):
                self._release(seq)
                waiting.appendleft(seq)
                break
            self._arrivals += 1
            seq.arrival = self._arrivals
            running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed, count))
            budget -= count
        waiting.extendleft(reversed(deferred))
        return chunks

    # -- execution ---------------------------------------------------------------------------
    def _build_batch(self, chunks: list[ScheduledChunk]) -> HostBatch:
        total = sum(c.count for c in chunks)
        batch = self.runner.empty_batch(self.runner.bucket_for(total))
        page_size, cursor = self.cfg.page_size, 0
        for row, chunk in enumerate(chunks):
            seq, end = chunk.seq, cursor + chunk.count
            positions = np.arange(chunk.start, chunk.start + chunk.count, dtype=np.int32)
            pages = np.asarray(seq.pages, np.int32)
            batch.tokens[cursor:end] = seq.tokens(chunk.start, chunk.count)
            batch.positions[cursor:end] = positions
            batch.seq_rows[cursor:end] = row
            batch.write_slots[cursor:end] = pages[positions // page_size] * page_size + positions % page_size
            batch.page_table[row, : len(pages)] = pages
            batch.logits_rows[row] = end - 1
            p = seq.params
            batch.temperature[row], batch.top_p[row], batch.min_p[row] = p.temperature, p.top_p, p.min_p
            batch.top_k[row] = min(p.top_k, self.runner.model_cfg.vocab_size)
            batch.seed[row], batch.step[row] = seq.seed, len(seq.output_ids)
            if len(seq.output_ids) < p.min_tokens:  # EOS and stop ids may not be sampled yet
                banned = self._stop_ids(p)
                batch.banned[row, : len(banned)] = banned
            cursor = end
        # Padding tokens read (never write) the last real row, so a trailing prefill tile stays one sequence.
        batch.seq_rows[cursor:] = len(chunks) - 1
        batch.positions[cursor:] = 0
        return batch

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        eos = [] if params.ignore_eos else sorted(self.tokenizer.eos_ids)
        return list(dict.fromkeys([*eos, *params.stop_token_ids]))

    def _execute(self, chunks: list[ScheduledChunk]) -> None:
        start = time.perf_counter()
        tokens, logprobs = self.runner.run(self._build_batch(chunks))
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - start
        for row, chunk in enumerate(chunks):
            seq = chunk.seq
            if chunk.start < len(seq.prompt_ids):
                self.stats.prompt_tokens_computed += min(chunk.count, len(seq.prompt_ids) - chunk.start)
            seq.num_computed = chunk.start + chunk.count
            self._publish_pages(seq)
            if chunk.samples:
                self._append(seq, int(tokens[row]), float(logprobs[row]))

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
        if generated >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _hit_stop_string(self, seq: Sequence, new_chars: int) -> bool:
        """Searches only the text the newest characters could have completed a stop string in."""
        text = seq.detokenizer.text
        # Each string only where the new characters could complete it (text before min_tokens was
        # allowed to contain stop strings and must not stop generation later).
        hits = [i for s in seq.params.stop if (i := text.find(s, max(0, len(text) - new_chars - len(s) + 1))) >= 0]
        if hits:
            seq.stop_at = min(hits)
            return True
        return False

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.output_ids)
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
            request_id=seq.request.request_id,
            forged_tokens=seq.request.forged_tokens,
        )
