"""Repetition, frequency and presence penalties on the engine's side: a sequence with penalties holds
one of the runner's token-count slots while it runs, loaded when the host knows all its ids, and
its step rows name that slot.

A mixin of `Engine` (engine/engine.py); the counts themselves live on the device (engine/penalties.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxinfer.engine.sequence import ScheduledChunk, Sequence
from jaxinfer.engine.step_inputs import HostBatch

if TYPE_CHECKING:
    from jaxinfer.engine.step import ModelRunner


class PenaltySlots:
    """Claims, loads and releases penalty slots; fills the step's penalty rows."""

    runner: ModelRunner

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
