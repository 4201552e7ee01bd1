"""Guided output's cost: a batch of JSON-schema requests against the same batch unconstrained, and the
compile times of a 6-field and a 50-field schema and of `json_object`.

    python tools/bench.py --no-peer guided --batch-size 32 --out-len 96

The prompts are chat requests for one JSON record each. The unconstrained batch generates, row for
row, exactly as many tokens as the constrained one did (EOS ignored, `min_tokens` = `max_tokens` =
that row's length), so both runs have the same shape of work and the ratio of output tokens/s is
the price of the mask alone (plus the host's share of filling the rows). The two alternate twice;
each side's fastest run gives the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from bench_common import emit, exact, fresh_engine, load_llm, step_summary, timed_generate

RECORD = {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["person", "place", "thing"]}, "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["id", "name", "kind", "score", "tags", "active"]}


def wide_schema(fields: int) -> dict:
    """`fields` required fields of mixed kinds (integers, strings, enums, booleans, numbers)."""
    kinds = [{"type": "integer"}, {"type": "string"}, {"enum": ["a", "b", "c"]}, {"type": "boolean"},
             {"type": "number"}]
    properties = {f"field_{i}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": properties, "required": list(properties)}


def bench_guided(args: argparse.Namespace, llm=None) -> None:
    from jaxinfer import SamplingParams
    from jaxinfer.guided.compiler import GuideCompiler
    from jaxinfer.guided.spec import guided_spec

    llm = llm or load_llm(args)
    engine = llm.engine
    cfg = llm.config
    fresh = GuideCompiler(engine.grammar_matchers().tokenizer, engine.guide_compiler()._eos_id,
                          llm.model_config.vocab_size, cfg.guided_max_states, cfg.guided_max_classes,
                          cfg.guided_max_pairs)
    fresh.get(guided_spec({"regex": "a"}))  # builds the outlines vocabulary once, outside the timing
    compiles = {"record_6_fields": {"json_schema": RECORD}, "wide_50_fields": {"json_schema": wide_schema(50)},
                "json_object": {"json_object": True}}
    for name, guided in compiles.items():
        start = time.perf_counter()
        automaton = fresh.get(guided_spec(guided))
        emit(dict(what="guided_compile", schema=name, seconds=round(time.perf_counter() - start, 3),
                  states=automaton.num_states, classes=automaton.num_classes))
    topics = ["a city", "a painter", "a river", "a bicycle", "a teacher", "a mountain", "a cat", "a song"]
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": f"Write one JSON record about {topics[i % 8]} "
                                            f"number {i}, with id, name, kind, score, tags and active."}])
               for i in range(args.batch_size)]
    guided = SamplingParams(max_tokens=args.out_len, temperature=0.0, guided={"json_schema": RECORD})
    fresh_engine(llm, prefix_caching=False).generate([llm.request(p, dataclasses.replace(guided, max_tokens=4))
                                                      for p in prompts])
    rates: dict[str, list[float]] = {}
    lengths: list[int] = []
    for constrained in (True, False, True, False):
        engine = fresh_engine(llm, prefix_caching=False)
        params = [guided] * len(prompts) if constrained else [exact(n) for n in lengths]
        seconds, outputs = timed_generate(engine, [llm.request(p, q) for p, q in zip(prompts, params, strict=True)])
        if constrained:
            lengths = [len(o.token_ids) for o in outputs]
            valid = sum(_parses(o.text) for o in outputs)
        new = sum(len(o.token_ids) for o in outputs)
        name = "json_schema" if constrained else "unconstrained"
        rates.setdefault(name, []).append(new / seconds)
        emit(dict(what="jaxinfer_guided", rows=name, batch=args.batch_size,
                  new_tokens=new, tok_per_s=round(new / seconds, 1), **step_summary(engine),
                  **({"valid_json": valid} if constrained else {})))
    # Noise on a shared machine only ever adds time: each side's fastest run is its figure.
    emit(dict(what="ratio", workload="guided", json_schema_over_unconstrained=round(
        max(rates["json_schema"]) / max(rates["unconstrained"]), 3)))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


DRAFT_CHATS = ["Describe a person as JSON.", "A JSON record of a cat.", "Give me JSON about a teacher.",
               "JSON for a sailor."]
DRAFT_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                 "mood": {"enum": ["glad", "sad"]}}, "required": ["name", "mood"]}


def bench_guided_draft(args: argparse.Namespace) -> None:
    """Speculative decoding of greedy JSON-schema chats with a draft model: proposals accepted when the
    draft proposes under the automaton's mask (what the engine does) and, as the comparison, when it
    proposes unmasked (the propose loop's per-call state switched off for this run only). Both must
    give the output of the engine without a draft."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.engine.sequence import Sequence

    chats = [[{"role": "user", "content": text}] for text in DRAFT_CHATS]
    params = SamplingParams(max_tokens=40, temperature=0.0, guided={"json_schema": DRAFT_SCHEMA})
    expected = [o.token_ids for o in LLM(args.model, args.config).generate_chat(chats, params)]
    llm = LLM(args.model, args.config, draft_model=args.draft_model, num_draft_tokens=args.num_draft_tokens)
    masked = Sequence.guide_row_after
    for name, row_after in (("unmasked", lambda seq, ids: None), ("masked", masked)):
        Sequence.guide_row_after = row_after
        try:
            before = llm.engine.stats.spec_proposed, llm.engine.stats.spec_accepted
            got = [o.token_ids for o in llm.generate_chat(chats, params)]
        finally:
            Sequence.guide_row_after = masked
        proposed, accepted = llm.engine.stats.spec_proposed - before[0], llm.engine.stats.spec_accepted - before[1]
        emit(dict(what="jaxinfer_guided_draft", draft=name, proposed=proposed, accepted=accepted,
                  acceptance=round(accepted / proposed, 3) if proposed else 0.0, same_as_no_draft=got == expected))


def bench_guided_sizes(args: argparse.Namespace) -> None:
    """The size check before a full compile (`GuideCompiler.size_of`): each pattern's states, its bound of
    (state, token) pairs against `engine.guided_max_pairs`, and the check's own time."""
    from jaxinfer import LLM
    from jaxinfer.guided.compiler import regex_of
    from jaxinfer.guided.spec import guided_spec

    llm = LLM(args.model, args.config)
    compiler = llm.engine.guide_compiler()
    compiler.get(guided_spec({"regex": "a"}))  # builds the outlines vocabulary once, outside the timing
    cases = {"record_6_fields": {"json_schema": RECORD}, "wide_50_fields": {"json_schema": wide_schema(50)},
             "json_object": {"json_object": True}, "letters_4000": {"regex": "[a-z]{4000}"}}
    for name, guided in cases.items():
        spec = guided_spec(guided)
        start = time.perf_counter()
        states, bound = compiler.size_of(spec, regex_of(spec))
        emit(dict(what="guided_size", pattern=name, states=states, pair_bound=bound,
                  within_limits=states <= compiler.max_states and bound <= compiler.max_pairs,
                  seconds=round(time.perf_counter() - start, 3)))
