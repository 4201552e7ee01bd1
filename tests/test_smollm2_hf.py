"""Real weights: SmolLM2-135M-Instruct from its GGUF, against transformers loading the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import PagedForward

from jaxinfer import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 50.",
    "Explain what a hash table is in one sentence.",
    "Translate 'good morning' into Spanish and German.",
]


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval()


def hf_greedy(hf_model, ids: list[int], new_tokens: int, eos: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


def test_greedy_continuations_match_transformers(smollm2_llm, hf_model):
    tok = smollm2_llm.tokenizer
    (eos,) = tok.eos_ids
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    # All five run together in one continuous batch; each must equal transformers run alone.
    outputs = smollm2_llm.generate_chat(conversations, SamplingParams(max_tokens=32, temperature=0.0))
    for conversation, out in zip(conversations, outputs, strict=True):
        expected = hf_greedy(hf_model, tok.encode_chat(conversation), 32, eos)
        assert out.token_ids == expected, (conversation[0]["content"], out.text, tok.decode(expected))
        assert out.finish_reason == ("stop" if expected[-1] == eos else "length")


def test_first_step_logits_match_transformers(smollm2_llm, hf_model):
    """Both sides dequantize the same Q4_1 blocks to float32, so only summation order differs:
    over 30 layers that was measured at 1.1e-4 absolute on logits of magnitude up to ~38 (3e-6
    relative). 1e-3 absolute leaves an order of magnitude of headroom and still catches any real
    mismatch (a wrong RoPE permutation or norm epsilon moves logits by whole units)."""
    from jaxinfer.weights.loader import load_model

    loaded = load_model("smollm2-135m", smollm2_llm.mesh)
    for prompt in PROMPTS[:2]:
        ids = smollm2_llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        forward = PagedForward(loaded.model, page_size=16, num_pages=64, max_pages=16)
        ours = forward.run(ids, 0)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(ours, ref, atol=1e-3, rtol=0)
        assert ours[-1].argmax() == ref[-1].argmax()


def test_top_logprobs_match_transformers(smollm2_llm, hf_model):
    """Each generated token's alternatives are the raw model's most likely ids and their logprobs at that
    position (transformers run over the same ids), for a greedy and a sampled row in one batch."""
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=5),
              SamplingParams(max_tokens=12, temperature=0.9, seed=4, logprobs=True, top_logprobs=20),
              SamplingParams(max_tokens=12, temperature=0.0)]
    outputs = smollm2_llm.generate(PROMPTS[:3], params)
    assert outputs[2].top_logprobs is None
    for out, p in zip(outputs[:2], params, strict=False):
        ids = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            reference = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1).numpy()
        assert len(out.top_logprobs) == len(out.token_ids)
        for i, (token, logprob, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True)):
            row = reference[len(out.prompt_token_ids) + i - 1]
            ours_ids, ours_values = [t for t, _ in top], np.array([v for _, v in top])
            assert len(top) == p.top_logprobs and (np.diff(ours_values) <= 0).all()
            np.testing.assert_allclose(ours_values, row[ours_ids], atol=1e-3)  # each id's own logprob
            np.testing.assert_allclose(ours_values, np.sort(row)[::-1][: p.top_logprobs], atol=1e-3)  # the best
            if token in ours_ids:
                assert abs(ours_values[ours_ids.index(token)] - logprob) < 1e-5
            assert ours_ids[0] == token or p.temperature > 0  # greedy: the sampled id is the most likely


def test_prompt_logprobs_match_transformers(smollm2_llm, hf_model):
    """Every prompt token's logprob given those before it, and the most likely ids at its position, as
    transformers scores the prompt in one forward pass; the long prompt is scored over several steps
    (chunked prefill), beside a row that decodes and one scored without alternatives."""
    long_prompt = "Summarize: " + " ".join(f"item {i} costs {3 * i} euros;" for i in range(20))
    prompts = [long_prompt, PROMPTS[0], PROMPTS[1]]
    params = [SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=5),
              SamplingParams(max_tokens=8, temperature=0.0),
              SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)]
    outputs = smollm2_llm.generate(prompts, params)
    assert len(outputs[0].prompt_token_ids) > 2 * max(smollm2_llm.config.token_buckets)
    assert outputs[1].prompt_logprobs is None and outputs[2].prompt_top_logprobs is None
    for out, p in zip(outputs[::2], params[::2], strict=True):
        ids = out.prompt_token_ids
        with torch.no_grad():
            reference = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1).numpy()
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        np.testing.assert_allclose(out.prompt_logprobs[1:], reference[np.arange(len(ids) - 1), ids[1:]], atol=1e-3)
        for position, top in enumerate(out.prompt_top_logprobs or [], start=-1):
            if position < 0:
                assert top == []
                continue
            top_ids, values = [t for t, _ in top], [v for _, v in top]
            np.testing.assert_allclose(values, reference[position, top_ids], atol=1e-3)
            np.testing.assert_allclose(values, np.sort(reference[position])[::-1][: p.prompt_logprobs], atol=1e-3)


def test_logit_bias_matches_transformers_sequence_bias(smollm2_llm, hf_model):
    """OpenAI's logit_bias as transformers' single-token `sequence_bias`, greedy, in one batch: a row that
    bans its natural first tokens, one that promotes a word with a repetition penalty applied after the
    bias (both libraries' order), and one without."""
    tok = smollm2_llm.tokenizer
    (eos,) = tok.eos_ids
    conversations = [[{"role": "user", "content": text}] for text in PROMPTS[:3]]
    plain = smollm2_llm.generate_chat(conversations, SamplingParams(max_tokens=12, temperature=0.0))
    biases = [{plain[0].token_ids[0]: -100.0, plain[0].token_ids[1]: -5.0}, {smollm2_llm.encode("banana")[0]: 8.0},
              {}]
    penalties = [1.0, 1.2, 1.0]
    params = [SamplingParams(max_tokens=12, temperature=0.0, logit_bias=b, repetition_penalty=r)
              for b, r in zip(biases, penalties, strict=True)]
    outputs = smollm2_llm.generate_chat(conversations, params)
    assert outputs[0].token_ids != plain[0].token_ids and outputs[1].token_ids != plain[1].token_ids
    for conversation, bias, r, out in zip(conversations, biases, penalties, outputs, strict=True):
        ids = tok.encode_chat(conversation)
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=12,
                do_sample=False, eos_token_id=eos, pad_token_id=eos, repetition_penalty=r,
                sequence_bias={(token,): value for token, value in bias.items()} or None)[0, len(ids):].tolist()
        assert out.token_ids == expected


