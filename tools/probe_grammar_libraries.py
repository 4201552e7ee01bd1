"""Probes llguidance and outlines-core on the embedded SmolLM2 vocabulary (issue 39's library choice).

Neither library is a project dependency yet; install them beside the venv first:
  pip download --no-deps llguidance==1.9.1 outlines-core==0.2.14 -d /tmp/gl
  pip install --no-deps --target /tmp/gl/site /tmp/gl/*.whl
  PYTHONPATH=/tmp/gl/site python tools/probe_grammar_libraries.py
Prints one JSON line per measurement: llguidance's tokenizer setup, matcher and mask times for a
50-field schema; outlines-core's token-DFA size and compile time for a choice, a regex and a schema.
"""

from __future__ import annotations

import json
import time

import numpy as np

from jaxinfer.tokenizer.gguf_vocab import backend_from_gguf
from jaxinfer.weights.gguf_file import GGUFCheckpoint
from jaxinfer.weights.registry import resolve

EOS = 2


def smollm2_backend():
    return backend_from_gguf(GGUFCheckpoint(resolve("smollm2-135m").path))


def object_schema(fields: int) -> str:
    names = [f"f{i}" for i in range(fields)]
    return json.dumps({"type": "object", "properties": {n: {"type": "integer"} for n in names},
                       "required": names, "additionalProperties": False})


def probe_llguidance(backend) -> None:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(backend.to_str(), eos_token=EOS)
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(object_schema(50)))
    matcher_s = time.perf_counter() - start
    mask = allocate_token_bitmask(1, tokenizer.vocab_size)
    start = time.perf_counter()
    for _ in range(20):
        fill_next_token_bitmask(matcher, mask, 0)
    print(json.dumps(dict(what="llguidance", vocab=tokenizer.vocab_size, tokenizer_setup_s=round(setup_s, 2),
                          schema_fields=50, matcher_ms=round(matcher_s * 1e3, 1), error=matcher.get_error(),
                          mask_us=round((time.perf_counter() - start) / 20 * 1e6, 1),
                          allowed_first=int(np.unpackbits(mask.view(np.uint8), bitorder="little").sum()))))


def probe_outlines(backend) -> None:
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    tokens: dict[str, list[int]] = {}
    for text, token_id in backend.get_vocab().items():
        if token_id != EOS:
            tokens.setdefault(text, []).append(token_id)
    vocabulary = Vocabulary(EOS, tokens)
    for kind, pattern in [("choice", "(yes|no|maybe)"), ("regex", r"[0-9]{3}-[0-9]{4}"),
                          ("schema_5_fields", build_regex_from_schema(object_schema(5)))]:
        start = time.perf_counter()
        transitions = Index(pattern, vocabulary).get_transitions()
        print(json.dumps(dict(what="outlines_core", kind=kind, compile_s=round(time.perf_counter() - start, 3),
                              states=len(transitions), transitions=sum(map(len, transitions.values())))))


if __name__ == "__main__":
    vocab_backend = smollm2_backend()
    probe_llguidance(vocab_backend)
    probe_outlines(vocab_backend)
