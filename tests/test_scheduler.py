"""Continuous batching with arrivals spread over steps, overlapped scheduling, and the engine's counters."""

from __future__ import annotations

import random

import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.params import RequestOutput

WORDS = "a river runs past seven old mills where bakers sing about bread and rain in the early light".split()


def workload(llm, n: int, seed: int) -> list:
    """Requests of random lengths (some longer than the largest bucket) and mixed sampling settings."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 5, 20, 40, 90])))
        kind = i % 4
        if kind == 0:
            params = SamplingParams(max_tokens=rng.randint(1, 14), temperature=0.0, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=rng.randint(0, 999))
        elif kind == 2:
            params = SamplingParams(max_tokens=16, temperature=0.0, stop=[" the", "."], min_tokens=2)
        else:
            params = SamplingParams(max_tokens=40, temperature=0.0)  # stops at EOS or length
        requests.append(llm.request(text, params))
    return requests


def drive(engine: Engine, requests: list, seed: int) -> list[RequestOutput]:
    """Adds the requests a few at a time between steps (at random), runs to the end; outputs in request order."""
    rng = random.Random(seed)
    pending, outputs, index_of = list(requests), {}, {}
    while pending or engine.has_unfinished():
        for _ in range(min(len(pending), rng.choice([0, 0, 1, 2]) if engine.has_unfinished() else 1)):
            request = pending.pop(0)
            index_of[engine.add_request(request).index] = len(index_of)
        outputs.update({index_of[o.index]: o for o in engine.step()})
    return [outputs[i] for i in range(len(requests))]


def summary(outputs: list[RequestOutput]) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


@pytest.fixture(scope="module")
def requests(smollm2_llm):
    return workload(smollm2_llm, 16, seed=3)


@pytest.fixture(scope="module")
def alone(smollm2_llm, requests):
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, async_scheduling=False)
    return [summary(engine.generate([r]))[0] for r in requests]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_spread_arrivals_match_each_request_alone(smollm2_llm, requests, alone, overlap):
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, async_scheduling=overlap)
    outputs = drive(engine, requests, seed=5)
    assert summary(outputs) == alone
    assert {o.finish_reason for o in outputs} == {"stop", "length"}
    assert engine.pool.num_free == engine.pool.capacity


def test_overlap_with_preemption_matches_and_frees_every_page(smollm2_llm, requests, alone):
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, prefix_caching=False)
    with engine.pool.hold(keep_free=30):
        outputs = drive(engine, requests, seed=7)
    assert engine.stats.preemptions > 0
    assert summary(outputs) == alone
    assert engine.pool.num_free == engine.pool.capacity
    assert not engine.has_unfinished()


def shared_prefix_workload(llm, n: int, seed: int) -> list:
    """Requests on three system prompts (one or two pages shared, some prompts identical) that end by
    length, by a seeded sample's length, or by a stop string."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(words)) for words in (12, 30, 60)]
    requests = []
    for i in range(n):
        text = rng.choice(systems)
        if rng.random() < 0.6:
            text += " " + " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 8])))
        params = [SamplingParams(max_tokens=rng.randint(1, 16), temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=rng.randint(4, 24), temperature=0.8, seed=i, ignore_eos=True),
                  SamplingParams(max_tokens=16, temperature=0.0, stop=[" the", "."])][i % 3]
        requests.append(llm.request(text, params))
    return requests


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_page_books_stay_sound_under_aborts_preemption_and_shared_prefixes(smollm2_llm, overlap):
    """Random arrivals and aborts (of waiting, preempted, running and finished requests) on a small
    pool with the prefix cache on: after every step and abort each page's references equal its
    holders and no page is lost; the requests not aborted give what they give alone."""
    requests = shared_prefix_workload(smollm2_llm, 14, seed=1)
    reference = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, prefix_caching=False)
    alone = [summary(reference.generate([r]))[0] for r in requests]
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, async_scheduling=overlap)
    rng, pending, outputs, sequences, aborted = random.Random(8), list(range(len(requests))), {}, {}, set()
    with engine.pool.hold(keep_free=24) as held:
        while pending or engine.has_unfinished():
            for _ in range(min(len(pending), rng.choice([0, 1, 2]) if engine.has_unfinished() else 1)):
                number = pending.pop(0)
                sequences[number] = engine.add_request(requests[number])
            if sequences and rng.random() < 0.3:
                number = rng.choice(sorted(sequences))
                if engine.abort(sequences[number].index) is not None:
                    aborted.add(number)
                assert engine.scheduler.accounting_errors(held) == []
            by_index = {seq.index: number for number, seq in sequences.items()}
            for output in engine.step():
                number = by_index[output.index]
                assert number not in outputs, "one output per request"
                outputs[number] = output
            assert engine.scheduler.accounting_errors(held) == []
    assert engine.stats.preemptions > 0 and aborted and engine.stats.prefix_hit_tokens > 0
    assert engine.pool.num_free == engine.pool.capacity and engine.scheduler.accounting_errors() == []
    for number, output in outputs.items():
        if number not in aborted:
            assert summary([output])[0] == alone[number], number


