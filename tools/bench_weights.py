"""Packed weights on SmolLM2-135M: device bytes, decode tokens/s and perplexity per weight format,
beside transformers' float32 perplexity on the same text.

    python tools/bench.py weights --formats float32 packed int8 int4   # packed: its Q4_1 blocks
    python tools/bench.py --no-peer weights --formats packed float32 --batch 1 32
    python tools/bench.py --no-peer weights --formats float32 --kv-dtype int8     # int8 KV pages (or fp8)

Each format is a fresh engine (`engine.weights_dtype`) on the same engine config:
- `weight_bytes` and `kv_pool_bytes` are the engine's metrics, summed from the device arrays; the
  KV figure is scaled to a 4,096-token pool;
- tokens/s: `--batch` random prompts of `--in-len` tokens, `--out-len` new tokens each (EOS ignored);
- perplexity: tests/data/text/perplexity.txt scored in one request (`prompt_logprobs`); the peer
  scores the same token ids with transformers on the GGUF's weights dequantized to float32.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench_common import emit, exact, fresh_engine, random_prompts, timed_generate

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "tests" / "data" / "text" / "perplexity.txt"
FORMATS = ("float32", "packed", "int8", "int4", "bfloat16", "auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--formats", nargs="+", default=list(FORMATS[:4]), choices=FORMATS)
    parser.add_argument("--group", type=int, default=32, help="engine.weights_group for int8 / int4")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--in-len", type=int, default=64)
    parser.add_argument("--out-len", type=int, default=32)
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "int8", "fp8"],
                        help="engine.kv_dtype for every run")


def perplexity(llm, ids: list[int]) -> float:
    from jaxinfer import SamplingParams

    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    scored = [lp for lp in out.prompt_logprobs if lp is not None]
    return math.exp(-sum(scored) / len(scored))


def hf_perplexity(model: str, ids: list[int]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxinfer.weights.registry import resolve

    path = resolve(model).path
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    return math.exp(-float(logprobs.mean()))


def bench(args: argparse.Namespace) -> None:
    from jaxinfer import LLM

    ids = None
    for fmt in args.formats:
        dtype = {"dtype": "bfloat16"} if fmt == "bfloat16" else {}  # the engine's dtype is the float weights'
        llm = LLM(args.model, args.config, weights_dtype=fmt, weights_group=args.group, kv_dtype=args.kv_dtype, **dtype)
        ids = ids or llm.tokenizer.encode_prompt(TEXT.read_text())
        metrics = llm.engine.metrics()
        pool_tokens = llm.config.num_pages * llm.config.page_size
        record = dict(what="weights_format", weights_dtype=fmt, kv_dtype=args.kv_dtype,
                      group=args.group if fmt.startswith("int") else None,
                      weight_bytes=metrics["weight_bytes"],
                      kv_bytes_per_4096_tokens=round(metrics["kv_pool_bytes"] * 4096 / pool_tokens),
                      perplexity=round(perplexity(llm, ids), 4), text_tokens=len(ids))
        for batch in args.batch:
            prompts = random_prompts(llm, [args.in_len] * batch, seed=0)
            llm.generate(prompts, exact(2))
            seconds, outputs = timed_generate(fresh_engine(llm), [llm.request(p, exact(args.out_len)) for p in prompts])
            record[f"tok_per_s_batch_{batch}"] = round(sum(len(o.token_ids) for o in outputs) / seconds, 1)
        emit(record)
    if not args.no_peer and ids is not None:
        emit(dict(what="hf_perplexity", dtype="float32", perplexity=round(hf_perplexity(args.model, ids), 4),
                  text_tokens=len(ids)))
