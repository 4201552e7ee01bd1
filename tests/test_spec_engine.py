"""Speculative decoding in the engine on the real SmolLM2: a truncated draft (the target's first two
layers) and the target as its own draft; greedy outputs identical to decoding without speculation,
pages given back, per-request switch, confidence pruning, stop strings, cancellation, preemption."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import TEST_ENGINE, engine_toml
from flax import nnx
from test_kv_tiers import evict_everything

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.speculator import refill_groups
from jaxinfer.errors import CheckpointError, RequestError
from jaxinfer.kv.tiers import HostTier, TieredPages
from jaxinfer.weights.draft import save_draft, truncated_weights

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]

CHATS = [[{"role": "user", "content": text}] for text in (
    "What is the capital of France?", "Write a haiku about tides.", "Count from one to ten.",
    "Name three colours of the rainbow.")]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
# The truncated draft and the batch runner's (the same folder) propose this many tokens, so the
# runner's process finds the fixture's programs in the persistent compilation cache.
DRAFT_TOKENS = 2


@pytest.fixture(scope="module")
def draft_folder(smollm2_llm, tmp_path_factory):
    model = nnx.merge(smollm2_llm.runner.graphdef, smollm2_llm.runner.state)
    cfg, weights = truncated_weights(model, smollm2_llm.model_config, num_layers=2)
    folder = tmp_path_factory.mktemp("draft")
    save_draft(folder, cfg, weights, source="smollm2-135m, first 2 layers")
    return folder


@pytest.fixture(scope="module")
def truncated_draft(draft_folder):
    return LLM("smollm2-135m", **TEST_ENGINE, draft_model=str(draft_folder), num_draft_tokens=DRAFT_TOKENS)


def test_a_draft_takes_its_embedding_from_the_target(draft_folder):
    meta = json.loads((draft_folder / "jaxinfer.json").read_text())
    assert meta["from_target"] == ["model.embed_tokens.weight"]
    stored = sum(f.stat().st_size for f in (draft_folder / "state").rglob("*") if f.is_file())
    assert stored < 40e6  # two float32 layers (28 MB); the embedding alone would add 113 MB
    with pytest.raises(CheckpointError, match=re.escape("takes model.embed_tokens.weight from its target model; "
                                                        "load it as engine.draft_model")):
        LLM(str(draft_folder), **TEST_ENGINE)


def test_the_shipped_draft_gives_the_same_greedy_output(smollm2_llm):
    shipped = LLM("smollm2-135m", **TEST_ENGINE, draft_model="smollm2-135m-draft", num_draft_tokens=2)
    expected = [o.token_ids for o in smollm2_llm.generate_chat(CHATS, GREEDY)]
    assert [o.token_ids for o in shipped.generate_chat(CHATS, GREEDY)] == expected
    proposed, accepted = spec_stats(shipped)
    assert proposed > 0 and accepted / proposed > 0.2  # the distilled draft agrees often (2 layers of 30)
    assert shipped.engine.pool.num_free == shipped.engine.pool.capacity


def spec_stats(llm: LLM) -> tuple[int, int]:
    return llm.engine.stats.spec_proposed, llm.engine.stats.spec_accepted


def test_a_truncated_draft_gives_the_same_greedy_output(smollm2_llm, truncated_draft):
    expected = [o.token_ids for o in smollm2_llm.generate_chat(CHATS, GREEDY)]
    proposed0, accepted0 = spec_stats(truncated_draft)
    got = truncated_draft.generate_chat(CHATS, GREEDY)
    assert [o.token_ids for o in got] == expected
    proposed, accepted = (a - b for a, b in zip(spec_stats(truncated_draft), (proposed0, accepted0), strict=True))
    assert 0 < accepted < proposed  # some proposals rejected: their positions were rolled back
    assert truncated_draft.engine.pool.num_free == truncated_draft.engine.pool.capacity
    metrics = truncated_draft.engine.metrics()
    assert 0 < metrics["spec_acceptance_rate"] < 1 and metrics["spec_draft_share"] > 0


def test_speculation_is_off_per_request_and_pruned_by_confidence(smollm2_llm, truncated_draft):
    expected = smollm2_llm.generate_chat(CHATS[:2], GREEDY)
    before = spec_stats(truncated_draft)
    off = truncated_draft.generate_chat(CHATS[:2], SamplingParams(max_tokens=24, temperature=0.0, num_draft_tokens=0))
    assert [o.token_ids for o in off] == [o.token_ids for o in expected] and spec_stats(truncated_draft) == before
    truncated_draft.engine.speculator.confidence = 0.0
    truncated_draft.generate_chat(CHATS[:2], GREEDY)
    unpruned = spec_stats(truncated_draft)[0] - before[0]
    truncated_draft.engine.speculator.confidence = 0.9
    try:
        pruned_out = truncated_draft.generate_chat(CHATS[:2], GREEDY)
    finally:
        truncated_draft.engine.speculator.confidence = 0.0
    pruned = spec_stats(truncated_draft)[0] - before[0] - unpruned
    assert [o.token_ids for o in pruned_out] == [o.token_ids for o in expected]
    assert pruned < unpruned


def test_guided_rows_verify_drafts_against_the_automaton(smollm2_llm, truncated_draft):
    """A proposal the automaton refuses is a rejected one: greedy output is the same as without the draft,
    and sampled rows still parse."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "mood": {"enum": ["glad", "sad"]}}, "required": ["name", "mood"]}
    greedy = [SamplingParams(max_tokens=40, temperature=0.0, guided={"json_schema": schema}),
              SamplingParams(max_tokens=16, temperature=0.0, guided={"regex": "[0-9]{3}-[0-9]{4}"}),
              SamplingParams(max_tokens=24, temperature=0.0)]
    expected = [o.token_ids for o in smollm2_llm.generate_chat(CHATS[:3], greedy)]
    proposed0, accepted0 = spec_stats(truncated_draft)
    assert [o.token_ids for o in truncated_draft.generate_chat(CHATS[:3], greedy)] == expected
    proposed, accepted = (a - b for a, b in zip(spec_stats(truncated_draft), (proposed0, accepted0), strict=True))
    assert 0 < accepted < proposed
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=5, guided={"json_schema": schema})
    for out in truncated_draft.generate_chat(CHATS[:3], sampled):
        assert set(json.loads(out.text)) == {"name", "mood"}
    assert truncated_draft.engine.pool.num_free == truncated_draft.engine.pool.capacity
    assert truncated_draft.runner.guide_slots.users == 0


