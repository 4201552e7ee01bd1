"""Guided (structured) output: outputs that parse and validate, the device mask against
outlines-core's own index, overlap, batching, preemption and prefix reuse, and refusals that name
the field and the limit."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import random
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from outlines_core import Index

from jaxinfer.engine.engine import Engine
from jaxinfer.engine.guide_slots import GuideSlots
from jaxinfer.engine.guide_tables import GuideInputs, constrain, empty_tables
from jaxinfer.engine.params import SamplingParams
from jaxinfer.errors import RequestError
from jaxinfer.guided.compiler import choice_regex, regex_of
from jaxinfer.guided.spec import GuidedSpec, guided_spec
from jaxinfer.guided.vocabulary import token_bytes

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer"},
                                           "city": {"enum": ["Paris", "Oslo", "Lima"]}},
          "required": ["name", "age", "city"]}
PHONE = r"\+?[0-9]{2}-[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral (unsure)"]
PROMPTS = ["Describe a person as JSON.", "Write a phone number:", "Is this review good? 'Loved it!'",
           "Tell me about Oslo.", "The weather today", "Reply with JSON about a teacher:"]


def _constraints() -> list[dict]:
    return [{"json_schema": PERSON}, {"regex": PHONE}, {"choice": CHOICES}]


def _check(guided: dict, text: str) -> None:
    """The output is exactly a value the constraint admits."""
    if "json_schema" in guided:
        jsonschema.validate(json.loads(text), guided["json_schema"])
    elif "regex" in guided:
        assert re.fullmatch(guided["regex"], text), text
    elif "choice" in guided:
        assert text in guided["choice"]
    else:
        assert isinstance(json.loads(text), dict)


def _mixed_params(seed: int) -> list[SamplingParams]:
    """Constrained rows (greedy and sampled) between unconstrained ones."""
    params = []
    for i, guided in enumerate(_constraints() * 2):
        sampled = dict(temperature=1.0, seed=seed + i, top_p=0.95) if i >= 3 else dict(temperature=0.0)
        params.append(SamplingParams(max_tokens=64, guided=guided, **sampled))
        params.append(SamplingParams(max_tokens=12, temperature=0.7, seed=seed + 100 + i))
    return params


@pytest.mark.parametrize("seed", [0, 17])
def test_outputs_parse_and_validate_beside_unconstrained_rows(smollm2_llm, seed):
    params = _mixed_params(seed)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outputs = smollm2_llm.generate(prompts, params)
    for p, out in zip(params, outputs, strict=True):
        if p.guided is not None:
            assert out.finish_reason == "stop", (out.text, out.finish_reason)
            _check(p.guided.to_json(), out.text)
    free = [i for i, p in enumerate(params) if p.guided is None]
    alone = smollm2_llm.generate([prompts[i] for i in free], [params[i] for i in free])
    assert [outputs[i].token_ids for i in free] == [o.token_ids for o in alone]


def test_json_object_is_an_object_and_a_length_cut_says_length(smollm2_llm):
    out = smollm2_llm.generate(PROMPTS[0], SamplingParams(max_tokens=96, temperature=0.0,
                                                          guided={"json_object": True}))[0]
    assert out.finish_reason == "stop"
    _check({"json_object": True}, out.text)
    cut = smollm2_llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0,
                                                          guided={"json_schema": PERSON}))[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    assert cut.text.startswith('{"name"')  # a prefix of a valid value, and said to be one by "length"


ARITHMETIC = """start: expr
expr: term (("+" | "-" | "*") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,3}/
"""
NESTED = 'root ::= "yes" | "no" | "(" root ")"'  # GBNF: balanced parentheses, which no finite automaton matches


def _is_arithmetic(text: str) -> bool:
    """Python's own parser as the independent check: only numbers, + - * and parentheses."""
    tree = ast.parse(text, mode="eval")
    kinds = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    return all(isinstance(node, kinds) for node in ast.walk(tree)) and " " not in text


def _is_nested(text: str) -> bool:
    depth = len(text) - len(text.lstrip("("))
    return text == "(" * depth + text[depth:-depth or None] + ")" * depth and text[depth:len(text) - depth] in (
        "yes", "no")


