"""The step-wise engine API: requests added between steps, and cancellation mid-prefill and mid-decode."""

from __future__ import annotations

from jaxinfer import SamplingParams
from jaxinfer.engine.engine import Engine

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def test_cancel_mid_prefill_and_mid_decode_frees_pages_and_spares_the_others(smollm2_llm):
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, prefix_caching=False)
    free_before = engine.pool.num_free
    texts = ["Describe a sunrise over the mountains. " * 12, "Name three rivers.", "What is a prime number?"]
    reference = [smollm2_llm.generate([t], GREEDY)[0].token_ids for t in texts]
    long_prefill, decoding, survivor = (engine.add_request(smollm2_llm.request(t, GREEDY)) for t in texts)
    engine.step()  # 64-token budget: the long prompt is still prefilling, the short ones are in flight
    assert 0 < long_prefill.num_computed < len(long_prefill.prompt_ids)
    cancelled = engine.abort(long_prefill.index)
    assert cancelled.finish_reason == "abort" and long_prefill.pages == []
    while not decoding.output_ids:
        engine.step()
    assert engine.abort(decoding.index).finish_reason == "abort"
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert [o.token_ids for o in finished] == [reference[2]]
    assert engine.abort(survivor.index) is None  # already finished: nothing to cancel
    assert engine.pool.num_free == free_before and engine.stats.aborted == 2


def test_requests_added_between_steps_match_each_run_alone(smollm2_llm):
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len)
    texts = [f"Give me a word that rhymes with {w}." for w in ("cat", "tree", "light", "moon")]
    reference = {t: smollm2_llm.generate([t], GREEDY)[0].token_ids for t in texts}
    index_of, outputs = {}, {}
    for text in texts:  # one new arrival per step, while the earlier ones decode
        index_of[engine.add_request(smollm2_llm.request(text, GREEDY)).index] = text
        outputs.update({o.index: o for o in engine.step()})
    while engine.has_unfinished():
        outputs.update({o.index: o for o in engine.step()})
    assert {index_of[i]: o.token_ids for i, o in outputs.items()} == reference
