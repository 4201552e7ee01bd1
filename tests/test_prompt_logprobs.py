"""Prompt logprobs: each prompt token scored once, whatever the batching, overlap, cache or preemption.

The scores themselves are checked against transformers in test_smollm2_hf.py; here one engine's
scores, computed alone with nothing cached, are the reference for every other way of running."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.errors import RequestError

LONG = "the cat sat on the mat and " * 24  # 169 tokens: prefilled in three chunks of the 64-token bucket
TEXTS = [LONG, "What is the capital of France, and what river runs through it?",
         "one two three four five six seven eight nine ten eleven twelve", "Name three colours of the rainbow."]
PARAMS = [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3),
          SamplingParams(max_tokens=6, temperature=0.8, seed=2, prompt_logprobs=0),
          SamplingParams(max_tokens=5, temperature=0.0),  # not scored, between rows that are
          SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1)]


def alone(llm, texts=TEXTS, params=PARAMS):
    """Each request on its own engine step loop, without overlap or a prefix cache."""
    engine = Engine(llm.runner, llm.tokenizer, llm.max_model_len, prefix_caching=False, async_scheduling=False)
    return [engine.generate([llm.request(t, p)])[0] for t, p in zip(texts, params, strict=True)]


def assert_same_scores(outputs, expected):
    for out, ref in zip(outputs, expected, strict=True):
        assert out.token_ids == ref.token_ids
        if ref.prompt_logprobs is None:
            assert out.prompt_logprobs is None and out.prompt_top_logprobs is None
            continue
        assert out.prompt_logprobs[0] is None and None not in out.prompt_logprobs[1:]
        np.testing.assert_allclose(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], atol=2e-5)
        if ref.prompt_top_logprobs is None:
            assert out.prompt_top_logprobs is None
            continue
        assert [[t for t, _ in top] for top in out.prompt_top_logprobs] == \
            [[t for t, _ in top] for top in ref.prompt_top_logprobs]
        for top, ref_top in zip(out.prompt_top_logprobs[1:], ref.prompt_top_logprobs[1:], strict=True):
            np.testing.assert_allclose([v for _, v in top], [v for _, v in ref_top], atol=2e-5)


@pytest.fixture(scope="module")
def reference(smollm2_llm):
    return alone(smollm2_llm)


def test_every_prompt_token_is_scored_with_its_alternatives(reference):
    for out, p in zip(reference, PARAMS, strict=True):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert out.prompt_logprobs[0] is None and all(v <= 0 for v in out.prompt_logprobs[1:])
        if p.prompt_logprobs == 0:
            assert out.prompt_top_logprobs is None
            continue
        assert out.prompt_top_logprobs[0] == [] and all(len(top) == p.prompt_logprobs
                                                        for top in out.prompt_top_logprobs[1:])
        for token, value, top in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], out.prompt_top_logprobs[1:],
                                     strict=True):
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True) and value <= values[0] + 1e-6
            if token in [t for t, _ in top]:
                assert abs(dict(top)[token] - value) < 1e-5  # the same logits scored both ways


def test_scores_are_the_same_batched_and_overlapped(smollm2_llm, reference):
    assert_same_scores(smollm2_llm.generate(TEXTS, PARAMS), reference)


def test_a_scored_prompt_is_computed_not_taken_from_the_prefix_cache(smollm2_llm, reference):
    """The prompts' pages are cached by an unscored run first: the scored requests compute theirs
    anyway (a cached page is not computed, so it could not be scored); the unscored one reuses them."""
    smollm2_llm.generate(TEXTS, SamplingParams(max_tokens=1, temperature=0.0))
    outputs = smollm2_llm.generate(TEXTS, PARAMS)
    assert_same_scores(outputs, reference)
    assert outputs[2].usage.cached_tokens > 0
    assert all(out.usage.cached_tokens == 0 for out, p in zip(outputs, PARAMS, strict=True)
               if p.prompt_logprobs is not None)
    again = smollm2_llm.generate(TEXTS[1:3], SamplingParams(max_tokens=1, temperature=0.0))
    assert all(out.usage.cached_tokens > 0 for out in again)  # the scored prompts' pages were published


def test_a_sequence_preempted_mid_prompt_scores_each_position_once(smollm2_llm):
    """Decoding sequences take the pool's pages from the newest, a long scored prompt still being
    prefilled: it is preempted with part of its prompt scored, and later takes cached pages only as
    far as it was scored."""
    short = ["one two three", "Hello there", "a b c"]
    decode = SamplingParams(max_tokens=40, temperature=0.0)
    expected = alone(smollm2_llm, [*short, LONG], [decode] * 3 + [PARAMS[0]])
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len)
    victims, preempt = [], engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (victims.append((seq.scoring_prompt, seq.prompt_scored)), preempt(seq))
    outputs: dict[int, object] = {}
    with engine.pool.hold(keep_free=24):  # 192 tokens: the long prompt fits alone, not beside the others
        indices = [engine.add_request(smollm2_llm.request(t, decode)).index for t in short]
        engine.step()
        engine.step()
        indices.append(engine.add_request(smollm2_llm.request(LONG, PARAMS[0])).index)
        while engine.has_unfinished():
            outputs.update((out.index, out) for out in engine.step())
    assert any(scoring and scored > 0 for scoring, scored in victims), victims
    assert_same_scores([outputs[i] for i in indices], expected)


def test_a_discarded_step_has_its_positions_scored_again(smollm2_llm, reference):
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len)
    seq = engine.add_request(smollm2_llm.request(LONG, PARAMS[0]))
    engine.step()
    engine.step()  # the second chunk in flight, the first read back
    assert 0 < sum(v is not None for v in seq.prompt_logprobs) < seq.prompt_scored
    engine.discard_inflight()
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert_same_scores(outputs, reference[:1])


def test_an_aborted_request_returns_the_positions_scored_so_far(smollm2_llm, reference):
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, async_scheduling=False)
    free = engine.pool.num_free
    seq = engine.add_request(smollm2_llm.request(LONG, PARAMS[0]))
    engine.step()
    out = engine.abort(seq.index)
    scored = [v for v in out.prompt_logprobs if v is not None]
    assert 0 < len(scored) < len(out.prompt_token_ids) - 1 and out.prompt_logprobs[-1] is None
    np.testing.assert_allclose(scored, reference[0].prompt_logprobs[1 : 1 + len(scored)], atol=2e-5)
    assert not engine._scoring and engine.pool.num_free == free


def test_a_one_token_prompt_has_nothing_to_score(smollm2_llm):
    (out,) = smollm2_llm.generate([smollm2_llm.encode("Hi")[:1]], SamplingParams(max_tokens=2, prompt_logprobs=2))
    assert out.prompt_logprobs == [None] and out.prompt_top_logprobs == [[]]


@pytest.mark.parametrize(("value", "message"), [
    (-1, r"prompt_logprobs: must be in \[0, 20\], got -1"),
    (21, r"prompt_logprobs: must be in \[0, 20\], got 21"),
    (1.5, "prompt_logprobs: must be an integer, got 1.5"),
    (True, "prompt_logprobs: must be an integer, got True"),
])
def test_out_of_range_prompt_logprobs_name_the_field_and_the_limit(value, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(prompt_logprobs=value)


def test_blocks_of_a_large_bucket_score_as_one_log_softmax():
    """300 tokens: three 128-token blocks, the last padded; positions asked in two of them, alternatives
    in one; the rest zeros."""
    import jax.numpy as jnp

    from jaxinfer.engine.prompt_logprobs import PromptScoring, score_prompt

    rng = np.random.default_rng(0)
    hidden, head = rng.normal(size=(300, 16)).astype(np.float32), rng.normal(size=(16, 40)).astype(np.float32)
    targets, alternatives = np.full(300, -1, np.int32), np.zeros(300, np.int32)
    targets[5:20], targets[250:299] = rng.integers(0, 40, 15), rng.integers(0, 40, 49)
    alternatives[260:270] = 3
    values, ids, top = score_prompt(lambda h, a: h @ head, jnp.asarray(hidden), jnp.zeros(300, jnp.int32),
                                    PromptScoring(jnp.asarray(targets), jnp.asarray(alternatives)), 6)
    logits = hidden @ head
    reference = logits - logits.max(-1, keepdims=True)
    reference -= np.log(np.exp(reference).sum(-1, keepdims=True))
    asked = targets >= 0
    np.testing.assert_allclose(np.asarray(values)[asked], reference[asked, targets[asked]], atol=1e-5)
    assert not np.asarray(values)[~asked].any()
    np.testing.assert_array_equal(np.asarray(ids)[260:270], np.argsort(-reference[260:270], axis=-1)[:, :6])
    np.testing.assert_allclose(np.asarray(top)[260:270], -np.sort(-reference[260:270], axis=-1)[:, :6], atol=1e-5)
    assert not np.asarray(ids)[:128].any()  # a block that asks for no alternatives computes none


def test_a_peer_reply_without_whole_scores_leaves_the_scoring_to_the_decode_worker():
    """A prefill peer built before prompt_logprobs sends none: the hand-off then carries no scores (the
    decode worker scores the prompt itself) instead of a list the decode worker would refuse."""
    from serving.convert import prompt_logprobs_from_proto
    from serving.proto.jaxinfer.v1 import inference_pb2 as pb

    whole = pb.PrefillResponse(prompt_logprobs=[-1.0, -2.0], prompt_top_logprobs=[
        pb.TopLogprobs(token_ids=[4], logprobs=[-0.5]), pb.TopLogprobs(token_ids=[9], logprobs=[-0.25])])
    assert prompt_logprobs_from_proto(whole, 1, 3) == ([None, -1.0, -2.0], [[], [(4, -0.5)], [(9, -0.25)]])
    assert prompt_logprobs_from_proto(whole, 0, 3) == ([None, -1.0, -2.0], None)
    assert prompt_logprobs_from_proto(whole, None, 3) == (None, None)
    assert prompt_logprobs_from_proto(pb.PrefillResponse(), 1, 3) == (None, None)  # an older peer
    assert prompt_logprobs_from_proto(pb.PrefillResponse(), 0, 1) == ([None], None)  # nothing to score
    assert prompt_logprobs_from_proto(whole, 1, 4) == (None, None)


def test_a_prefill_workers_scores_are_checked(smollm2_llm):
    """A decode worker's request may carry the prompt as the prefill worker scored it, whole and sound."""
    import dataclasses

    request = smollm2_llm.request(TEXTS[1], PARAMS[1])
    n = len(request.prompt_ids)
    cases = [([None] + [-1.0] * (n - 1), None, ""),
             ([None] + [-1.0] * (n - 2), None, "one entry per prompt token"),
             ([-1.0] * n, None, r"scored_prompt_logprobs\[0\]: must be null"),
             ([None, 0.5] + [-1.0] * (n - 2), None, r"scored_prompt_logprobs\[1\]: must be a log-probability"),
             ([None] + [-1.0] * (n - 1), [[]] * n, "given only with prompt_logprobs")]
    with_top = dataclasses.replace(request, params=dataclasses.replace(PARAMS[1], prompt_logprobs=1))
    good_top = [[]] + [[(7, -0.5)]] * (n - 1)
    for tops, message in [(good_top, ""), ([[(7, -0.5)]] * n, r"scored_prompt_top_logprobs\[0\]: must be empty"),
                          ([[]] + [[(10**6, -0.5)]] * (n - 1), r"scored_prompt_top_logprobs\[1\]: must be 1 \(id"),
                          ([[]] + [[(7, 0.5)]] * (n - 1), r"scored_prompt_top_logprobs\[1\]")]:
        handed = dataclasses.replace(with_top, scored_prompt_logprobs=[None] + [-1.0] * (n - 1),
                                     scored_prompt_top_logprobs=tops)
        if not message:
            smollm2_llm.engine.validate(handed)
            continue
        with pytest.raises(RequestError, match=message):
            smollm2_llm.engine.validate(handed)
    for scores, tops, message in cases:
        handed = dataclasses.replace(request, scored_prompt_logprobs=scores, scored_prompt_top_logprobs=tops)
        if not message:
            smollm2_llm.engine.validate(handed)
            continue
        with pytest.raises(RequestError, match=message):
            smollm2_llm.engine.validate(handed)
    unscored = dataclasses.replace(request, params=PARAMS[2], scored_prompt_logprobs=[None] + [-1.0] * (n - 1))
    with pytest.raises(RequestError, match="given only with prompt_logprobs"):
        smollm2_llm.engine.validate(unscored)
