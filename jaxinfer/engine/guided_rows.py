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
from jaxinfer.guided.host_matcher import GrammarMatchers
from jaxinfer.guided.spec import GuidedSpec

if TYPE_CHECKING:
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.speculator import Speculator
    from jaxinfer.engine.step import ModelRunner
    from jaxinfer.tokenizer import Tokenizer


class GuidedRows:
    """Checks, claims, fills and advances the rows of constrained sequences."""

    runner: ModelRunner
    cfg: EngineConfig
    tokenizer: Tokenizer
    speculator: Speculator | None

    def guide_compiler(self) -> GuideCompiler:
        """The runner's compiler (one per runner: engines on it share the cache), made on first use."""
        if self.runner.guide_compiler is None:
            cfg = self.cfg
            self.runner.guide_compiler = GuideCompiler(self.tokenizer.backend, self._primary_eos(),
                                                       self.runner.model_cfg.vocab_size, cfg.guided_max_states,
                                                       cfg.guided_max_classes)
        return self.runner.guide_compiler

    def grammar_matchers(self) -> GrammarMatchers:
        if self.runner.grammar_matchers is None:
            self.runner.grammar_matchers = GrammarMatchers(self.tokenizer.backend, self._primary_eos(),
                                                           self.runner.model_cfg.vocab_size)
        return self.runner.grammar_matchers

    def _primary_eos(self) -> int:
        eos = self.tokenizer.token_id(self.tokenizer.primary_eos or "")
        return -1 if eos is None else eos

    def prefetch_guided(self, params: Iterable[SamplingParams]) -> None:
        """Starts the compiles of these constraints side by side (validation then finds them compiled)."""
        for p in params:
            if p.guided is not None and p.guided.kind != "grammar" and self.cfg.guided_grammars:
                self.guide_compiler().submit(p.guided)

    def _check_guided(self, params: SamplingParams) -> None:
        """RequestError for a constraint this engine cannot enforce; compiles it (cached) on this thread."""
        spec = params.guided
        if spec is None:
            return
        if params.exec:
            raise RequestError("guided: not with exec (a program's result tokens would not follow the constraint)")
        if params.min_tokens or params.ignore_eos:
            raise RequestError("guided: not with min_tokens or ignore_eos (the constraint decides when EOS may come)")
        if spec.kind == "grammar":
            self._check_grammar(spec)
            return
        if not self.cfg.guided_grammars:
            raise RequestError("guided: this engine has guided output off (engine.guided_grammars is 0)")
        self.guide_compiler().get(spec)

    def _check_grammar(self, spec: GuidedSpec) -> None:
        if not self.cfg.guided_host_rows:
            raise RequestError("guided.grammar: this engine matches no grammars (engine.guided_host_rows is 0)")
        if self.speculator is not None:
            raise RequestError("guided.grammar: not with speculative decoding (engine.draft_model): the host "
                               "matcher cannot mask proposals it has not seen")
        self.grammar_matchers().grammar(spec)

    def _start_guide(self, seq: Sequence) -> None:
        """A new sequence's automaton or matcher, in the state after the ids a prefill worker generated."""
        spec = seq.params.guided
        if spec is None:
            return
        if spec.kind == "grammar":
            matchers = self.grammar_matchers()
            seq.matcher = matchers.matcher(matchers.grammar(spec), seq.output_ids)
        else:
            seq.guide = self.guide_compiler().get(spec)
            seq.guide_state = max(seq.guide.walk(seq.output_ids), 0)

    def _claim_guide(self, seq: Sequence) -> bool:
        """On admission, the grammar on the device or a bitmask row; False while none is free."""
        if seq.matcher is not None:
            if seq.mask_row is None and self.runner.free_mask_rows:
                seq.mask_row = self.runner.free_mask_rows.pop()
            return seq.mask_row is not None
        if seq.guide is None or seq.guide_loaded is not None:
            return True
        seq.guide_loaded = self.runner.load_guide(seq.params.guided.key, seq.guide)
        return seq.guide_loaded is not None

    def _release_guide(self, seq: Sequence) -> None:
        if seq.guide_loaded is not None:
            self.runner.guide_slots.release(seq.params.guided.key)
            seq.guide_loaded = None
        if seq.mask_row is not None:
            self.runner.free_mask_rows.append(seq.mask_row)
            seq.mask_row = None

    def _fill_guides(self, batch: HostBatch, chunks: list[ScheduledChunk]) -> None:
        """Rows whose sample is kept and that are constrained: an automaton's state row, its grammar slot
        and where the newest id is if the step in flight has not returned it; or a host matcher's mask."""
        runner = self.runner
        if not runner.guide_slots.users and len(runner.free_mask_rows) == self.cfg.guided_host_rows:
            return  # the common case costs no walk over the batch
        for row, chunk in enumerate(chunks):
            seq = chunk.seq
            if not chunk.samples:
                continue
            if seq.guide_loaded is not None:
                batch.guide_state[row] = seq.guide_loaded.base + seq.guide_state
                batch.guide_grammar[row] = seq.guide_loaded.slot
                if seq.inflight:
                    batch.guide_prev[row] = seq.last_row
            elif seq.mask_row is not None:
                assert not seq.inflight, "a host-matched row waits for its newest id (Sequence.held_for_mask)"
                seq.matcher.fill(batch.guide_bitmask, seq.mask_row)
                batch.guide_mask_row[row] = seq.mask_row

    def _advance_guide(self, seq: Sequence, token: int) -> None:
        """The host's state after a sampled id (EOS ends the sequence, so it does not move the state)."""
        if token in self.tokenizer.eos_ids or (seq.guide is None and seq.matcher is None):
            return
        if seq.matcher is not None:
            advanced = seq.matcher.consume(token)
        else:
            seq.guide_state = seq.guide.next_state(seq.guide_state, token)
            advanced = seq.guide_state != REFUSED
        if not advanced:  # the mask allows only what the constraint does: this is an engine bug
            raise RuntimeError(f"guided: request {seq.request.request_id!r} sampled id {token}, which its "
                               "constraint refuses")
