"""Constraints with no finite automaton (`grammar`: Lark or GBNF) matched on the host by llguidance.

llguidance's Earley parser decides, after each id, which ids may come next, and writes them as a
packed bitmask (one bit per id, 32 to an int32) straight into the step's input row
(`fill_next_token_bitmask`). Because the mask depends on the newest id, a row with a matcher is
never dispatched while its newest id is still on the device: it skips the overlapped step and runs
in the next one, while the other rows keep overlapping (engine/scheduler.py, `held_for_mask`).
"""

from __future__ import annotations

import threading

import llguidance
import llguidance.numpy
import numpy as np
from tokenizers import Tokenizer as Backend

from jaxinfer.errors import RequestError
from jaxinfer.guided.spec import GuidedSpec


class HostMatcher:
    """One sequence's parser state: the ids it has consumed, and the mask of the ids allowed next."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def consume(self, token: int) -> bool:
        """Advances over a sampled id; False if the grammar refuses it."""
        return self._matcher.consume_token(token) and not self._matcher.is_error()

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the allowed next ids into `bitmask[row]` ([rows, ceil(vocab / 32)] int32)."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    @property
    def accepting(self) -> bool:
        return self._matcher.is_accepting()


class GrammarMatchers:
    """Checks grammars and makes matchers for one tokenizer (its llguidance tokenizer is built once)."""

    def __init__(self, backend: Backend, eos_id: int, vocab_size: int):
        self._backend, self._eos_id, self._vocab_size = backend, eos_id, vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def grammar(self, spec: GuidedSpec) -> str:
        """llguidance's form of a Lark or GBNF grammar; RequestError with the library's message if invalid."""
        try:
            grammar = llguidance.grammar_from("grammar", spec.value)
        except Exception as error:  # the GBNF converter raises its own error types
            raise RequestError(f"guided.grammar: {error}") from None
        message = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer())
        if message and not message.startswith("WARNING"):
            raise RequestError(f"guided.grammar: {message}")
        return grammar

    def matcher(self, grammar: str, consumed: list[int]) -> HostMatcher:
        """A matcher at the start of the output, advanced over the ids already generated (`consumed`)."""
        matcher = HostMatcher(llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0))
        for token in consumed:
            if not matcher.consume(token):
                raise RequestError(f"guided.grammar: the output so far (id {token}) does not follow the grammar")
        return matcher

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._backend.to_str(), n_vocab=self._vocab_size,
                                                         eos_token=self._eos_id)
            return self._tokenizer

