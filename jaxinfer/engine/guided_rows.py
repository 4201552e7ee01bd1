"""Guided (structured) output on the engine's side: requests checked and compiled before they start,
the grammar placed on the device (or a bitmask row given) while its sequences run, each row's
automaton state or host-filled mask put into the step, and the host's state advanced over every id
it reads back.

A mixin of `Engine` (engine/engine.py). The host state follows only the ids it knows, so preemption,
prefix-cache hits, a discarded step in flight or a restart from a prefill worker's ids need nothing
of their own: the state is always the walk over `output_ids`. The one id the host may not know yet
(overlap) is applied on the device (engine/guide_tables.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from jaxinfer.engine.params import Request, SamplingParams
from jaxinfer.engine.sequence import ScheduledChunk, Sequence
from jaxinfer.engine.step_inputs import HostBatch
from jaxinfer.errors import RequestError
from jaxinfer.guided.automaton import REFUSED
from jaxinfer.guided.compiler import GuideCompiler
from jaxinfer.guided.host_matcher import GrammarMatchers
from jaxinfer.guided.spec import GuidedSpec

if TYPE_CHECKING:
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.metrics import EngineStats
    from jaxinfer.engine.speculator import Speculator
    from jaxinfer.engine.step import ModelRunner
    from jaxinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_MAKING = threading.Lock()


class GuidedRows:
    """Checks, claims, fills and advances the rows of constrained sequences."""

    runner: ModelRunner
    cfg: EngineConfig
    tokenizer: Tokenizer
    speculator: Speculator | None
    stats: EngineStats

    def guide_compiler(self) -> GuideCompiler:
        """The runner's compiler (engines on a runner, and replicas, share its cache)."""
        matchers = self.grammar_matchers()  # its llguidance tokenizer gives the compiler the token bytes
        with _MAKING:  # handler threads validate at once: one compiler, not one each
            if self.runner.guide_compiler is None:
                cfg = self.cfg
                self.runner.guide_compiler = GuideCompiler(matchers.tokenizer, self._primary_eos(),
                                                           self.runner.model_cfg.vocab_size, cfg.guided_max_states,
                                                           cfg.guided_max_classes, cfg.guided_max_pairs)
            return self.runner.guide_compiler

    def grammar_matchers(self) -> GrammarMatchers:
        with _MAKING:
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

    def _check_guided(self, request: Request) -> None:
        """RequestError for a constraint this engine cannot enforce. Compiles it (cached) on this thread
        (a handler's, or the batch runner's before its first step) and keeps the result on the request,
        so the engine thread, validating again when it adds the request, compiles nothing."""
        params, spec = request.params, request.params.guided
        if spec is None:
            return
        if params.exec:
            raise RequestError("guided: not with exec (a program's result tokens would not follow the constraint)")
        if params.min_tokens or params.ignore_eos:
            raise RequestError("guided: not with min_tokens or ignore_eos (the constraint decides when EOS may come)")
        if self._primary_eos() < 0:
            raise RequestError("guided: this model's tokenizer names no EOS token, so no constrained output could end")
        if spec.kind == "grammar":
            self._check_grammar(request, spec)
            return
        if not self.cfg.guided_grammars:
            raise RequestError("guided: this engine has guided output off (engine.guided_grammars is 0)")
        if request.compiled_guide is None:
            request.compiled_guide = self.guide_compiler().get(spec)
        if request.compiled_guide.walk(request.generated_ids) == REFUSED:
            raise RequestError(f"generated_ids: the ids generated so far are not accepted by guided.{spec.kind}")

    def _check_grammar(self, request: Request, spec: GuidedSpec) -> None:
        if not self.cfg.guided_host_rows:
            raise RequestError("guided.grammar: this engine matches no grammars (engine.guided_host_rows is 0)")
        if self.speculator is not None:
            raise RequestError("guided.grammar: not with speculative decoding (engine.draft_model): the host "
                               "matcher cannot mask proposals it has not seen")
        if request.compiled_guide is None:
            matchers = self.grammar_matchers()
            request.compiled_guide = matchers.grammar(spec)
            if request.generated_ids:  # a prefill worker's ids must follow it
                matchers.matcher(request.compiled_guide, request.generated_ids)

    def _start_guide(self, seq: Sequence) -> None:
        """A new sequence's automaton or matcher, in the state after the ids a prefill worker generated."""
        spec, compiled = seq.params.guided, seq.request.compiled_guide
        if spec is None:
            return
        self.stats.guided_requests += 1
        if spec.kind == "grammar":
            seq.matcher = self.grammar_matchers().matcher(compiled, seq.output_ids)
        else:
            seq.guide = compiled
            seq.guide_state = compiled.walk(seq.output_ids)

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

    def _advance_guide(self, seq: Sequence, token: int) -> bool:
        """The host's state after a sampled id (EOS ends the sequence, so it does not move the state);
        False if the constraint refuses the id. The mask allows only what the automaton does, so that
        is an engine bug, or llguidance out of its limits (its matcher then refuses everything): this
        sequence ends, the others go on."""
        if token in self.tokenizer.eos_ids or (seq.guide is None and seq.matcher is None):
            return True
        if seq.matcher is not None:
            advanced = seq.matcher.consume(token)
        else:
            seq.guide_state = seq.guide.next_state(seq.guide_state, token)
            advanced = seq.guide_state != REFUSED
        if not advanced:
            self.stats.guided_refused_ids += 1
            log.error("guided: request %r sampled id %d, which its %s constraint refuses; it ends here",
                      seq.request.request_id, token, seq.params.guided.kind)
        return advanced