def test_host_matched_grammars_parse_beside_overlapped_rows(smollm2_llm):
    """Lark and GBNF grammars: each output parses (Python's ast for arithmetic); a host-matched row waits
    out the step that holds its newest id, while the unconstrained rows are in every step (they keep
    overlapping) and are identical to a run without the grammar rows."""
    free = SamplingParams(max_tokens=20, temperature=0.0)
    params = [SamplingParams(max_tokens=24, temperature=0.0, guided={"grammar": ARITHMETIC}), free,
              SamplingParams(max_tokens=12, temperature=0.0, guided={"grammar": NESTED}),
              SamplingParams(max_tokens=24, temperature=0.9, seed=3, guided={"grammar": ARITHMETIC}),
              SamplingParams(max_tokens=20, temperature=0.8, seed=8)]
    prompts = ["Compute: ", "The weather today", "Answer yes or no, in parentheses:", "An expression:",
               "Once upon a time"]
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, prefix_caching=False)
    steps_of: dict[int, list[int]] = {}
    schedule = engine.scheduler.schedule

    def recorded(*args, **kwargs):
        chunks = schedule(*args, **kwargs)
        for chunk in chunks:
            steps_of.setdefault(chunk.seq.index, []).append(engine.stats.steps)
        return chunks

    engine.scheduler.schedule = recorded
    outputs = engine.generate([smollm2_llm.request(t, p) for t, p in zip(prompts, params, strict=True)])
    assert _is_arithmetic(outputs[0].text) and _is_nested(outputs[2].text), (outputs[0].text, outputs[2].text)
    assert outputs[3].finish_reason == "length" or _is_arithmetic(outputs[3].text)
    for i in (1, 4):  # unconstrained: in every step from the first to their last
        steps = steps_of[outputs[i].index]
        assert steps == list(range(steps[0], steps[0] + len(steps))) and len(steps) == 20
    overlapped = steps_of[outputs[1].index][-1]  # until then another row's step was always in flight
    for i in (0, 3):  # host-matched: never in two dispatched steps in a row while overlapping
        steps = [step for step in steps_of[outputs[i].index] if step <= overlapped]
        assert len(steps) > 5 and all(b - a == 2 for a, b in itertools.pairwise(steps))
    alone = smollm2_llm.generate([prompts[i] for i in (1, 4)], [params[i] for i in (1, 4)])
    assert [o.token_ids for o in alone] == [outputs[i].token_ids for i in (1, 4)]
    serial = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, async_scheduling=False)
    again = serial.generate([smollm2_llm.request(t, p) for t, p in zip(prompts, params, strict=True)])
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]
    assert sorted(smollm2_llm.runner.free_mask_rows) == list(range(smollm2_llm.config.guided_host_rows))


def test_device_mask_matches_outlines_index_on_random_walks(smollm2_llm):
    """The tables on the device (token classes, pool rows, the in-flight id applied first) allow exactly
    the ids outlines-core's index allows, EOS exactly in its final states."""
    runner, compiler = smollm2_llm.runner, smollm2_llm.engine.guide_compiler()
    eos = sorted(smollm2_llm.tokenizer.eos_ids)
    mask = jax.jit(lambda tables, inputs, prev: constrain(jnp.zeros((1, runner.model_cfg.vocab_size)), tables,
                                                          inputs, prev))
    rng = random.Random(5)
    for guided in [*_constraints(), {"regex": "(ab|a)*c?"}]:
        spec = guided_spec(guided)
        automaton = compiler.get(spec)
        index = Index(regex_of(spec), compiler._outlines_vocabulary())
        loaded = runner.load_guide(spec.key, automaton)
        try:
            state, outlines_state, newest = 0, index.get_initial_state(), -1
            for _ in range(40):
                prev = np.zeros(runner.cfg.max_seqs, np.int32)
                prev[3] = max(newest, 0)
                inputs = GuideInputs(*(np.array([v], np.int32) for v in (
                    loaded.base + state, loaded.slot, 3 if newest >= 0 else -1, -1)),
                    np.zeros(runner.bitmask_shape, np.int32))
                allowed = np.isfinite(np.asarray(mask(runner.guide_tables, inputs, prev))[0])
                if newest >= 0:
                    state = automaton.next_state(state, newest)
                expected = set(index.get_allowed_tokens(outlines_state)) - set(eos)
                assert set(np.flatnonzero(allowed)) - set(eos) == expected
                assert all(allowed[e] == index.is_final_state(outlines_state) for e in eos)
                if not expected:
                    break
                newest = rng.choice(sorted(expected))
                outlines_state = index.get_next_state(outlines_state, newest)
        finally:
            runner.guide_slots.release(spec.key)


