"""Time-to-first-token benchmarks of reused KV: a shared prefix with and without the prefix cache, a long prefix
restored from each KV tier, and the prefill/decode hand-off through the KV store against one engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import numpy as np
from bench_common import emit, exact, fresh_engine, load_llm, random_prompts, step_summary


# -- shared prefix: time to first token with and without the prefix cache -------------------------
def time_to_first_token(engine, requests) -> list[float]:
    """Seconds from submission to each request's first token (all submitted at once)."""
    start, first = time.perf_counter(), {}
    sequences = [engine.add_request(r) for r in requests]
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter() - start
        first.update({s.index: now for s in sequences if s.output_ids and s.index not in first})
    return [first[s.index] for s in sequences]


def bench_shared_prefix(args: argparse.Namespace, llm=None) -> None:
    from jaxinfer.engine.params import Request

    llm = llm or load_llm(args)
    rng = np.random.default_rng(3)
    (system,) = random_prompts(llm, [args.prefix_len], seed=4)
    tails = random_prompts(llm, rng.integers(8, 33, args.prefix_requests).tolist(), seed=5)
    requests = [llm.request(system + tail, exact(1)) for tail in tails]
    results = {}
    for caching in (False, True):
        warm_salt = f"warm-{caching}"  # warm the buckets without leaving the measured prefix in the cache
        fresh_engine(llm, prefix_caching=caching).generate(
            [Request(system + tail, exact(1), cache_salt=warm_salt) for tail in tails[:4]])
        engine = fresh_engine(llm, prefix_caching=caching)
        ttft = np.array(time_to_first_token(engine, requests))
        results[caching] = ttft
        emit(dict(what="jaxinfer_shared_prefix", prefix_cache=caching, requests=len(requests),
                  prefix_tokens=args.prefix_len, mean_ttft_s=round(float(ttft.mean()), 3),
                  p50_ttft_s=round(float(np.median(ttft)), 3), max_ttft_s=round(float(ttft.max()), 3),
                  prompt_tokens_computed=engine.stats.prompt_tokens_computed,
                  prefix_hit_tokens=engine.stats.prefix_hit_tokens, **step_summary(engine)))
    emit(dict(what="ratio", workload="shared-prefix",
              mean_ttft_without_over_with=round(float(results[False].mean() / results[True].mean()), 2),
              max_ttft_without_over_with=round(float(results[False].max() / results[True].max()), 2)))


# -- tiers: a long shared prefix recomputed vs restored from each KV tier ---------------------------
def bench_tiers(args: argparse.Namespace, llm=None) -> None:
    from jaxinfer.kv.page_value import ModelIdentity
    from jaxinfer.kv.store import PageStore
    from jaxinfer.kv.tiers import HostTier, TieredPages

    llm = llm or load_llm(args)
    (prefix,) = random_prompts(llm, [args.prefix_len], seed=7)
    tails = random_prompts(llm, [16] * (args.repeats + 1), seed=8)
    m = llm.model_config
    identity = ModelIdentity("bench", np.dtype(llm.dtype).name, llm.config.page_size, m.num_layers,
                             m.num_kv_heads, m.head_dim)

    def ttft(engine, tail) -> float:
        start = time.perf_counter()
        engine.generate([llm.request(prefix + tail, exact(1))])
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as store_dir:
        setups = {
            "recomputed": dict(prefix_caching=False),
            "l1_device": dict(),
            "l2_host": dict(tiers=TieredPages(HostTier(args.prefix_len), None)),
            "l3_file": dict(tiers=TieredPages(None, PageStore(store_dir, identity))),
        }
        results = {}
        for name, flags in setups.items():
            engine = fresh_engine(llm, **flags)
            ttft(engine, tails[-1])  # computes (and publishes) the prefix once; warms the buckets
            times = []
            for tail in tails[: args.repeats]:
                if name.startswith(("l2", "l3")):  # push every cached page down to the tier first
                    with engine.pool.hold(keep_free=0):
                        engine.flush_tiers()
                times.append(ttft(engine, tail))
            results[name] = float(np.median(times))
            emit(dict(what="jaxinfer_kv_tier_ttft", tier=name, prefix_tokens=args.prefix_len,
                      median_ttft_s=round(results[name], 3), runs=[round(t, 3) for t in times],
                      hits_l2=engine.stats.prefix_hit_tokens_l2, hits_l3=engine.stats.prefix_hit_tokens_l3))
        engine.runner.tiers = None  # the benchmark's tiers end with it
        engine.pool.track_evictions = False
    emit(dict(what="ratio", workload="kv-tiers", **{f"recomputed_over_{k}": round(results["recomputed"] / v, 2)
                                                    for k, v in results.items() if k != "recomputed"}))