class OpenAIPenalties:
    """OpenAI's frequency and presence penalties as a transformers logits processor (transformers has
    none): minus frequency times each token's count in the output, minus presence if it is there."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def test_penalized_greedy_continuations_match_transformers(smollm2_llm, hf_model):
    """Repetition penalty as transformers applies it, then frequency and presence (vLLM's order), in one
    batch with a row without penalties; the long prompt is prefilled in chunks, whose rows sample nothing."""
    from transformers.generation.logits_process import LogitsProcessorList

    tok = smollm2_llm.tokenizer
    (eos,) = tok.eos_ids
    long_prompt = "Repeat this list back to me: " + ", ".join(["apple", "pear", "plum", "fig"] * 12)
    cases = [(PROMPTS[1], 1.3, 0.0, 0.0), (PROMPTS[2], 1.0, 0.8, 0.4), (long_prompt, 1.0, 1.5, 0.5),
             (PROMPTS[3], 1.0, 0.0, 0.0), (PROMPTS[4], 1.2, 0.5, 1.0)]
    conversations = [[{"role": "user", "content": text}] for text, *_ in cases]
    assert len(tok.encode_chat(conversations[2])) > max(smollm2_llm.config.token_buckets)
    params = [SamplingParams(max_tokens=32, temperature=0.0, repetition_penalty=r, frequency_penalty=f,
                             presence_penalty=p) for _, r, f, p in cases]
    outputs = smollm2_llm.generate_chat(conversations, params)
    for conversation, (_, r, f, p), out in zip(conversations, cases, outputs, strict=True):
        ids = tok.encode_chat(conversation)
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=32,
                do_sample=False, eos_token_id=eos, pad_token_id=eos, repetition_penalty=r,
                logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), f, p)]))[0, len(ids):].tolist()
        assert out.token_ids == expected, (conversation[0]["content"][:40], out.text, tok.decode(expected))