def test_overlap_preemption_and_prefix_reuse_give_the_same_outputs(smollm2_llm):
    """The host's state follows the ids it knows and the device applies the one in flight: outputs do
    not depend on overlap, preemption (recomputed with the newest id in flight) or a prefix-cache hit."""
    runner, tok, max_len = smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len
    params = [SamplingParams(max_tokens=40, temperature=0.0, guided={"json_schema": PERSON}),
              SamplingParams(max_tokens=40, temperature=0.9, seed=4, guided={"regex": PHONE}),
              SamplingParams(max_tokens=40, temperature=0.0),
              SamplingParams(max_tokens=40, temperature=1.0, seed=9, guided={"json_schema": PERSON}),
              SamplingParams(max_tokens=30, temperature=0.0, guided={"grammar": ARITHMETIC})]
    texts = [PROMPTS[0], PROMPTS[1], PROMPTS[4], "the cat sat on the mat and " * 12 + PROMPTS[5], "Compute:"]
    requests = lambda: [smollm2_llm.request(t, p) for t, p in zip(texts, params, strict=True)]  # noqa: E731
    serial = Engine(runner, tok, max_len, prefix_caching=False, async_scheduling=False)
    alone = [serial.generate([request])[0].token_ids for request in requests()]
    overlapped = [o.token_ids for o in Engine(runner, tok, max_len, prefix_caching=True).generate(requests())]
    cached = Engine(runner, tok, max_len, prefix_caching=True).generate(requests())
    engine = Engine(runner, tok, max_len)
    victims, preempt = [], engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (victims.append((seq.guide is not None, seq.inflight)), preempt(seq))
    with engine.pool.hold(keep_free=20):
        preempted = engine.generate(requests())
    assert (True, 1) in victims  # an automaton-constrained sequence was preempted with its newest id in flight
    assert overlapped == alone and [o.token_ids for o in preempted] == alone
    assert [o.token_ids for o in cached] == alone and sum(o.usage.cached_tokens for o in cached) > 0
    assert runner.guide_slots.users == 0 and len(runner.free_mask_rows) == smollm2_llm.config.guided_host_rows


def test_device_bitmask_unpacks_to_the_allowed_ids(smollm2_llm):
    """A host row's packed mask (bit v of word v // 32) allows exactly its ids on the device; an automaton
    row and an unconstrained row in the same batch are masked by their own rules."""
    runner = smollm2_llm.runner
    vocab = runner.model_cfg.vocab_size
    rng = np.random.default_rng(3)
    bitmask = rng.integers(-2**31, 2**31, runner.bitmask_shape, dtype=np.int64).astype(np.int32)
    inputs = GuideInputs(np.array([-1, -1], np.int32), np.zeros(2, np.int32), np.array([-1, -1], np.int32),
                         np.array([2, -1], np.int32), bitmask)
    logits = jnp.zeros((2, vocab))
    allowed = np.isfinite(np.asarray(jax.jit(constrain)(logits, runner.guide_tables, inputs, jnp.zeros(1, jnp.int32))))
    expected = np.unpackbits(bitmask[2].view(np.uint8), bitorder="little")[:vocab].astype(bool)
    assert (allowed[0] == expected).all() and allowed[1].all()


def test_abort_releases_the_grammar(smollm2_llm):
    engine = smollm2_llm.engine
    seq = engine.add_request(smollm2_llm.request(PROMPTS[0], SamplingParams(max_tokens=30, guided={"regex": PHONE})))
    engine.step()
    assert engine.runner.guide_slots.users == 1
    engine.discard_inflight()
    assert engine.abort(seq.index).finish_reason == "abort"
    assert engine.runner.guide_slots.users == 0 and not engine.has_unfinished()


def test_more_grammars_than_slots_wait_and_all_finish(smollm2_llm):
    """Eleven distinct constraints on eight slots: the later ones wait for a slot, unused ones are evicted."""
    choices = [[f"option {i}", f"other {i}"] for i in range(11)]
    params = [SamplingParams(max_tokens=8, temperature=0.0, guided={"choice": c}) for c in choices]
    outputs = smollm2_llm.generate(["Pick one:"] * len(params), params)
    assert [o.text in c for o, c in zip(outputs, choices, strict=True)] == [True] * len(choices)
    assert smollm2_llm.runner.guide_slots.users == 0