# -- disagg: the prefill/decode hand-off through the KV store, against one engine ---------------------
def bench_disagg(args: argparse.Namespace, llm=None) -> None:
    """Per prompt of `--prefix-len` tokens and `--out-len` new ones: one engine's time to the first and
    last id, against the prefill worker's time (prompt, first id, pages written) plus the decode
    worker's time to its first new id (pages read and restored, partial page recomputed) and to the
    end. Both workers are engines on one runner here; the decode worker's device pool is emptied
    before each request, as if it ran on another machine."""
    from jaxinfer.engine.disagg import decode_request, handoff, prefill_request
    from jaxinfer.kv.page_value import ModelIdentity
    from jaxinfer.kv.store import PageStore
    from jaxinfer.kv.tiers import TieredPages

    llm = llm or load_llm(args)
    prompts = random_prompts(llm, [args.prefix_len] * (args.repeats + 1), seed=9)
    m = llm.model_config
    identity = ModelIdentity("bench", np.dtype(llm.dtype).name, llm.config.page_size, m.num_layers,
                             m.num_kv_heads, m.head_dim)
    params = exact(args.out_len)

    def first_and_last(engine, request) -> tuple[float, float, object]:
        start, first = time.perf_counter(), None
        seq = engine.add_request(request)
        while engine.has_unfinished():
            finished = engine.step()
            if first is None and (len(seq.output_ids) > len(request.generated_ids) or finished):
                first = time.perf_counter() - start
            if finished:
                return first, time.perf_counter() - start, finished[0]
        raise RuntimeError("the request did not finish")

    with tempfile.TemporaryDirectory() as store_dir:
        single = fresh_engine(llm, prefix_caching=False)
        tiers = TieredPages(None, PageStore(store_dir, identity))
        workers = fresh_engine(llm, tiers=tiers)  # one engine plays both roles, emptied in between
        rows = []
        for i, prompt in enumerate(prompts):
            one_first, one_total, reference = first_and_last(single, llm.request(prompt, params))
            request = llm.request(prompt, dataclasses.replace(params, seed=i))
            started = time.perf_counter()
            passed = handoff(request, workers.generate([prefill_request(request)])[0], workers.max_model_len)
            prefill_s = time.perf_counter() - started
            with workers.pool.hold(keep_free=0):
                workers.pool.take_evicted()  # the decode worker's pool starts empty, nothing demoted
            decode_first, decode_total, out = first_and_last(workers, decode_request(passed))
            assert out.token_ids == reference.token_ids, "disaggregated output differs from one engine's"
            if i == 0:
                continue  # warms the page copy and import paths
            rows.append((one_first, one_total, prefill_s, decode_first, decode_total))
        runs = np.median(np.array(rows), axis=0)
        workers.runner.tiers, workers.pool.track_evictions = None, False
    one_first, one_total, prefill_s, decode_first, decode_total = (float(x) for x in runs)
    emit(dict(what="jaxinfer_disagg", prompt_tokens=args.prefix_len, new_tokens=args.out_len,
              stored_pages=passed.stored_pages, single_ttft_s=round(one_first, 3), single_total_s=round(one_total, 3),
              prefill_worker_s=round(prefill_s, 3), decode_first_new_id_s=round(decode_first, 3),
              decode_total_s=round(decode_total, 3), disagg_ttft_s=round(prefill_s + decode_first, 3),
              handoff_overhead_s=round(prefill_s + decode_first - one_first, 3)))