def test_overlap_reads_a_step_back_only_after_dispatching_the_next(smollm2_llm):
    request = smollm2_llm.request("Say hi.", SamplingParams(max_tokens=1, temperature=0.0))
    serial = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, async_scheduling=False)
    serial.add_request(request)
    assert [o.finish_reason for o in serial.step()] == ["length"]  # read back in the same call

    overlapped = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len)
    seq = overlapped.add_request(request)
    assert overlapped.step() == []  # dispatched; its id is still on the device
    assert seq.inflight == 1 and seq.output_ids == [] and overlapped.has_unfinished()
    (out,) = overlapped.step()  # nothing left to schedule: reads the step back
    assert out.token_ids == serial.generate([request])[0].token_ids
    assert seq.inflight == 0 and not overlapped.has_unfinished()


def test_a_stop_found_late_discards_the_overlapped_sample(smollm2_llm):
    free = smollm2_llm.generate(["Count: one, two,"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    stop = smollm2_llm.tokenizer.decode(free.token_ids[2:3])
    assert stop.strip()
    params = SamplingParams(max_tokens=8, temperature=0.0, stop=[stop])
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len)
    (out,) = engine.generate([smollm2_llm.request("Count: one, two,", params)])
    assert out.finish_reason == "stop" and stop not in out.text
    assert engine.stats.discarded_samples == 1  # the step after the stop had already been dispatched
    assert engine.pool.num_free == engine.pool.capacity


def test_metrics_report_queues_pages_prefix_hits_and_step_times(smollm2_llm):
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len)
    system = " ".join(WORDS * 3)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([smollm2_llm.request(system + " first", params)])
    for tail in ("second", "third", "fourth"):
        engine.add_request(smollm2_llm.request(system + " " + tail, params))
    engine.step()
    during = engine.metrics()
    assert during["running"] + during["waiting"] == 3 and during["running"] >= 1
    assert during["free_pages"] < during["total_pages"]
    while engine.has_unfinished():
        engine.step()
    after = engine.metrics()
    assert after["running"] == after["waiting"] == 0 and after["free_pages"] == after["total_pages"]
    page = smollm2_llm.config.page_size
    assert after["prefix_hit_tokens"] >= 3 * (len(smollm2_llm.encode(system)) // page - 1) * page
    assert 0 < after["prefix_hit_rate"] < 1
    assert after["tokens_per_step"] == after["tokens_scheduled"] / after["steps"]
    assert 0 < after["host_ms_per_step"] <= after["step_ms"] and 0 < after["host_fraction"] <= 1


def test_an_error_inside_generate_spares_requests_added_step_by_step(smollm2_llm):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    other = smollm2_llm.request("Describe the sea in one sentence.", params)
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len)
    want = engine.generate([other])[0].token_ids
    engine.add_request(other)
    engine.step()
    engine.step()  # `other` is decoding, with an id in flight

    def failing_callback(out: RequestOutput) -> None:
        raise RuntimeError("the caller's callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        engine.generate([smollm2_llm.request("Hi", SamplingParams(max_tokens=1))], on_finish=failing_callback)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.token_ids for o in outputs] == [want]
    assert engine.pool.num_free == engine.pool.capacity
