"""Throughput benchmarks against the transformers peers: uniform and mixed-length decoding (overlap on and off),
the host's share at batch 32, what penalties cost a batch, and prompt scoring (prompt_logprobs).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np
from bench_common import emit, exact, fresh_engine, load_llm, random_prompts, step_summary, timed_generate
from bench_peers import REPO, SHARED_PEER, run_offline_peer, run_peer


# -- uniform: B prompts of one length (the shared peer's workload) ------------------------------
def bench_uniform(args: argparse.Namespace) -> None:
    llm = load_llm(args)
    ours = {}
    for batch in args.batch:
        prompts = random_prompts(llm, [args.in_len] * batch, seed=0)
        llm.generate(prompts, exact(2))
        engine = fresh_engine(llm)
        seconds, outputs = timed_generate(engine, [llm.request(p, exact(args.out_len)) for p in prompts])
        new = sum(len(o.token_ids) for o in outputs)
        ours[batch] = new / seconds
        emit(dict(what="jaxinfer_generate", batch=batch, in_len=args.in_len, new_tokens=new // batch,
                  s=round(seconds, 3), tok_per_s=round(new / seconds, 1), **step_summary(engine)))
    if args.no_peer or not SHARED_PEER.exists():
        return
    command = [sys.executable, str(REPO / "tools" / "run_peer.py"), str(SHARED_PEER), "--shape", "smollm2-135m",
               "--device", "cpu", "--batch", *map(str, args.batch), "--in-len", str(args.in_len),
               "--out-len", str(args.out_len)]
    theirs = {r["batch"]: r["tok_per_s"] for r in run_peer(command) if r.get("what") == "hf_generate"}
    for batch in args.batch:
        if batch in theirs:
            emit(dict(what="ratio", batch=batch, jaxinfer_over_hf=round(ours[batch] / theirs[batch], 2)))


# -- offline: mixed prompt lengths, overlap on and off, HF padded batches -------------------------
def bench_offline(args: argparse.Namespace, llm=None) -> None:
    llm = llm or load_llm(args)
    lengths = np.random.default_rng(1).integers(args.min_len, args.max_len + 1, args.requests).tolist()
    prompts = random_prompts(llm, lengths, seed=2)
    requests = [llm.request(p, exact(args.out_len)) for p in prompts]
    fresh_engine(llm, prefix_caching=False).generate([llm.request(p, exact(2)) for p in prompts])
    ours = {}
    for overlap in (True, False):
        engine = fresh_engine(llm, prefix_caching=False, async_scheduling=overlap)
        seconds, outputs = timed_generate(engine, requests)
        new = sum(len(o.token_ids) for o in outputs)
        ours[overlap] = new / seconds
        emit(dict(what="jaxinfer_offline", overlap=overlap, requests=len(prompts), prompt_tokens=sum(lengths),
                  new_tokens=new, s=round(seconds, 2), tok_per_s=round(new / seconds, 1), **step_summary(engine)))
    emit(dict(what="overlap_speedup", on_over_off=round(ours[True] / ours[False], 3)))
    if args.no_peer:
        return
    for hf_batch, record in run_offline_peer(prompts, args.hf_batch, "--new-tokens", str(args.out_len)):
        emit(dict(what="ratio", workload="offline", hf_batch=hf_batch,
                  jaxinfer_overlap_over_hf=round(ours[True] / record["tok_per_s"], 2)))


# -- host overhead at batch 32 ----------------------------------------------------------------------
def bench_host(args: argparse.Namespace, llm=None) -> None:
    llm = llm or load_llm(args)
    prompts = random_prompts(llm, [args.in_len] * args.batch_size, seed=6)
    fresh_engine(llm, prefix_caching=False).generate([llm.request(p, exact(2)) for p in prompts])
    for overlap in (True, False):
        engine = fresh_engine(llm, prefix_caching=False, async_scheduling=overlap)
        seconds, outputs = timed_generate(engine, [llm.request(p, exact(args.out_len)) for p in prompts])
        new = sum(len(o.token_ids) for o in outputs)
        emit(dict(what="jaxinfer_host_overhead", overlap=overlap, batch=args.batch_size, in_len=args.in_len,
                  new_tokens=args.out_len, tok_per_s=round(new / seconds, 1), **step_summary(engine)))


# -- penalties: what the device counts cost a batch ------------------------------------------------
def bench_penalties(args: argparse.Namespace, llm=None) -> None:
    """Batch `--batch-size` of `--in-len` tokens, `--out-len` new: no row, half the rows and every row with
    repetition 1.1, frequency 0.5 and presence 0.5 penalties (overlap on, greedy)."""
    llm = llm or load_llm(args)
    prompts = random_prompts(llm, [args.in_len] * args.batch_size, seed=6)
    penalized = dataclasses.replace(exact(args.out_len), repetition_penalty=1.1, frequency_penalty=0.5,
                                    presence_penalty=0.5)
    warm = dataclasses.replace(penalized, max_tokens=2, min_tokens=2)
    fresh_engine(llm, prefix_caching=False).generate([llm.request(p, warm) for p in prompts])
    rates: dict[float, list[float]] = {}
    for share in (0.0, 0.5, 1.0, 0.0):  # none first and last: the drift of the machine shows
        rows = round(share * len(prompts))
        params = [penalized] * rows + [exact(args.out_len)] * (len(prompts) - rows)
        engine = fresh_engine(llm, prefix_caching=False)
        seconds, outputs = timed_generate(engine, [llm.request(p, q) for p, q in zip(prompts, params, strict=True)])
        new = sum(len(o.token_ids) for o in outputs)
        rates.setdefault(share, []).append(new / seconds)
        emit(dict(what="jaxinfer_penalties", penalized_rows=rows, batch=args.batch_size, in_len=args.in_len,
                  new_tokens=args.out_len, tok_per_s=round(new / seconds, 1), **step_summary(engine)))
    none = float(np.mean(rates[0.0]))
    emit(dict(what="ratio", workload="penalties", half_over_none=round(rates[0.5][0] / none, 3),
              all_over_none=round(rates[1.0][0] / none, 3)))


# -- scoring: prompt logprobs (what an evaluation harness asks for loglikelihoods) ------------------------
def bench_scoring(args: argparse.Namespace, llm=None) -> None:
    """`--requests` prompts of `--min-len`..`--max-len` random tokens, one new token each: unscored, scored
    (prompt_logprobs 0) and scored with 5 alternatives; prompt tokens per second, and transformers scoring
    the same prompts in padded batches (tools/hf_offline_peer.py --score)."""
    from jaxinfer import SamplingParams

    llm = llm or load_llm(args)
    lengths = np.random.default_rng(1).integers(args.min_len, args.max_len + 1, args.requests).tolist()
    prompts = random_prompts(llm, lengths, seed=2)
    settings = {"unscored": None, "scored": 0, "scored_top5": 5}
    fresh_engine(llm, prefix_caching=False).generate(
        [llm.request(p, SamplingParams(max_tokens=1, prompt_logprobs=5)) for p in prompts[:8]])
    rates, first = {}, None
    for name, k in settings.items():
        engine = fresh_engine(llm, prefix_caching=False)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
        seconds, outputs = timed_generate(engine, [llm.request(p, params) for p in prompts])
        rates[name] = sum(lengths) / seconds
        first = outputs[0].prompt_logprobs[1:5] if k is not None else first
        emit(dict(what="jaxinfer_scoring", setting=name, prompt_logprobs=k, requests=len(prompts),
                  prompt_tokens=sum(lengths), s=round(seconds, 2), prompt_tok_per_s=round(rates[name], 1),
                  **step_summary(engine)))
    emit(dict(what="ratio", workload="scoring", scored_over_unscored=round(rates["scored"] / rates["unscored"], 3),
              top5_over_unscored=round(rates["scored_top5"] / rates["unscored"], 3),
              first_scores=[round(v, 4) for v in first]))
    if args.no_peer:
        return
    for hf_batch, record in run_offline_peer(prompts, args.hf_batch, "--score"):
        emit(dict(what="ratio", workload="scoring", hf_batch=hf_batch,
                  jaxinfer_scored_over_hf=round(rates["scored"] / record["prompt_tok_per_s"], 2)))