@pytest.mark.parametrize(("guided", "message"), [
    ({"regex": "(("}, "guided.regex: "),
    ({"json_schema": {"type": "wat"}}, "guided.json_schema: Unsupported type: wat"),
    ({"json_schema": "{not json"}, "guided.json_schema: not valid JSON"),
    ({"grammar": "start: ("}, "guided.grammar: 1(9): Expected token ')'"),
    ({"grammar": "root ::= [a-"}, "guided.grammar: Failed to convert the grammar from GBNF to Lark"),
    ({"regex": "a", "choice": ["a"]}, "guided: exactly one of"),
    ({"choice": []}, "guided.choice: must be a non-empty list"),
    ({"choice": ["a", ""]}, "guided.choice[1]: must be a non-empty string"),
    ({"json_object": "yes"}, "guided.json_object: must be true"),
    ({"regex": "a" * 70000}, "guided.regex: at most 65536 characters"),
    ("regex", "guided: must be an object"),
])
def test_bad_constraints_are_refused_naming_the_field(smollm2_llm, guided, message):
    with pytest.raises(RequestError) as error:
        smollm2_llm.generate(PROMPTS[0], SamplingParams(guided=guided))
    assert message in str(error.value)


def test_limits_and_combinations_are_refused_and_the_batch_goes_on(smollm2_llm):
    engine = smollm2_llm.engine
    running = engine.add_request(smollm2_llm.request(PROMPTS[4], SamplingParams(max_tokens=6, temperature=0.0)))
    compiler = engine.guide_compiler()
    states, compiler.max_states = compiler.max_states, 20
    try:
        with pytest.raises(RequestError, match=r"guided.json_schema: its automaton has \d+ states, more than "
                                               r"engine.guided_max_states = 20"):
            engine.validate(smollm2_llm.request(PROMPTS[0], SamplingParams(guided={"json_schema": {
                "type": "object", "properties": {"a_long_field_name": {"type": "integer"}}}})))
    finally:
        compiler.max_states = states
    for extra, field in [({"min_tokens": 2}, "min_tokens"), ({"ignore_eos": True}, "ignore_eos")]:
        with pytest.raises(RequestError, match=f"guided: not with .*{field}"):
            engine.validate(smollm2_llm.request(PROMPTS[0], SamplingParams(guided={"regex": "a+"}, **extra)))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.index for o in outputs] == [running.index] and outputs[0].finish_reason == "length"


def test_spec_canonical_forms_and_choice_escaping():
    one = guided_spec({"json_schema": {"b": 1, "a": {"type": "string"}}})
    assert one == guided_spec({"json_schema": '{"b": 1, "a": {"type": "string"}}'})  # property order kept
    assert one.key != guided_spec({"json_schema": {"a": {"type": "string"}, "b": 1}}).key
    assert guided_spec({"choice": ["x"]}).to_json() == {"choice": ["x"]}
    assert guided_spec({"json_object": True}) == GuidedSpec("json_object", "")
    assert guided_spec(None) is None and guided_spec({"regex": None}) is None
    pattern = choice_regex(["a.b", "(c)|d", "e+f*", "$1 ~ x"])
    assert [bool(re.fullmatch(pattern, s)) for s in ["a.b", "(c)|d", "e+f*", "$1 ~ x", "axb", "c"]] == [True] * 4 + [
        False] * 2
    assert dataclasses.replace(SamplingParams(guided={"regex": "a"})).guided == GuidedSpec("regex", "a")


def test_grammar_slots_never_overlap_and_count_their_users():
    """Random claims and releases: placed grammars never share a slot or a pool row, stay inside the
    pool, and a grammar in use is never evicted."""
    rng = random.Random(1)
    for _ in range(500):
        slots = GuideSlots(rng.randint(1, 4), rng.randint(5, 60))
        held: list[str] = []
        for _ in range(30):
            if held and rng.random() < 0.4:
                slots.release(held.pop(rng.randrange(len(held))))
            else:
                key = f"grammar {rng.randint(0, 12)}"
                if slots.use(key) or slots.place(key, rng.randint(1, 20)):
                    held.append(key)
            spans = sorted((g.base, g.base + g.states) for g in slots.loaded.values())
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)) and all(e <= 60 for _, e in spans)
            assert len({g.slot for g in slots.loaded.values()}) == len(slots.loaded) <= slots.grammars
            assert all(g.users == held.count(key) for key, g in slots.loaded.items())
            assert set(held) <= set(slots.loaded)