def test_penalties_and_top_logprobs_are_refused_with_a_draft_model(truncated_draft):
    with pytest.raises(RequestError, match="repetition_penalty: not available with speculative decoding"):
        truncated_draft.generate_chat(CHATS[:1], SamplingParams(max_tokens=4, repetition_penalty=1.2))
    with pytest.raises(RequestError, match="top_logprobs: not available with speculative decoding"):
        truncated_draft.generate_chat(CHATS[:1], SamplingParams(max_tokens=4, logprobs=True, top_logprobs=2))
    with pytest.raises(RequestError, match="prompt_logprobs: not available with speculative decoding"):
        truncated_draft.generate_chat(CHATS[:1], SamplingParams(max_tokens=4, prompt_logprobs=0))
    with pytest.raises(RequestError, match="logit_bias: not available with speculative decoding"):
        truncated_draft.generate_chat(CHATS[:1], SamplingParams(max_tokens=4, logit_bias={5: 1.0}))


def test_stop_strings_cancellation_and_preemption_keep_outputs_and_pages(smollm2_llm, truncated_draft):
    stop = SamplingParams(max_tokens=40, temperature=0.0, stop=["5"])
    assert (truncated_draft.generate_chat(CHATS[2], stop)[0].text
            == smollm2_llm.generate_chat(CHATS[2], stop)[0].text)
    engine = truncated_draft.engine
    seq = engine.add_request(truncated_draft.chat_request(CHATS[1], SamplingParams(max_tokens=64, temperature=0)))
    for _ in range(4):
        engine.step()
    assert seq.num_generated >= 3 and seq.finish_reason is None and len(seq.pages) > 0
    engine.abort(seq.index)  # mid-generation, with pages reserved for proposals
    assert engine.pool.num_free == engine.pool.capacity
    long = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in smollm2_llm.generate_chat(CHATS, long)]
    preempted = engine.stats.preemptions
    with engine.pool.hold(keep_free=24):  # too few pages for all four: some are preempted and recomputed
        got = [o.token_ids for o in truncated_draft.generate_chat(CHATS, long)]
    assert got == expected and engine.stats.preemptions > preempted
    assert engine.pool.num_free == engine.pool.capacity


def test_speculative_rounds_copy_host_arrays_to_the_device_only_explicitly(truncated_draft):
    """Proposals, verification and rejection sampling use explicit copies only (see the engine's
    transfer-guard test): greedy and seeded sampled outputs match an unguarded run."""
    params = [GREEDY, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7)] * 2
    expected = [o.token_ids for o in truncated_draft.generate_chat(CHATS, params)]
    proposed = spec_stats(truncated_draft)[0]
    with jax.transfer_guard("disallow"):
        got = [o.token_ids for o in truncated_draft.generate_chat(CHATS, params)]
    assert got == expected and spec_stats(truncated_draft)[0] > proposed


@pytest.fixture(scope="module")
def self_draft():
    """The target as its own draft. One 8-token bucket: with a 30-layer draft every program is twice
    the target's size."""
    return LLM("smollm2-135m", **{**TEST_ENGINE, "token_buckets": (8,)}, draft_model="smollm2-135m",
               num_draft_tokens=3)


