"""logit_bias: the pairs added to the logits in the step, their checks, and where they are refused.

Greedy output with a bias (and a repetition penalty after it) against transformers' generate() with
the same `sequence_bias` is in test_smollm2_hf.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.logit_bias import BiasInputs, add_bias
from jaxinfer.engine.params import MAX_LOGIT_BIAS
from jaxinfer.errors import RequestError


def test_each_rows_pairs_are_added_to_its_own_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    ids = np.full((3, MAX_LOGIT_BIAS), -1, np.int32)
    values = np.zeros((3, MAX_LOGIT_BIAS), np.float32)
    ids[0, :3], values[0, :3] = [4, 49, 0], [-100.0, 7.5, 0.25]
    ids[2, :50], values[2, :50] = np.arange(50), np.linspace(-1, 1, 50)
    expected = logits.copy()
    expected[0, [4, 49, 0]] += [-100.0, 7.5, 0.25]
    expected[2] += np.linspace(-1, 1, 50).astype(np.float32)
    got = add_bias(jnp.asarray(logits), BiasInputs(jnp.asarray(ids), jnp.asarray(values)))
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    nothing = BiasInputs(jnp.full((3, MAX_LOGIT_BIAS), -1, jnp.int32), jnp.ones((3, MAX_LOGIT_BIAS), jnp.float32))
    np.testing.assert_array_equal(add_bias(jnp.asarray(logits), nothing), logits)


def test_the_bias_is_kept_as_id_ordered_pairs_from_a_mapping_with_json_keys():
    params = SamplingParams(logit_bias={"17": 2, 3: -100.0})
    assert params.logit_bias == ((3, -100.0), (17, 2.0))
    assert SamplingParams(logit_bias=params.logit_bias).logit_bias == params.logit_bias


@pytest.mark.parametrize(("value", "message"), [
    ({"x": 1.0}, r"logit_bias\['x'\]: must be an integer"),
    ({"\u00b2": 1.0}, r"logit_bias\['\u00b2'\]: must be an integer"),  # a digit to str.isdigit, not to int()
    ({"9" * 5000: 1.0}, r"logit_bias\['9999.*: must be an integer"),  # past int()'s digit limit
    ({" 5": 1.0}, r"logit_bias\[' 5'\]: must be an integer"),
    ({"1e3": 1.0}, r"logit_bias\['1e3'\]: must be an integer"),
    ({"007": 1.0, 7: 2.0}, "token id 7 is given twice"),
    ({1: 100.5}, r"logit_bias\[1\]: must be in \[-100.0, 100.0\], got 100.5"),
    ({1: float("nan")}, r"logit_bias\[1\]: must be in"),
    ({-2: 1.0}, r"logit_bias\[-2\]: must be in \[0, "),
    ({"1": 1.0, 1: 2.0}, "token id 1 is given twice"),
    ({1: True}, r"logit_bias\[1\]: must be a number, got True"),
    ([1, 2], "logit_bias: must map token ids to biases"),
    ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"logit_bias: at most {MAX_LOGIT_BIAS} token ids, got "),
])
def test_bad_biases_name_the_field_and_the_limit(value, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(logit_bias=value)


def test_the_engine_refuses_ids_outside_the_vocabulary(smollm2_llm):
    vocab = smollm2_llm.model_config.vocab_size
    request = smollm2_llm.request("hi", SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(RequestError, match=rf"logit_bias\[{vocab}\]: {vocab} is outside the vocabulary"):
        smollm2_llm.engine.validate(request)


def test_the_bias_crosses_the_wire_both_ways():
    """What a server reads and what the decode front sends a prefill peer (float32 on the wire)."""
    from serving.convert import sampling_params, sampling_proto

    params = SamplingParams(logit_bias={3: -100.0, 70: 2.5, 9: 0.125})
    assert sampling_params(sampling_proto(params)).logit_bias == params.logit_bias


def test_a_sampled_row_follows_a_forcing_bias_but_a_held_back_eos_stays_held_back(smollm2_llm):
    """+100 on one id: every sampled token is that id, whatever the seed; +100 on EOS before min_tokens:
    EOS is still never drawn (the ban comes after the bias)."""
    target = smollm2_llm.encode(" blue")[0]
    forced = SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=11, logit_bias={target: 100.0})
    assert smollm2_llm.generate(["The sky is"], forced)[0].token_ids == [target] * 5
    (eos,) = smollm2_llm.tokenizer.eos_ids
    held = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0, logit_bias={eos: 100.0})
    out = smollm2_llm.generate(["The sky is"], held)[0]
    assert len(out.token_ids) == 4 and eos not in out.token_ids


def test_a_bias_steers_only_its_own_row_and_leaves_the_logprobs_raw(smollm2_llm):
    prompts = ["The capital of France is", "One, two, three,"]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True)
    plain = smollm2_llm.generate(prompts, greedy)
    first = plain[0].token_ids[0]
    banned = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, logit_bias={first: -100.0})
    steered, neighbour = smollm2_llm.generate(prompts, [banned, greedy])
    assert steered.token_ids[0] != first and neighbour.token_ids == plain[1].token_ids
    forced = smollm2_llm.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=True,
                                                              logit_bias={steered.token_ids[0]: 100.0}))[0]
    assert forced.token_ids == steered.token_ids[:1]
    assert forced.logprobs[0] == pytest.approx(steered.logprobs[0], abs=1e-5)  # the raw model's, not biased
    assert forced.logprobs[0] < plain[0].logprobs[0]
