"""Prompt logprobs on the engine's side: which prompt positions each step scores (targets in the
batch) and how the read-back scores land in their sequences.

A mixin of `Engine` (engine/engine.py); the scores are computed in the step (engine/prompt_logprobs.py)."""

from __future__ import annotations

from jaxinfer.engine.inflight import InflightStep, ScoredSpan
from jaxinfer.engine.outputs import top_pairs
from jaxinfer.engine.sequence import ScheduledChunk, Sequence
from jaxinfer.engine.step_inputs import HostBatch


class PromptSpans:
    """Scores prompt positions once each, across chunks, preemption and discarded steps."""

    _scoring: set[Sequence]

    def _fill_prompt_scoring(self, batch: HostBatch, chunks: list[ScheduledChunk]) -> list[ScoredSpan]:
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

    def _count_scored(self, spans: list[ScoredSpan]) -> None:
        """After the dispatch: the positions the step scores count as asked for."""
        for span in spans:
            span.seq.prompt_scored = span.first + span.count
            if not span.seq.scoring_prompt:
                self._scoring.discard(span.seq)

    @staticmethod
    def _score_chunk(batch: HostBatch, chunk: ScheduledChunk, offset: int) -> ScoredSpan | None:
        """Targets for the chunk's positions from the sequence's first unscored one (position p: token p + 1)."""
        seq = chunk.seq
        assert chunk.start <= seq.prompt_scored, "a prompt position was skipped unscored"
        first, end = seq.prompt_scored, min(chunk.start + chunk.count, len(seq.prompt_ids) - 1)
        if first >= end:
            return None
        at = offset + first - chunk.start
        batch.prompt_targets[at : at + end - first] = seq.prompt_ids[first + 1 : end + 1]
        batch.prompt_alternatives[at : at + end - first] = seq.params.prompt_logprobs
        return ScoredSpan(seq, at, first, end - first)

    @staticmethod
    def _record_prompt_scores(step: InflightStep) -> None:
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
                    top_pairs(row_ids, row_logprobs) for row_ids, row_logprobs in zip(ids[rows, :k], logprobs[rows, :k],
                                                                                   strict=True)]
