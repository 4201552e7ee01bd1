"""The host side of speculative decoding: which rows speculate, the draft's proposal loop, the verify batch.

One round per engine step, synchronously (speculation needs the accepted count before the next
step is built, so overlapped scheduling is off with a draft model):

1. `plan`: a decode row speculates when its request allows it (`SamplingParams.num_draft_tokens`,
   capped by the engine's) and room is left under `max_tokens`, the context and the step's largest
   bucket; short of `min_tokens`, only as many as keep every scored position under the ban on
   stop ids. Pages for the proposals are reserved now, without
   preempting anyone (no pages: fewer proposals).
2. `refill`: restored pages (from the KV tiers, or a prefill worker's handoff) hold the target's KV
   only; before any draft call reads one, the draft computes its own KV of it (largest bucket).
3. `propose`: up to K draft calls over the speculating rows, one position each. After each call the
   host reads the proposals' confidence (the draft's top probability); a row stops at the first
   proposal below `draft_confidence`, which is not proposed, and the loop ends when every row has
   stopped, so the verify length follows how sure the draft is.
4. The engine builds the verify batch (speculating rows first, each its last token followed by its
   proposals), runs `SpecRunner.verify`, appends each row's accepted tokens and drawn token, and
   gives back the pages of rejected positions (`Scheduler.trim`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxinfer.engine.metrics import EngineStats
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import ScheduledChunk, Sequence
from jaxinfer.engine.spec_step import ProposeResult, SpecRunner
from jaxinfer.engine.step_inputs import HostBatch

Span = tuple[Sequence, int, int]  # a sequence's positions [start, end)


@dataclass
class Round:
    """One step's speculation: the chunks (speculating rows first), and per speculating row its budget
    and proposals."""

    chunks: list[ScheduledChunk]
    budgets: list[int]  # proposals allowed per speculating row
    drafts: list[list[int]] = field(default_factory=list)  # per chunk (empty for the others)
    proposals: list[ProposeResult] = field(default_factory=list)

    @property
    def rows(self) -> list[ScheduledChunk]:
        return self.chunks[: len(self.budgets)]


class Speculator:
    def __init__(self, spec: SpecRunner, scheduler: Scheduler, stats: EngineStats, confidence: float,
                 max_model_len: int, fill_sampling: Callable[[HostBatch, int, Sequence, int], None]):
        """`fill_sampling(batch, row, seq, step)` writes a row's sampling settings (the engine's)."""
        self.spec, self.scheduler, self.stats = spec, scheduler, stats
        self.confidence, self.max_model_len, self.fill_sampling = confidence, max_model_len, fill_sampling
        self.k = spec.k

    def plan(self, chunks: list[ScheduledChunk]) -> Round:
        room = self.spec.target.cfg.max_tokens_per_step - sum(c.count for c in chunks)
        speculating, budgets, others = [], [], []
        for chunk in chunks:
            budget = min(self.budget(chunk), max(room, 0))
            if budget > 0 and not self.scheduler.reserve(chunk.seq, chunk.start + 1 + budget):
                pages = len(chunk.seq.pages) * self.scheduler.cfg.page_size
                budget = max(0, min(budget, pages - chunk.start - 1))
            if budget > 0:
                speculating.append(chunk)
                budgets.append(budget)
                room -= budget
            else:
                others.append(chunk)
        return Round(speculating + others, budgets)

    def budget(self, chunk: ScheduledChunk) -> int:
        """The proposals a chunk may get this round, before the step's token room is shared out."""
        seq, params = chunk.seq, chunk.seq.params
        if not chunk.samples or chunk.count != 1 or chunk.start < len(seq.prompt_ids):
            return 0  # prefill chunks are not speculated on
        cap = self.k if params.num_draft_tokens is None else min(self.k, params.num_draft_tokens)
        if seq.num_generated < params.min_tokens:  # the row's ban on stop ids must cover every scored position
            cap = min(cap, params.min_tokens - seq.num_generated - 1)
        left = min(params.max_tokens - seq.num_generated, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(cap, left))

    def refill(self, chunks: list[ScheduledChunk], empty_batch: Callable[[int], HostBatch]) -> None:
        """Computes the draft's KV of the restored pages that `chunks` read (the pages before each chunk).

        From a sequence's first restored page to its last, every page is recomputed (the span is one
        causal prefill). A page shared by several chunks is recomputed once."""
        restored, page_size = self.scheduler.pool.restored, self.scheduler.cfg.page_size
        spans: list[Span] = []
        stale_pages: set[int] = set()
        for chunk in chunks if restored else ():
            read = chunk.seq.pages[: chunk.start // page_size]
            stale = [i for i, page in enumerate(read) if page in restored and page not in stale_pages]
            if stale:
                spans.append((chunk.seq, stale[0] * page_size, (stale[-1] + 1) * page_size))
                stale_pages.update(read[stale[0] : stale[-1] + 1])
        largest = self.spec.refill_bucket
        for group in refill_groups(spans, largest, self.spec.target.rows_for(largest)):
            tokens = sum(end - start for _, start, end in group)
            bucket = self.spec.smallest_propose_bucket(tokens, len(group))
            self.spec.propose(self._refill_batch(group, empty_batch(bucket)), None)
            self.stats.spec_draft_refilled_tokens += tokens
        restored.difference_update(stale_pages)  # only now: a failed call leaves them to the next round

    def _refill_batch(self, group: list[Span], batch: HostBatch) -> HostBatch:
        """One row per span: its tokens at their positions, writing the draft's KV into their pages."""
        page_size, cursor = self.scheduler.cfg.page_size, 0
        for row, (seq, start, end) in enumerate(group):
            span, positions, pages = slice(cursor, cursor + end - start), np.arange(start, end), np.asarray(seq.pages)
            batch.tokens[span] = seq.tokens(start, end - start)
            batch.positions[span], batch.seq_rows[span] = positions, row
            batch.write_slots[span] = pages[positions // page_size] * page_size + positions % page_size
            batch.page_table[row, : len(pages)] = pages
            batch.logits_rows[row] = span.stop - 1
            cursor = span.stop
        batch.seq_rows[cursor:] = len(group) - 1  # padding tokens belong to a real row (and write to page 0)
        return batch

    def propose(self, plan: Round, empty_batch, bucket_for) -> None:
        """Runs the draft loop, filling `plan.drafts` and `plan.proposals`."""
        rows, page_size = plan.rows, self.scheduler.cfg.page_size
        plan.drafts = [[] for _ in plan.chunks]
        if not rows:
            return
        active = [True] * len(rows)
        bucket = bucket_for(len(rows))
        previous = None
        for i in range(self.k):
            if not any(a and i < b for a, b in zip(active, plan.budgets, strict=True)):
                break
            batch = empty_batch(bucket)
            for j, chunk in enumerate(rows):
                seq, position = chunk.seq, chunk.start + i
                if i == 0:
                    batch.tokens[j] = seq.tokens(chunk.start, 1)[0]
                else:
                    batch.from_prev[j] = j  # the token this row's draft proposed in the previous call
                batch.positions[j], batch.seq_rows[j], batch.logits_rows[j] = position, j, j
                if i < plan.budgets[j]:  # past its budget a row writes to the null page
                    batch.write_slots[j] = seq.pages[position // page_size] * page_size + position % page_size
                batch.page_table[j, : len(seq.pages)] = seq.pages
                self.fill_sampling(batch, j, seq, seq.num_generated + i)  # as the verify step samples
                guide = seq.guide_row_after(plan.drafts[j])  # the proposals so far are on the host
                if guide is not None:
                    batch.guide_state[j], batch.guide_grammar[j] = guide
            batch.seq_rows[len(rows) :] = len(rows) - 1
            previous = self.spec.propose(batch, previous)
            plan.proposals.append(previous)
            tokens, confidence = jax.device_get((previous.tokens, previous.confidence))
            for j in range(len(rows)):
                if active[j] and i < plan.budgets[j] and confidence[j] >= self.confidence:
                    plan.drafts[j].append(int(tokens[j]))
                else:
                    active[j] = False
        self.stats.spec_draft_calls += len(plan.proposals)


def refill_groups(spans: list[Span], tokens: int, rows: int) -> list[list[Span]]:
    """The spans, in order, cut and grouped into batches of at most `tokens` tokens and `rows` rows.

    A later span may read pages an earlier one in the same batch writes (a shared prefix): each layer
    writes the batch's KV before it attends, so it reads what the earlier span wrote."""
    groups: list[list[Span]] = [[]]
    used = 0
    for seq, start, end in spans:
        while start < end:
            if used == tokens or len(groups[-1]) == rows:
                groups.append([])
                used = 0
            piece_end = min(end, start + tokens - used)
            groups[-1].append((seq, start, piece_end))
            used += piece_end - start
            start = piece_end
    return [group for group in groups if group]