def test_the_target_as_its_own_draft_accepts_every_proposal(smollm2_llm, self_draft):
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    expected = [o.token_ids for o in smollm2_llm.generate_chat(CHATS[:2], greedy)]
    assert [o.token_ids for o in self_draft.generate_chat(CHATS[:2], greedy)] == expected
    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=3)
    self_draft.generate_chat(CHATS[2:], sampled)
    proposed, accepted = spec_stats(self_draft)
    assert proposed > 0 and accepted == proposed


def test_the_draft_computes_its_kv_of_pages_restored_from_host_memory(self_draft):
    """L2 holds the target's KV only. With the draft's own KV of every page wiped after eviction, the
    restored prompt's draft KV is recomputed before the draft reads it: every proposal is accepted."""
    runner = self_draft.runner
    engine = Engine(runner, self_draft.tokenizer, self_draft.max_model_len, tiers=TieredPages(HostTier(64), None))
    try:
        chat = [{"role": "user", "content": "Describe a lighthouse at night."}]  # pages no other test made
        request = self_draft.chat_request(chat, SamplingParams(max_tokens=16, temperature=0.0))
        first = engine.generate([request])[0]
        evict_everything(engine)
        runner.spec.caches = jax.tree.map(lambda c: jax.device_put(jnp.zeros_like(c), c.sharding), runner.spec.caches)
        proposed, accepted = engine.stats.spec_proposed, engine.stats.spec_accepted
        again = engine.generate([request])[0]
    finally:  # the module's other tests use the runner without tiers
        runner.tiers, runner.pool.track_evictions = None, False
    assert again.token_ids == first.token_ids
    restored = engine.stats.prefix_hit_tokens_l2
    assert restored >= 3 * self_draft.config.page_size
    assert engine.stats.spec_proposed > proposed
    assert engine.stats.spec_accepted - accepted == engine.stats.spec_proposed - proposed
    assert engine.stats.spec_draft_refilled_tokens == restored
    assert engine.pool.num_free == engine.pool.capacity and not engine.pool.restored


def test_refill_spans_are_cut_and_grouped_in_order():
    a, b = object(), object()
    spans = [(a, 0, 20), (b, 8, 16), (a, 40, 48)]
    assert refill_groups(spans, tokens=16, rows=2) == [[(a, 0, 16)], [(a, 16, 20), (b, 8, 16)], [(a, 40, 48)]]
    assert refill_groups(spans, tokens=64, rows=8) == [spans]
    assert refill_groups([], tokens=8, rows=1) == []


def test_the_batch_runner_speculates_and_reports_it(smollm2_llm, draft_folder, tmp_path):
    lines = [{"id": i, "messages": chat, "max_tokens": 16} for i, chat in enumerate(CHATS[:2])]
    lines.append({"id": 2, "messages": CHATS[2], "max_tokens": 16, "num_draft_tokens": 0})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "engine.toml").write_text(engine_toml())
    proc = subprocess.run([sys.executable, "-m", "jaxinfer.batch", "--input", str(tmp_path / "in.jsonl"),
                           "--output", str(tmp_path / "out.jsonl"), "--config", str(tmp_path / "engine.toml"),
                           "--draft-model", str(draft_folder), "--num-draft-tokens", str(DRAFT_TOKENS), "--stats-json",
                           str(tmp_path / "stats.json"), "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    expected = smollm2_llm.generate_chat(CHATS[:3], SamplingParams(max_tokens=16, temperature=0.0))
    assert [o["token_ids"] for o in outputs] == [e.token_ids for e in expected]
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["spec_proposed"] > 0 and 0 <= stats["spec_accepted"] <= stats["spec_proposed"], stats
    assert stats["xla_compiles_after_warmup"] == 0


def test_admission_keeps_back_only_the_proposals_a_decoding_row_can_get(truncated_draft):
    """A row allowed one proposal (of the engine's DRAFT_TOKENS) keeps one token of the step's budget
    from admission, not DRAFT_TOKENS: the rest goes to a waiting prompt's first chunk."""
    engine = truncated_draft.engine
    one = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, num_draft_tokens=1)
    decoding = engine.add_request(truncated_draft.chat_request(CHATS[0], one))
    engine.step()  # its prompt, whole
    long_prompt = " ".join(f"item {i} of the spare inventory," for i in range(40))
    waiting = engine.add_request(truncated_draft.request(long_prompt, SamplingParams(max_tokens=2)))
    assert waiting.num_tokens > engine.cfg.max_tokens_per_step
    engine.step()
    assert decoding.num_generated >= 2 and waiting.num_computed == engine.cfg.max_tokens_per_step - 2
    engine.abort(decoding.index)
    engine.abort(waiting.index)
    assert engine.pool.num_free == engine.pool.capacity
