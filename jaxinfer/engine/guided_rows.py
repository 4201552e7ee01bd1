"""Guided (structured) output on the engine's side: requests checked and compiled before they start,
the grammar placed on the device while its sequences run, each row's automaton state filled into the
step, and the host's state advanced over every id it reads back.

A mixin of `Engine` (engine/engine.py). The host state follows only the ids it knows, so preemption,
prefix-cache hits, a discarded step in flight or a restart from a prefill worker's ids need nothing
of their own: the state is always the walk over `output_ids`. The one id the host may not know yet
(overlap) is applied on the device (engine/guide_tables.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from jaxinfer.engine.params import SamplingParams
from jaxinfer.engine.sequence import ScheduledChunk, Sequence
from jaxinfer.engine.step_inputs import HostBatch
from jaxinfer.errors import RequestError
from jaxinfer.guided.automaton import REFUSED
from jaxinfer.guided.compiler import GuideCompiler

if TYPE_CHECKING:
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.step import ModelRunner
    from jaxinfer.tokenizer import Tokenizer


class GuidedRows:
    """Checks, claims, fills and advances the rows of constrained sequences."""

    runner: ModelRunner
    cfg: EngineConfig
    tokenizer: Tokenizer

    def guide_compiler(self) -> GuideCompiler:
        """The runner's compiler (one per runner: engines on it share the cache), made on first use."""
        if self.runner.guide_compiler is None:
            eos = self.tokenizer.token_id(self.tokenizer.primary_eos or "")
            cfg = self.cfg
            self.runner.guide_compiler = GuideCompiler(self.tokenizer.backend, -1 if eos is None else eos,
                                                       self.runner.model_cfg.vocab_size, cfg.guided_max_states,
                                                       cfg.guided_max_classes)
        return self.runner.guide_compiler

    def prefetch_guided(self, params: Iterable[SamplingParams]) -> None:
        """Starts the compiles of these constraints side by side (validation then finds them compiled)."""
        for p in params:
            if p.guided is not None and self.cfg.guided_grammars:
                self.guide_compiler().submit(p.guided)

    def _check_guided(self, params: SamplingParams) -> None:
        """RequestError for a constraint this engine cannot enforce; compiles it (cached) on this thread."""
        if params.guided is None:
            return
        if not self.cfg.guided_grammars:
            raise RequestError("guided: this engine has guided output off (engine.guided_grammars is 0)")
        if params.exec:
            raise RequestError("guided: not with exec (a program's result tokens would not follow the constraint)")
        if params.min_tokens or params.ignore_eos:
            raise RequestError("guided: not with min_tokens or ignore_eos (the constraint decides when EOS may come)")
        self.guide_compiler().get(params.guided)

    def _start_guide(self, seq: Sequence) -> None:
        """A new sequence's automaton, and its state after the ids a prefill worker generated."""
        if seq.params.guided is not None:
            seq.guide = self.guide_compiler().get(seq.params.guided)
            seq.guide_state = max(seq.guide.walk(seq.output_ids), 0)

    def _claim_guide(self, seq: Sequence) -> bool:
        """On admission, the grammar on the device; False while every slot or pool row is in use."""
        if seq.guide is None or seq.guide_loaded is not None:
            return True
        seq.guide_loaded = self.runner.load_guide(seq.params.guided.key, seq.guide)
        return seq.guide_loaded is not None

    def _release_guide(self, seq: Sequence) -> None:
        if seq.guide_loaded is not None:
            self.runner.guide_slots.release(seq.params.guided.key)
            seq.guide_loaded = None

    def _fill_guides(self, batch: HostBatch, chunks: list[ScheduledChunk]) -> None:
        """Rows whose sample is kept and that are constrained: their state's pool row, their grammar's
        slot, and where their newest id is if the step in flight has not returned it yet."""
        if not self.runner.guide_slots.users:  # the common case costs no walk over the batch
            return
        for row, chunk in enumerate(chunks):
            seq = chunk.seq
            if chunk.samples and seq.guide_loaded is not None:
                batch.guide_state[row] = seq.guide_loaded.base + seq.guide_state
                batch.guide_grammar[row] = seq.guide_loaded.slot
                if seq.inflight:
                    batch.guide_prev[row] = seq.last_row

    def _advance_guide(self, seq: Sequence, token: int) -> None:
        """The host's state after a sampled id (EOS ends the sequence, so it does not move the state)."""
        if seq.guide is None or token in self.tokenizer.eos_ids:
            return
        state = seq.guide.next_state(seq.guide_state, token)
        if state == REFUSED:  # the mask allows only what the automaton does: this is an engine bug
            raise RuntimeError(f"guided: request {seq.request.request_id!r} sampled id {token}, which its "
                               "automaton refuses")
        seq.guide_state = state
