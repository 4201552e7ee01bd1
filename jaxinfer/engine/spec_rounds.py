"""The engine's step with a draft model: one synchronous speculative round (schedule, propose with the
draft, verify with the target, apply the accepted tokens), in place of the overlapped step.

A mixin of `Engine` (engine/engine.py); the round's plan and proposals are engine/speculator.py's,
the verification on the device engine/spec_step.py's."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from jaxinfer.engine.params import RequestOutput
from jaxinfer.engine.sequence import Sequence
from jaxinfer.engine.speculator import Round

if TYPE_CHECKING:
    from jaxinfer.engine.disagg import PagePublisher
    from jaxinfer.engine.metrics import EngineStats
    from jaxinfer.engine.scheduler import Scheduler
    from jaxinfer.engine.speculator import Speculator
    from jaxinfer.engine.step import ModelRunner


class SpeculativeRounds:
    """`_speculative_step`: what `Engine.step` runs when the runner has a draft model."""

    runner: ModelRunner
    scheduler: Scheduler
    speculator: Speculator | None
    stats: EngineStats
    _publisher: PagePublisher | None

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
