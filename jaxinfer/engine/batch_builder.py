"""The step's padded host arrays, built from the scheduler's chunks: tokens (or where the step in
flight left them on the device), positions, page tables, KV write slots, logits rows, adapters and
each row's sampling settings.

A mixin of `Engine` (engine/engine.py); the penalty rows come from `PenaltySlots`, the banned ids
from `RequestAdmission`."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

from jaxinfer.engine.sequence import ScheduledChunk, Sequence
from jaxinfer.engine.step_inputs import HostBatch

if TYPE_CHECKING:
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.step import ModelRunner


class StepBatchBuilder:
    """`_build_batch` and the per-row sampling settings (`_fill_sampling_rows`)."""

    runner: ModelRunner
    cfg: EngineConfig

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
        self._fill_guides(batch, chunks)
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
