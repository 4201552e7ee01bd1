"""The engine on the real SmolLM2: paging, batching, preemption, stops, seeds, compile guard, validation."""

from __future__ import annotations

import random
import re

import jax
import jax.numpy as jnp
import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.params import Request
from jaxinfer.engine.xla_compiles import XLA_COMPILES
from jaxinfer.errors import CompileAfterWarmupError, RequestError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven bright stars shine above quiet hills"
).split()


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def alone(smollm2_llm):
    """Greedy output of each prompt run by itself (the reference for batched runs)."""
    return {p: smollm2_llm.generate([p], GREEDY)[0].token_ids for p in prompts(6)}


def test_batched_prompts_of_different_lengths_match_each_alone(smollm2_llm, alone):
    texts = list(alone)
    lengths = [len(smollm2_llm.encode(t)) for t in texts]
    assert max(lengths) > 5 * smollm2_llm.config.page_size  # sequences span many pages
    outputs = smollm2_llm.generate(texts, GREEDY)
    assert [o.token_ids for o in outputs] == [alone[t] for t in texts]
    assert [o.usage.prompt_tokens for o in outputs] == lengths


def test_preemption_keeps_outputs_and_frees_every_page(smollm2_llm, alone):
    texts = list(alone)
    # A pool that holds about two sequences at once forces preemption and recomputation.
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, prefix_caching=False)
    with engine.pool.hold(keep_free=21):
        outputs = engine.generate([smollm2_llm.request(t, GREEDY) for t in texts])
    assert engine.stats.preemptions > 0
    assert [o.token_ids for o in outputs] == [alone[t] for t in texts]
    assert engine.pool.num_free == engine.pool.capacity


def test_no_compile_after_warmup_across_random_workload(smollm2_llm):
    compiles: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if "compile" in event and "backend" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    before = smollm2_llm.runner.num_compiles
    rng = random.Random(1)
    texts = [*prompts(10, seed=2), " ".join(WORDS * 8)]  # one prompt longer than the largest bucket
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 10),
            temperature=rng.choice([0.0, 0.7]),
            top_k=rng.choice([0, 5]),
            seed=rng.randint(0, 99),
        )
        for _ in texts
    ]
    smollm2_llm.generate(texts, params)
    assert smollm2_llm.runner.num_compiles == before
    assert smollm2_llm.runner.compiles_after_warmup == 0
    assert compiles == []


def test_steps_copy_host_arrays_to_the_device_only_explicitly(smollm2_llm, alone):
    """A step sends its inputs in one `device_put` and fetches its ids with `device_get`: no numpy array
    or Python scalar reaches a compiled program implicitly, where it would be a hidden copy and sync.
    The CPU platform guards copies to the device; an accelerator guards both directions."""
    texts = list(alone)
    sampled = [SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=5),
               SamplingParams(max_tokens=8, temperature=0.7, top_k=5, min_p=0.05, seed=1, logprobs=True)]
    params = [GREEDY, *sampled] * (len(texts) // 3)
    expected = [o.token_ids for o in smollm2_llm.generate(texts, params)]
    engine = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len)
    with jax.transfer_guard("disallow"):
        cached = smollm2_llm.generate(texts, params)  # the prompts' pages now come from the prefix cache
        with engine.pool.hold(keep_free=21):  # and here sequences are preempted and recomputed
            preempted = engine.generate([smollm2_llm.request(t, p) for t, p in zip(texts, params, strict=True)])
    assert [o.token_ids for o in cached] == expected and sum(o.usage.cached_tokens for o in cached) > 0
    assert [o.token_ids for o in preempted] == expected and engine.stats.preemptions > 0
    assert engine.pool.num_free == engine.pool.capacity


def test_the_step_traces_one_decoder_layer_and_calls_it_for_every_layer(smollm2_llm):
    """Tracing each of the 30 layers in turn was most of the time an engine start spent lowering its
    steps; the lowered step holds one layer function, called once per layer."""
    runner = smollm2_llm.runner
    bucket = smollm2_llm.config.token_buckets[-1]
    text = runner._jitted.lower(runner.graphdef, runner.state, runner.caches, runner.penalty_counts, runner.no_tokens,
                                runner.abstract_inputs(bucket), runner.guide_tables, *runner._exec_args()).as_text()
    assert len(re.findall(r"func\.func private @_run_layer\(", text)) == 1
    assert len(re.findall(r"call @_run_layer\(", text)) == smollm2_llm.model_config.num_layers