def test_a_pattern_too_big_to_build_is_refused_before_it_is_built(smollm2_llm):
    with pytest.raises(RequestError, match=r"guided.regex: its automaton could hold [\d,]+ \(state, token\) pairs, "
                                           r"more than engine.guided_max_pairs = 16,000,000"):
        smollm2_llm.engine.validate(smollm2_llm.request("x", SamplingParams(guided={"regex": "[a-z]{4000}"})))


def test_handed_over_ids_must_follow_the_constraint(smollm2_llm):
    request = smollm2_llm.request("x", SamplingParams(guided={"regex": "[0-9]+"}))
    request.generated_ids = smollm2_llm.tokenizer.encode_plain("12a")
    with pytest.raises(RequestError, match=r"generated_ids: .* not accepted by guided\.regex"):
        smollm2_llm.engine.validate(request)
    request = smollm2_llm.request("x", SamplingParams(guided={"grammar": NESTED}))
    request.generated_ids = smollm2_llm.tokenizer.encode_plain("(x")
    with pytest.raises(RequestError, match=r"guided\.grammar: the output so far"):
        smollm2_llm.engine.validate(request)


def test_host_masks_apply_with_the_automata_off():
    """engine.guided_grammars 0 leaves the automaton tables 1 x 1 stand-ins; a host row is still masked."""
    vocab = 70
    tables = jax.tree.map(jnp.asarray, empty_tables(0, 0, 0, 0, [2]))
    bitmask = np.zeros((2, 3), np.int32)
    bitmask[1, 0], bitmask[1, 2] = 1 << 5, 1 << 1  # ids 5 and 65
    inputs = GuideInputs(np.full(2, -1, np.int32), np.zeros(2, np.int32), np.full(2, -1, np.int32),
                         np.array([1, -1], np.int32), bitmask)
    masked = jax.jit(constrain)(jnp.zeros((2, vocab)), tables, inputs, jnp.zeros(1, jnp.int32))
    allowed = np.isfinite(np.asarray(masked))
    assert list(np.flatnonzero(allowed[0])) == [5, 65] and allowed[1].all()


def test_token_bytes_for_byte_level_and_sentencepiece_vocabularies(smollm2_llm):
    from llguidance import LLTokenizer
    from tokenizers import Tokenizer, decoders, models

    smollm2 = token_bytes(smollm2_llm.engine.grammar_matchers().tokenizer())
    assert smollm2[smollm2_llm.tokenizer.token_id("Ġhello")] == b" hello"
    assert smollm2_llm.tokenizer.eos_ids.isdisjoint(smollm2)  # specials are left out
    # Llama 2's layout: SentencePiece pieces with byte fallback, decoded by a Replace/ByteFallback sequence.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xE2>": 3, "▁1": 4, "ab": 5}
    piece = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    piece.add_special_tokens(["<s>", "</s>"])
    piece.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    pieces = token_bytes(LLTokenizer(piece.to_str(), eos_token=2))
    assert pieces == {0: b"<unk>", 3: b"\xe2", 4: b" 1", 5: b"ab"}


def test_an_id_the_constraint_refuses_ends_only_its_request(smollm2_llm):
    """The host's automaton made to disagree with the device's (as an engine bug would): that request
    ends with abort, the one beside it runs to its end, and nothing stays claimed."""
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len)
    broken = engine.add_request(smollm2_llm.request("A number:", SamplingParams(max_tokens=8, temperature=0.0,
                                                                                 guided={"regex": "[0-9]+"})))
    other = engine.add_request(smollm2_llm.request("Hello", SamplingParams(max_tokens=8, temperature=0.0)))
    outputs = {o.index: o for o in engine.step()}  # admitted: the digits' automaton is on the device
    broken.guide = engine.guide_compiler().get(guided_spec({"regex": "[a-z]+"}))  # and letters on the host
    while engine.has_unfinished():
        outputs.update((o.index, o) for o in engine.step())
    assert outputs[broken.index].finish_reason == "abort" and len(outputs[broken.index].token_ids) == 1
    assert engine.stats.guided_requests == 1 and engine.stats.guided_refused_ids == 1
    assert outputs[other.index].finish_reason == "length" and len(outputs[other.index].token_ids) == 8
    assert engine.runner.guide_slots.users == 0 and engine.pool.num_free == engine.pool.capacity
