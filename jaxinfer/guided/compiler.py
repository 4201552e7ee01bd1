"""Compiles `guided` specs into token automata with outlines-core, off the engine thread, cached.

`submit` starts a compile on a small thread pool and returns its future; `get` waits for it.
Requests are validated (and so compiled) on the thread that submits them (a server's handler
thread, or `Engine.generate` before the first step), so a slow schema never stalls the batch in
flight. Results, failures included, are cached by the spec's content hash, least recently used out.

outlines-core was chosen over xgrammar (needs torch at runtime) and beside llguidance (no finite
automaton to put on the device): docs/design/structured-output.md.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from llguidance import LLTokenizer
from outlines_core import Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from jaxinfer.errors import RequestError
from jaxinfer.guided.automaton import TokenAutomaton, from_transitions
from jaxinfer.guided.spec import GuidedSpec
from jaxinfer.guided.vocabulary import token_bytes

# Between JSON tokens at most one space: outlines' default ([\n\t ]*) lets a model loop on whitespace
# and multiplies the states.
JSON_WHITESPACE = r"[ ]?"
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # json_object: any object, nested up to outlines' recursion depth 3
_REGEX_SPECIAL = set(r"\.+*?()|[]{}^$#&-~ ")


def choice_regex(choices: list[str]) -> str:
    """An alternation matching exactly one of `choices` (each character that is a regex operator escaped)."""
    return "(" + "|".join("".join("\\" + c if c in _REGEX_SPECIAL else c for c in choice) for choice in choices) + ")"


_BYTE_EOS = 256


@functools.cache
def _byte_vocabulary() -> Vocabulary:
    """One token per byte: the automaton over it has exactly the DFA's states."""
    return Vocabulary(_BYTE_EOS, {bytes([b]): [b] for b in range(256)})


def regex_of(spec: GuidedSpec) -> str:
    """The regular expression a spec compiles through; RequestError for kinds with no finite automaton."""
    if spec.kind == "regex":
        return spec.value
    if spec.kind == "choice":
        return choice_regex(spec.choices)
    if spec.kind == "grammar":  # no finite automaton: matched on the host (host_matcher.py)
        raise ValueError("guided.grammar has no token automaton")
    schema = spec.value if spec.kind == "json_schema" else JSON_OBJECT_SCHEMA
    try:
        return build_regex_from_schema(schema, whitespace_pattern=JSON_WHITESPACE)
    except Exception as error:  # outlines raises TypeError, ValueError or its own errors for schemas it refuses
        raise RequestError(f"guided.{spec.kind}: {error}") from None


class GuideCompiler:
    """Spec -> TokenAutomaton for one tokenizer, within the engine's limits."""

    def __init__(self, tokenizer: Callable[[], LLTokenizer], eos_id: int, vocab_size: int, max_states: int,
                 max_classes: int, max_pairs: int, cache_size: int = 64, workers: int = 2):
        """`tokenizer`: llguidance's tokenizer of the model (shared with the grammar matchers, built once)."""
        self.vocab_size, self.max_states, self.max_classes = vocab_size, max_states, max_classes
        self.max_pairs = max_pairs
        self._tokenizer, self._eos_id, self._cache_size = tokenizer, eos_id, cache_size
        self._vocabulary: Vocabulary | None = None
        self._allowed_ids = np.zeros(vocab_size, bool)
        self._first_bytes = np.zeros(256, np.int64)  # tokens per first byte
        self._lock = threading.Lock()  # the cache's
        self._vocabulary_lock = threading.Lock()  # building it takes about a second: not under the cache's
        self._cache: OrderedDict[str, Future[TokenAutomaton]] = OrderedDict()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="guided-compile")

    def submit(self, spec: GuidedSpec) -> Future[TokenAutomaton]:
        """The compile of `spec`, started now or earlier (a cache hit)."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is None:
                future = self._cache[spec.key] = self._pool.submit(self._compile, spec)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(spec.key)
            return future

    def get(self, spec: GuidedSpec) -> TokenAutomaton:
        """Waits for the compile; RequestError naming the field for a spec that does not compile or fit."""
        return self.submit(spec).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GuidedSpec) -> TokenAutomaton:
        pattern = regex_of(spec)
        if spec.kind != "json_object":  # the engine's own schema fits (`tools/bench.py guided-sizes`); its
            # byte-level automaton alone takes seconds to build, so it is not checked again each compile
            self._check_size(spec, pattern)
        try:
            index = Index(pattern, self._outlines_vocabulary())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # ValueError for a bad pattern; a Rust panic is pyo3's PanicException,
            raise RequestError(f"guided.{spec.kind}: {error}") from None  # which is not an Exception
        automaton = from_transitions(index.get_transitions(), index.get_initial_state(), set(index.get_final_states()),
                                     self.vocab_size, self._allowed_ids)
        if automaton.num_states > self.max_states:
            raise RequestError(f"guided.{spec.kind}: its automaton has {automaton.num_states} states, more than "
                               f"engine.guided_max_states = {self.max_states}")
        if automaton.num_classes > self.max_classes:
            raise RequestError(f"guided.{spec.kind}: its automaton has {automaton.num_classes} token classes, more "
                               f"than engine.guided_max_classes = {self.max_classes}")
        if not automaton.final.any():
            raise RequestError(f"guided.{spec.kind}: no output of this vocabulary's tokens can match it")
        return automaton

    def size_of(self, spec: GuidedSpec, pattern: str) -> tuple[int, int]:
        """(states, a bound of the (state, token) pairs) of the automaton `pattern` compiles to, found
        without building it: the same DFA over single bytes has exactly its states (every token-level
        state is one of them), and each state's tokens are at most those whose first byte it allows."""
        try:
            index = Index(pattern, _byte_vocabulary())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:
            raise RequestError(f"guided.{spec.kind}: {error}") from None
        transitions = index.get_transitions()
        self._outlines_vocabulary()
        bound = sum(int(self._first_bytes[list(row.keys() - {_BYTE_EOS})].sum()) for row in transitions.values())
        return len(transitions.keys() | set(index.get_final_states())), bound

    def _check_size(self, spec: GuidedSpec, pattern: str) -> None:
        """Refuses, before the full compile, an automaton too big to build. Without this a pattern such
        as `[a-z]{4000}` would build tens of millions of pairs, gigabytes, before any check."""
        states, bound = self.size_of(spec, pattern)
        if states > self.max_states:
            raise RequestError(f"guided.{spec.kind}: its automaton has {states} states, more than "
                               f"engine.guided_max_states = {self.max_states}")
        if bound > self.max_pairs:
            raise RequestError(f"guided.{spec.kind}: its automaton could hold {bound:,} (state, token) pairs, more "
                               f"than engine.guided_max_pairs = {self.max_pairs:,}")

    def _outlines_vocabulary(self) -> Vocabulary:
        with self._vocabulary_lock:
            if self._vocabulary is None:
                tokens: dict[bytes, list[int]] = {}
                for token, text in token_bytes(self._tokenizer()).items():
                    if token != self._eos_id and token < self.vocab_size and text:
                        tokens.setdefault(text, []).append(token)
                self._allowed_ids[[t for ids in tokens.values() for t in ids]] = True
                self._first_bytes = np.bincount([text[0] for text, ids in tokens.items() for _ in ids], minlength=256)
                self._vocabulary = Vocabulary(self._eos_id, tokens)
            return self._vocabulary