def test_the_xla_compile_counter_sees_a_new_program():
    """The counter behind every "no compile after warm-up" check must see compiles at all."""
    mark = XLA_COMPILES.mark()
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(13)).block_until_ready()  # a new function: compiled (or cache-loaded)
    assert XLA_COMPILES.since(mark) >= 1


def test_compile_guard_raises_for_an_unwarmed_bucket(smollm2_llm):
    runner = smollm2_llm.runner
    executable = runner._executables.pop(64)
    try:
        with pytest.raises(CompileAfterWarmupError):
            # A prompt no earlier test used: the prefix cache must not shrink it below 64 tokens.
            smollm2_llm.generate([" ".join(reversed(WORDS * 3))], GREEDY)
    finally:
        runner._executables[64] = executable
        runner.compiles_after_warmup = 0
    assert smollm2_llm.engine.pool.num_free == smollm2_llm.engine.pool.capacity


def test_finish_reasons_and_usage(smollm2_llm):
    chat = [{"role": "user", "content": "Say OK."}]
    short = smollm2_llm.generate_chat(chat, SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    full = smollm2_llm.generate_chat(chat, SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert full.finish_reason == "stop"
    assert full.token_ids[-1] in smollm2_llm.tokenizer.eos_ids
    assert full.usage.completion_tokens == len(full.token_ids)
    assert "<|im_end|>" not in full.text
    ignoring = smollm2_llm.generate_chat(
        chat, SamplingParams(max_tokens=len(full.token_ids) + 3, temperature=0.0, ignore_eos=True)
    )[0]
    assert ignoring.finish_reason == "length"
    assert ignoring.token_ids[: len(full.token_ids)] == full.token_ids


def test_stop_string_spanning_tokens_is_cut(smollm2_llm):
    prompt = "The history of the Roman Empire"
    free = smollm2_llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    pieces = [smollm2_llm.tokenizer.decode(free.token_ids[:i]) for i in range(len(free.token_ids) + 1)]
    # A stop string made of the last 3 characters of the first 6 tokens and the next 3 characters.
    boundary = len(pieces[6])
    stop = free.text[boundary - 3 : boundary + 3]
    assert len(stop) == 6 and free.text.find(stop) == boundary - 3
    completing = next(i for i, piece in enumerate(pieces) if stop in piece)  # the token that completes it
    assert completing > 6
    stopped = smollm2_llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: boundary - 3]
    assert stopped.token_ids == free.token_ids[:completing]


def test_seeded_sampling_is_reproducible_and_batch_independent(smollm2_llm):
    prompt = "Once upon a time"
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    alone = smollm2_llm.generate([prompt], seeded)[0].token_ids
    mixed = smollm2_llm.generate([*prompts(3, seed=9), prompt], [GREEDY] * 3 + [seeded])[-1].token_ids
    assert alone == mixed
    others = {
        tuple(smollm2_llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=s))[0].token_ids)
        for s in range(3)
    }
    assert len(others) > 1  # different seeds really sample differently
    top1 = smollm2_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, top_k=1, seed=5))[0]
    assert top1.token_ids == smollm2_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids


