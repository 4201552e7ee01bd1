"""Repetition, frequency and presence penalties: the device counts, the logits, and the engine.

The logits are checked against transformers' repetition penalty and against OpenAI's definition of
the frequency and presence penalties; the engine's greedy output against transformers' generate()
is in test_smollm2_hf.py."""

from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer import SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.penalties import PROMPT_BIT, PenaltyInputs, count_sampled, load_row, penalize
from jaxinfer.errors import RequestError

VOCAB = 40


def histories(rows: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) per row, with repeats in both."""
    rng = random.Random(seed)
    return [([rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))],
             [rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))]) for _ in range(rows)]


def counts_table(history: list[tuple[list[int], list[int]]], *, load_outputs: bool) -> jnp.ndarray:
    """Row i holds history i: loaded whole, or the prompt loaded and each output counted as a step does."""
    table = jnp.zeros((len(history), VOCAB), jnp.int32)
    width = max(len(p) + len(o) for p, o in history)
    for slot, (prompt, output) in enumerate(history):
        ids = np.full(width, -1, np.int32)
        loaded = prompt + output if load_outputs else prompt
        ids[: len(loaded)] = loaded
        table = load_row(table, jnp.int32(slot), jnp.asarray(ids), jnp.int32(len(prompt)))
    if not load_outputs:
        for step in range(max(len(o) for _, o in history)):
            slots = np.array([slot if step < len(o) else -1 for slot, (_, o) in enumerate(history)], np.int32)
            tokens = np.array([o[step] if step < len(o) else 0 for _, o in history], np.int32)
            table = count_sampled(table, jnp.asarray(slots), jnp.asarray(tokens))
    return table


def test_counts_loaded_whole_equal_counts_added_step_by_step():
    history = histories(6)
    expected = np.zeros((len(history), VOCAB), np.int64)
    for row, (prompt, output) in enumerate(history):
        expected[row, sorted(set(prompt))] = PROMPT_BIT
        np.add.at(expected[row], output, 1)
    np.testing.assert_array_equal(counts_table(history, load_outputs=True), expected)
    np.testing.assert_array_equal(counts_table(history, load_outputs=False), expected)


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    history = histories(8, seed=1)
    penalties = np.array([1.0, 1.2, 0.8, 2.0, 1.5, 1.05, 3.0, 0.5], np.float32)
    logits = np.random.default_rng(0).normal(0, 3, (len(history), VOCAB)).astype(np.float32)
    inputs = PenaltyInputs(jnp.arange(len(history), dtype=jnp.int32), jnp.asarray(penalties),
                           jnp.zeros(len(history)), jnp.zeros(len(history)))
    ours = np.asarray(penalize(jnp.asarray(logits), counts_table(history, load_outputs=False), inputs))
    for row, (prompt, output) in enumerate(history):
        reference = RepetitionPenaltyLogitsProcessor(float(penalties[row]))(
            torch.tensor([prompt + output]), torch.tensor(logits[row : row + 1]))
        np.testing.assert_allclose(ours[row], reference[0].numpy(), rtol=1e-6)


def test_frequency_and_presence_penalties_follow_openai_and_count_only_the_output():
    """OpenAI: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c[j] the times j was generated."""
    history = histories(6, seed=2)
    frequency = np.array([0.0, 0.5, -1.0, 2.0, 1.0, 0.3], np.float32)
    presence = np.array([1.0, 0.0, 0.5, -2.0, 1.5, 0.3], np.float32)
    logits = np.random.default_rng(1).normal(0, 3, (len(history), VOCAB)).astype(np.float32)
    slots = np.array([0, 1, 2, 3, 4, -1], np.int32)  # the last row has no counts: left as it is
    inputs = PenaltyInputs(jnp.asarray(slots), jnp.ones(len(history)), jnp.asarray(frequency), jnp.asarray(presence))
    ours = np.asarray(penalize(jnp.asarray(logits), counts_table(history, load_outputs=True), inputs))
    for row, (_, output) in enumerate(history[:-1]):
        generated = np.bincount(output, minlength=VOCAB)
        expected = logits[row] - generated * frequency[row] - (generated > 0) * presence[row]
        np.testing.assert_allclose(ours[row], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ours[-1], logits[-1])


@pytest.mark.parametrize(("field", "value", "message"), [
    ("repetition_penalty", 0.0, "repetition_penalty: must be in (0.0, 100.0], got 0.0"),
    ("repetition_penalty", float("nan"), "repetition_penalty"),
    ("frequency_penalty", 2.5, "frequency_penalty: must be in [-2.0, 2.0], got 2.5"),
    ("presence_penalty", -2.1, "presence_penalty: must be in [-2.0, 2.0]"),
    ("presence_penalty", "1", "presence_penalty: must be a number"),
])
def test_out_of_range_penalties_name_the_field_and_the_limit(field, value, message):
    with pytest.raises(RequestError) as error:
        SamplingParams(**{field: value})
    assert message in str(error.value)


PENALIZED = [
    SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3),
    SamplingParams(max_tokens=24, temperature=0.8, seed=3, frequency_penalty=1.0, presence_penalty=0.5),
    SamplingParams(max_tokens=24, temperature=0.0),  # no penalty, between rows with one
    SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=1.5, repetition_penalty=1.1),
]
TEXTS = ["one two one two one two one two", "the cat sat on the mat and " * 14,  # prefilled in chunks
         "Repeat after me: yes yes yes yes", "a b c a b c a b c a b c a b c"]


def test_penalized_outputs_are_the_same_batched_overlapped_preempted_and_cached(smollm2_llm):
    """Counts are loaded when a sequence is scheduled and advanced by the step: the output must not
    depend on overlap (the newest id counted on the device), batching, preemption or prefix reuse."""
    runner, tok, max_len = smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len
    requests = lambda: [smollm2_llm.request(t, p) for t, p in zip(TEXTS, PENALIZED, strict=True)]  # noqa: E731
    serial = Engine(runner, tok, max_len, prefix_caching=False, async_scheduling=False)
    alone = [serial.generate([request])[0].token_ids for request in requests()]
    plain = smollm2_llm.generate(TEXTS, SamplingParams(max_tokens=24, temperature=0.0))
    assert alone[0] != plain[0].token_ids and alone[3] != plain[3].token_ids  # the penalties act here
    assert alone[2] == plain[2].token_ids
    batched = [o.token_ids for o in smollm2_llm.generate(TEXTS, PENALIZED)]
    cached = smollm2_llm.generate(TEXTS, PENALIZED)  # the prompts' pages come from the prefix cache
    assert sum(o.usage.cached_tokens for o in cached) > 0
    engine = Engine(runner, tok, max_len)
    victims, preempt = [], engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (victims.append((seq.params.penalized, seq.inflight)), preempt(seq))
    with engine.pool.hold(keep_free=22):  # less than the four need at once: preempted and recomputed
        preempted = engine.generate(requests())
    assert (True, 1) in victims  # a penalized sequence was preempted with its newest id in flight
    assert batched == alone and [o.token_ids for o in cached] == alone and [o.token_ids for o in preempted] == alone
    assert sorted(runner.free_penalty_slots) == list(range(smollm2_llm.config.max_seqs))


def test_penalized_requests_wait_for_a_free_slot(smollm2_llm):
    """Engines that share a runner share its max_seqs slots: with one left, penalized requests run one
    after another, and the others keep running beside them."""
    runner = smollm2_llm.runner
    expected = [o.token_ids for o in smollm2_llm.generate(TEXTS, PENALIZED)]
    held = runner.free_penalty_slots[1:]
    del runner.free_penalty_slots[1:]
    try:
        engine = Engine(runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len)
        outputs = engine.generate([smollm2_llm.request(t, p) for t, p in zip(TEXTS, PENALIZED, strict=True)])
    finally:
        runner.free_penalty_slots.extend(held)
    assert [o.token_ids for o in outputs] == expected
    one_at_a_time = sum(len(ids) for ids, p in zip(expected, PENALIZED, strict=True) if p.penalized)
    assert engine.stats.steps >= one_at_a_time


def test_an_aborted_penalized_request_gives_its_slot_to_the_next_while_its_step_runs(smollm2_llm):
    """The aborted request's step, still in flight, counts into the slot; the next owner's load comes
    after it on the device, so the next request's output is its own."""
    runner = smollm2_llm.runner
    expected = smollm2_llm.generate([TEXTS[3]], PENALIZED[3])[0].token_ids
    engine = Engine(runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len)
    free = len(runner.free_penalty_slots)
    seq = engine.add_request(smollm2_llm.request(TEXTS[0], PENALIZED[0]))
    for _ in range(3):
        engine.step()
    assert seq.penalty_slot is not None and seq.inflight and len(runner.free_penalty_slots) == free - 1
    slot = seq.penalty_slot
    engine.abort(seq.index)
    assert seq.penalty_slot is None and runner.free_penalty_slots[-1] == slot
    (output,) = engine.generate([smollm2_llm.request(TEXTS[3], PENALIZED[3])])
    assert output.token_ids == expected and len(runner.free_penalty_slots) == free


