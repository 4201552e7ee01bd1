"""What a sampled (or engine-written) id does to its sequence, and the output it ends with: stop
conditions (EOS, stop ids, stop strings, lengths), logprobs, the final text.

A mixin of `Engine` (engine/engine.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jaxinfer.engine.params import RequestOutput, SamplingParams, Usage
from jaxinfer.engine.sequence import Sequence

if TYPE_CHECKING:
    from jaxinfer.engine.executor import Executor
    from jaxinfer.tokenizer import Tokenizer


def top_pairs(ids: np.ndarray, logprobs: np.ndarray) -> list[tuple[int, float]]:
    """One position's alternatives, as read back from the step, in the outputs' form: (id, logprob) pairs."""
    return list(zip(ids.tolist(), logprobs.tolist(), strict=True))


class OutputAssembly:
    """Appends ids to sequences (`_append`, `_append_forced`) and builds their `RequestOutput`s."""

    tokenizer: Tokenizer
    max_model_len: int
    executor: Executor | None
    _forced_finished: list[Sequence]

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

    def _append(self, seq: Sequence, token: int, logprob: float) -> None:
        p = seq.params
        seq.output_ids.append(token)
        seq.logprobs.append(logprob)
        delta = seq.detokenizer.push(token) if seq.detokenizer else ""
        if not self._advance_guide(seq, token):
            seq.finish_reason = "abort"
            return
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