def test_logprobs_are_returned_on_request(smollm2_llm):
    out = smollm2_llm.generate(["Hello"], SamplingParams(max_tokens=5, temperature=0.0, logprobs=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    assert all(lp <= 0.0 for lp in out.logprobs)
    assert smollm2_llm.generate(["Hello"], SamplingParams(max_tokens=2))[0].logprobs is None


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([1, 2, 10**6], SamplingParams(), r"prompt_token_ids\[2\]: 1000000 is outside the vocabulary"),
        ("word " * 5000, SamplingParams(), "prompt"),
        ("Hi \ud800", SamplingParams(), r"prompt: an unpaired surrogate '\\ud800' at character 3"),
        (["Hi", "there \udfff"], SamplingParams(), r"prompt\[1\]: an unpaired surrogate"),
        ("hi", SamplingParams(max_tokens=10**6), "max_tokens"),
        ([1] * 4100, SamplingParams(max_tokens=1), r"prompt: 4100 tokens and one generated need 513 KV pages of 8 "
                                                   r"tokens, the pool has 511"),
        ("hi", SamplingParams(stop_token_ids=[10**9]), r"stop_token_ids\[0\]: 1000000000 is outside the vocabulary"),
    ],
)
def test_invalid_requests_name_the_field(smollm2_llm, prompt, params, field):
    with pytest.raises(RequestError, match=field):
        smollm2_llm.generate([prompt], params)
    assert smollm2_llm.engine.pool.num_free == smollm2_llm.engine.pool.capacity


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"prompt_ids": [1, 2.7]}, r"prompt_token_ids\[1\]: must be an integer token id, got 2.7"),
        ({"prompt_ids": [True]}, r"prompt_token_ids\[0\]: must be an integer token id, got True"),
        ({"prompt_ids": [1, "5"]}, r"prompt_token_ids\[1\]: must be an integer token id, got '5'"),
        ({"prompt_ids": [1, None]}, r"prompt_token_ids\[1\]: must be an integer token id, got None"),
        ({"generated_ids": [1.5]}, r"generated_ids\[0\]: must be an integer token id"),
        ({"generated_ids": [5], "generated_logprobs": [float("nan")]}, r"generated_logprobs\[0\]: must be a log-prob"),
        ({"generated_ids": [5], "generated_logprobs": [0.5]}, r"generated_logprobs\[0\]: must be a log-prob"),
    ],
)
def test_engine_requests_with_malformed_ids_name_the_field(smollm2_llm, request_fields, message):
    """Requests built by hand (the Python API, a decode worker's handoff) reach the engine without the
    LLM's encoding: a float, bool, string or None id is refused by name, not truncated or crashed on."""
    fields = {"prompt_ids": [1, 2, 3], "params": SamplingParams(max_tokens=4), **request_fields}
    with pytest.raises(RequestError, match=message):
        smollm2_llm.engine.generate([Request(**fields)])
    assert smollm2_llm.engine.pool.num_free == smollm2_llm.engine.pool.capacity


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"exec": "false"}, "exec: must be true or false"),  # a truthy string would turn programs on
        ({"ignore_eos": 1}, "ignore_eos: must be true or false"),
        ({"logprobs": None}, "logprobs: must be true or false"),
        ({"stop": {"a": 1}}, "stop: must be a list, got dict"),
        ({"stop": None}, "stop: must be a list, got NoneType"),
        ({"stop_token_ids": 5}, "stop_token_ids: must be a list"),
        ({"exec_files": "data.txt"}, "exec_files: must be a list, got str"),  # not 8 one-letter paths
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kwargs)


def test_min_tokens_holds_back_eos_and_stop_ids(smollm2_llm):
    prompt = "The capital of France is"
    first = smollm2_llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    held = smollm2_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, min_tokens=3,
                                                         stop_token_ids=[first]))[0]
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3
    stopped = smollm2_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[first]))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def test_huge_top_k_is_clamped_to_the_vocabulary(smollm2_llm):
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=2**31 - 1, seed=4)
    assert len(smollm2_llm.generate(["Hi"], params)[0].token_ids) == 3
    with pytest.raises(RequestError, match="top_k"):
        SamplingParams(top_k=2**31)


def test_a_vocabulary_smaller_than_the_alternatives_gets_all_its_ids():
    """The step computes min(20, vocab) alternatives: a 12-id model starts, and a row asking for all 12
    gets the whole distribution, most likely first."""
    import numpy as np

    from jaxinfer.config import EngineConfig, ModelConfig
    from jaxinfer.engine.step import ModelRunner
    from jaxinfer.parallel import make_mesh
    from jaxinfer.weights.loader import random_model

    cfg = ModelConfig(architecture="llama", vocab_size=12, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    runner = ModelRunner(random_model(cfg, mesh, jnp.float32, seed=3), cfg,
                         EngineConfig(token_buckets=(8,), max_seqs=2, page_size=8, num_pages=4, dtype="float32"), mesh)
    batch = runner.empty_batch(8)
    batch.tokens[:3], batch.positions[:3] = [1, 5, 7], [0, 1, 2]
    batch.page_table[0, 0] = 1
    batch.write_slots[:3] = 8 + batch.positions[:3]
    batch.seq_rows[3:] = 0
    batch.logits_rows[0], batch.top_logprobs[0] = 2, 12
    result = runner.dispatch(batch)
    (token, *_), (logprob, *_) = result.fetch()
    ids, values = (a[0] for a in result.fetch_top())
    assert sorted(ids.tolist()) == list(range(12)) and (np.diff(values) <= 0).all()
    assert abs(np.exp(values).sum() - 1) < 1e-5 and ids[0] == token and abs(values[0] - logprob) < 1e-6
    # Scored prompt positions likewise: position 1 asks for all 12 ids and scores the id at position 2.
    batch.prompt_targets[1], batch.prompt_alternatives[1] = 7, 12
    result = runner.dispatch(batch)
    result.fetch()
    scores, top_ids, top_values = (a[1] for a in result.fetch_prompt())
    assert sorted(top_ids.tolist()) == list(range(12)) and abs(np.exp(top_values).sum() - 1) < 1e-5
    assert abs(scores - top_values[top_ids.tolist().index(7)]) < 1e-6