def test_no_penalty_slots_refuse_penalties_by_the_setting(smollm2_llm):
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.step import ModelRunner
    from jaxinfer.errors import ConfigError

    with pytest.raises(ConfigError, match="max_penalized_seqs must be in"):
        EngineConfig(max_seqs=8, max_penalized_seqs=9)
    cfg = smollm2_llm.config.replace(max_penalized_seqs=0, warmup=False)
    runner = ModelRunner(smollm2_llm.runner.model, smollm2_llm.model_config, cfg, smollm2_llm.mesh)
    assert runner.penalty_counts.shape == (1, 1) and not runner.free_penalty_slots
    engine = Engine(runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len)
    with pytest.raises(RequestError, match=r"presence_penalty: .*engine.max_penalized_seqs is 0"):
        engine.validate(smollm2_llm.request(TEXTS[0], SamplingParams(presence_penalty=0.5)))


def test_the_device_counts_are_the_host_ids_plus_the_ids_in_flight(smollm2_llm):
    """After every step of an overlapped engine, a sequence's row holds its prompt and read-back output
    exactly, plus its samples still in flight; the rows of a chunked prefill count nothing."""
    runner, vocab = smollm2_llm.runner, smollm2_llm.model_config.vocab_size
    engine = Engine(runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, prefix_caching=False)
    request = smollm2_llm.request(TEXTS[1], SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.5))
    assert len(request.prompt_ids) > max(smollm2_llm.config.token_buckets)  # prefilled in two chunks
    seq = engine.add_request(request)
    checked = 0
    in_flight: tuple[int, int] | None = None  # (its position in the output, the id counted for it)
    while seq.finish_reason is None:
        engine.step()
        if seq.penalty_slot is None:
            continue
        if in_flight is not None and len(seq.output_ids) > in_flight[0]:
            assert seq.output_ids[in_flight[0]] == in_flight[1]  # the id counted early is the one sampled
        expected = np.zeros(vocab, np.int64)
        expected[sorted(set(seq.prompt_ids))] = PROMPT_BIT
        np.add.at(expected, seq.output_ids, 1)
        extra = np.asarray(runner.penalty_counts[seq.penalty_slot]) - expected
        assert (extra >= 0).all() and extra.sum() == seq.inflight, (checked, np.nonzero(extra))
        in_flight = (len(seq.output_ids), int(np.argmax(extra))) if seq.inflight else None
        checked += 1
    assert checked >= 12 and seq.output_ids
