"""Benchmarks: jaxinfer on SmolLM2-135M, each with its transformers peer run in the same command.

    python tools/bench.py uniform --batch 1 8       # B prompts of one length; peer: ../shared/bench/hf_peer.py
    python tools/bench.py offline                   # 64 prompts of 16-256 tokens, 64 new; overlap on/off vs HF
    python tools/bench.py shared-prefix             # 32 requests after one 512-token system prompt: TTFT
    python tools/bench.py host                      # host share of the step wall time at batch 32
    python tools/bench.py all                       # offline, shared-prefix and host (what `make bench` runs)
    python tools/bench.py gemm                      # XLA's GEMM rate on SmolLM2's MLP shapes (the compute ceiling)
    python tools/bench.py penalties                 # batch 32 with no, half and all rows penalized
    python tools/bench.py scoring                   # 64 prompts scored (prompt_logprobs) vs unscored, vs HF forward
    python tools/bench.py tiers                     # TTFT of a 2,048-token prefix: recomputed, L1, L2, L3 (file)
    python tools/bench.py disagg                    # prefill/decode hand-off through the file store vs one engine
    python tools/bench.py spec                      # speculative decoding vs none, batch 1 and 8, 128 new tokens
    python tools/bench.py processor                 # WebAssembly processor instructions/s vs wasmtime
    python tools/bench.py --no-peer shape           # llama3-8b shape, random weights: decode vs roofline, offline
    python tools/bench.py --no-peer start           # engine start on a warm compilation cache: load, lower, read

Prints one JSON line per measurement and the ratios to the peer. Prompts are random token ids
(seeded); throughput runs generate exactly the asked number of tokens (EOS ignored), as the peers
do. Each jaxinfer measurement is preceded by a short run that touches every bucket it will use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import processor_bench
import shape_bench
from bench_common import emit, exact, fresh_engine, random_prompts, step_summary, timed_generate

REPO = Path(__file__).resolve().parents[1]
SHARED_PEER = REPO.parent / "shared" / "bench" / "hf_peer.py"
OFFLINE_PEER = REPO / "tools" / "hf_offline_peer.py"


def load_llm(args: argparse.Namespace):
    import jax

    from jaxinfer import LLM

    start = time.perf_counter()
    llm = LLM(args.model, args.config)
    emit(dict(what="jaxinfer_env", jax=jax.__version__, backend=jax.default_backend(), devices=len(jax.devices()),
              cpus=os.cpu_count(), model=args.model, dtype=np.dtype(llm.dtype).name,
              load_s=round(llm.load_seconds, 1), warmup_s=round(llm.warmup_seconds, 1),
              compiles=llm.runner.num_compiles, buckets=list(llm.config.token_buckets),
              max_seqs=llm.config.max_seqs, startup_s=round(time.perf_counter() - start, 1)))
    return llm


def run_peer(command: list[str]) -> list[dict]:
    proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, TQDM_DISABLE="1"))
    if proc.returncode != 0:
        emit(dict(what="peer_error", stderr=proc.stderr[-2000:]))
        return []
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for record in records:
        emit(record)
    return records


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


def run_offline_peer(prompts: list[list[int]], hf_batches: list[int], *flags: str) -> list[tuple[int, dict]]:
    """tools/hf_offline_peer.py on `prompts` with `flags`, once per batch size: (batch size, record) pairs."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    try:
        return [(hf_batch, record) for hf_batch in hf_batches
                for record in run_peer([sys.executable, str(OFFLINE_PEER), f.name, *flags, "--batch", str(hf_batch)])]
    finally:
        os.unlink(f.name)


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


# -- gemm: the matmul ceiling of this backend on SmolLM2's shapes ------------------------------------
def bench_gemm(args: argparse.Namespace) -> None:
    """30 layers of SmolLM2's MLP (576 -> 2x1536 -> 576) as one jitted chain, at several row counts."""
    import jax
    import jax.numpy as jnp

    hidden, inter, layers = 576, 1536, 30
    up = [jnp.full((hidden, 2 * inter), 1e-3, jnp.float32) for _ in range(layers)]
    down = [jnp.full((inter, hidden), 1e-3, jnp.float32) for _ in range(layers)]

    @jax.jit
    def chain(x, up, down):
        for a, b in zip(up, down, strict=True):
            h = x @ a
            x = x + (h[:, :inter] * h[:, inter:]) @ b
        return x

    for rows in args.rows:
        x = jnp.ones((rows, hidden), jnp.float32)
        chain(x, up, down).block_until_ready()
        start = time.perf_counter()
        for _ in range(5):
            chain(x, up, down).block_until_ready()
        seconds = (time.perf_counter() - start) / 5
        flops = 2 * rows * layers * (hidden * 2 * inter + inter * hidden)
        emit(dict(what="xla_gemm_chain", backend=jax.default_backend(), rows=rows, ms=round(1000 * seconds, 1),
                  gflop_per_s=round(flops / seconds / 1e9, 1)))


# -- sampler: the on-device sampler alone, without filters and with each filter ---------------------
def bench_sampler(args: argparse.Namespace) -> None:
    """ms per jitted `sample()` call at temperature 0.8 on random logits: each filter, penalties, top_logprobs."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.engine.params import MAX_TOP_LOGPROBS
    from jaxinfer.engine.penalties import PenaltyInputs, penalize
    from jaxinfer.engine.sampler import MAX_BANNED, SamplingInputs, sample, top_logprobs

    @jax.jit
    def fn(logits, params, counts, penalties, wanted):
        return sample(logits, params, penalize(logits, counts, penalties)), top_logprobs(logits, wanted,
                                                                                          MAX_TOP_LOGPROBS)

    settings = [dict(), dict(top_p=0.9), dict(top_k=50), dict(min_p=0.05), dict(top_k=50, top_p=0.9),
                dict(penalties=True),  # every row: repetition 1.1, frequency and presence 0.5
                dict(top_logprobs=20)]  # every row: its 20 most likely ids
    for rows in args.rows:
        logits = jax.random.normal(jax.random.key(0), (rows, args.vocab)) * 3
        counts = jax.random.randint(jax.random.key(1), (rows, args.vocab), 0, 2, jnp.int32)
        for setting in settings:
            params = SamplingInputs(
                temperature=jnp.full(rows, 0.8), top_k=jnp.full(rows, setting.get("top_k", 0), jnp.int32),
                top_p=jnp.full(rows, setting.get("top_p", 1.0)), min_p=jnp.full(rows, setting.get("min_p", 0.0)),
                seed=jnp.arange(rows, dtype=jnp.uint32), step=jnp.zeros(rows, jnp.int32),
                banned=jnp.full((rows, MAX_BANNED), -1, jnp.int32))
            slots = jnp.arange(rows, dtype=jnp.int32) if setting.get("penalties") else jnp.full(rows, -1, jnp.int32)
            penalties = PenaltyInputs(slots, jnp.full(rows, 1.1), jnp.full(rows, 0.5), jnp.full(rows, 0.5))
            wanted = jnp.full(rows, setting.get("top_logprobs", 0), jnp.int32)
            jax.block_until_ready(fn(logits, params, counts, penalties, wanted))
            start = time.perf_counter()
            for _ in range(args.repeats):
                jax.block_until_ready(fn(logits, params, counts, penalties, wanted))
            emit(dict(what="sampler", backend=jax.default_backend(), rows=rows, vocab=args.vocab,
                      **{"top_k": 0, "top_p": 1.0, "min_p": 0.0, "penalties": False, "top_logprobs": 0, **setting},
                      ms=round((time.perf_counter() - start) / args.repeats * 1e3, 2)))


# -- tiers: a long shared prefix recomputed vs restored from each KV tier ---------------------------
def bench_tiers(args: argparse.Namespace, llm=None) -> None:
    from jaxinfer.kv.store import ModelIdentity, PageStore
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
    from jaxinfer.kv.store import ModelIdentity, PageStore
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


# -- spec: speculative decoding against plain decoding on chat prompts ---------------------------------
SPEC_QUESTIONS = ["What is the capital of France?", "Explain what a lighthouse does.", "Write a short poem about rain.",
                  "List five fruits and their colours.", "How do I boil an egg?", "Why is the sky blue?",
                  "Describe a cat in three sentences.", "What are the planets of the solar system?"]


def bench_spec(args: argparse.Namespace, llm=None) -> None:
    """tokens/s with and without a draft, same prompts and settings (greedy, exactly --out-len tokens)."""
    from flax import nnx

    from jaxinfer import LLM
    from jaxinfer.weights.draft import save_draft, truncated_weights

    llm = llm or load_llm(args)
    with tempfile.TemporaryDirectory() as folder:
        draft = args.draft_model
        if not draft:
            model = nnx.merge(llm.runner.graphdef, llm.runner.state)
            cfg, weights = truncated_weights(model, llm.model_config, args.draft_layers)
            save_draft(Path(folder), cfg, weights, source=f"first {args.draft_layers} layers")
            draft = folder
        spec = LLM(args.model, args.config, draft_model=draft, num_draft_tokens=args.num_draft_tokens,
                   draft_confidence=args.draft_confidence)
    params = exact(args.out_len)
    for batch in args.batch:
        chats = [[{"role": "user", "content": q}] for q in (SPEC_QUESTIONS * batch)[:batch]]
        results = {}
        for name, engine_llm in (("plain", llm), ("speculative", spec)):
            engine_llm.generate_chat(chats, exact(8))  # touches the buckets this batch uses
            before = dataclasses.replace(engine_llm.engine.stats)
            start = time.perf_counter()
            outputs = engine_llm.generate_chat(chats, params)
            seconds = time.perf_counter() - start
            stats = engine_llm.engine.stats
            results[name] = (sum(len(o.token_ids) for o in outputs) / seconds, outputs)
            if name == "speculative":
                proposed = stats.spec_proposed - before.spec_proposed
                accepted = stats.spec_accepted - before.spec_accepted
                rounds = stats.spec_rounds - before.spec_rounds
                draft_s = stats.spec_draft_seconds - before.spec_draft_seconds
        same = [o.token_ids for o in results["plain"][1]] == [o.token_ids for o in results["speculative"][1]]
        emit(dict(what="jaxinfer_spec", batch=batch, new_tokens=args.out_len, draft=str(args.draft_model or
                  f"smollm2-135m first {args.draft_layers} layers"), num_draft_tokens=args.num_draft_tokens,
                  draft_confidence=args.draft_confidence, plain_tok_s=round(results["plain"][0], 2),
                  spec_tok_s=round(results["speculative"][0], 2),
                  speedup=round(results["speculative"][0] / results["plain"][0], 3),
                  acceptance=round(accepted / max(proposed, 1), 3),
                  tokens_per_round=round((accepted + rounds) / max(rounds, 1), 2),
                  draft_time_share=round(draft_s / (args.out_len * batch / results["speculative"][0]), 3),
                  identical_greedy_output=same))


SPIN = '(module (func (export "main") (loop $l (br $l))))'


def _decode_with(llm, requests, extra=None) -> dict:
    """Runs `requests` to the end on llm's engine (with `extra` added and aborted after); tokens/s of `requests`."""
    from jaxinfer.processor.machine_state import SCALAR

    engine = llm.engine
    before = dataclasses.replace(engine.stats)
    extra_seq = engine.add_request(extra) if extra is not None else None
    sequences = [engine.add_request(r) for r in requests]
    start = time.perf_counter()
    while any(seq.finish_reason is None for seq in sequences):
        engine.step()
    seconds = time.perf_counter() - start
    executed = 0
    if extra_seq is not None:
        if extra_seq.exec_slot is not None:
            executed = int(engine.runner.exec_unit.scalars(extra_seq.exec_slot)[SCALAR["executed"]])
        engine.abort(extra_seq.index)
    while engine.has_unfinished():
        engine.step()
    steps = engine.stats.steps - before.steps
    tokens = sum(len(seq.output_ids) for seq in sequences)
    return dict(tok_s=round(tokens / seconds, 1), step_ms=round(1000 * (engine.stats.step_seconds -
                before.step_seconds) / max(steps, 1), 2), machine_instructions=executed,
                machine_instructions_per_s=round(executed / seconds))


def bench_exec(args: argparse.Namespace) -> None:
    """The processor's cost to co-batched sequences: decode tok/s without slots, with idle slots, and
    next to a program that runs the whole time (exec_steps_per_step machine iterations per step)."""
    from jaxinfer import LLM, SamplingParams

    plain = load_llm(args)
    start = time.perf_counter()
    with_slots = LLM(args.model, args.config, exec_slots=2, exec_steps_per_step=args.steps_per_step)
    emit(dict(what="jaxinfer_exec_env", exec_slots=2, exec_steps_per_step=args.steps_per_step,
              warmup_s=round(with_slots.warmup_seconds, 1), plain_warmup_s=round(plain.warmup_seconds, 1),
              startup_s=round(time.perf_counter() - start, 1)))
    prompts = random_prompts(plain, [args.in_len] * args.batch_size, seed=0)
    requests = [plain.request(p, exact(args.out_len)) for p in prompts]
    spinner = with_slots.request([{"special": "<|exec|>"}, SPIN, {"special": "<|/exec|>"}],
                                 SamplingParams(max_tokens=4, exec=True, exec_max_instructions=2**31 - 1))
    for llm in (plain, with_slots):  # touch every bucket the workload uses
        _decode_with(llm, requests[:2])
    results = {"no_slots": _decode_with(plain, requests), "idle_slots": _decode_with(with_slots, requests),
               "program_running": _decode_with(with_slots, requests, spinner)}
    emit(dict(what="jaxinfer_exec_overhead", batch=args.batch_size, in_len=args.in_len, out_len=args.out_len,
              **{f"{name}_{key}": value for name, result in results.items() for key, value in result.items()},
              idle_ratio=round(results["idle_slots"]["tok_s"] / results["no_slots"]["tok_s"], 3),
              running_ratio=round(results["program_running"]["tok_s"] / results["no_slots"]["tok_s"], 3)))


def _random_adapter(folder: Path, llm, rank: int, seed: int) -> None:
    """A rank-`rank` PEFT-layout adapter (random, small) on every projection `llm` adapts."""
    from jaxinfer.weights.adapter_file import lora_name, save_adapter

    rng, tensors = np.random.default_rng(seed), {}
    for module, linear in llm.runner.adapters.linears.items():
        fan_in, fan_out = linear.kernel[...].shape
        tensors[lora_name(module, "A")] = rng.normal(0, 0.02, (rank, fan_in)).astype(np.float32)
        tensors[lora_name(module, "B")] = rng.normal(0, 0.02, (fan_out, rank)).astype(np.float32)
    save_adapter(folder, {"r": rank, "lora_alpha": rank}, tensors, layout="peft")


def bench_lora(args: argparse.Namespace) -> None:
    """Resident LoRA adapters' cost to decoding: tok/s without adapter slots, with `--adapters` slots
    and every request on the base model, and with the requests spread over all the adapters."""
    import tempfile

    from jaxinfer import LLM

    plain = load_llm(args)
    lora = LLM(args.model, args.config, max_adapters=args.adapters, max_lora_rank=args.rank)
    emit(dict(what="jaxinfer_lora_env", adapters=args.adapters, rank=args.rank,
              warmup_s=round(lora.warmup_seconds, 1), plain_warmup_s=round(plain.warmup_seconds, 1)))
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.adapters):
            _random_adapter(Path(tmp) / str(i), lora, args.rank, seed=i)
            lora.load_adapter(f"a{i}", str(Path(tmp) / str(i)))
    prompts = random_prompts(plain, [args.in_len] * args.batch_size, seed=0)
    base = [plain.request(p, exact(args.out_len)) for p in prompts]
    mixed = [dataclasses.replace(r, adapter=f"a{i % args.adapters}") for i, r in enumerate(base)]
    for llm in (plain, lora):  # one untimed pass of the whole workload: every executable has run once
        _decode_with(llm, base)
    results = {"no_slots": _decode_with(plain, base), "slots_base": _decode_with(lora, base),
               "mixed_adapters": _decode_with(lora, mixed)}
    emit(dict(what="jaxinfer_lora_overhead", batch=args.batch_size, in_len=args.in_len, out_len=args.out_len,
              **{f"{name}_{key}": value for name, result in results.items() for key, value in result.items()
                 if key in ("tok_s", "step_ms")},
              slots_ratio=round(results["slots_base"]["tok_s"] / results["no_slots"]["tok_s"], 3),
              mixed_ratio=round(results["mixed_adapters"]["tok_s"] / results["no_slots"]["tok_s"], 3)))


def bench_start(args: argparse.Namespace) -> None:
    """Engine start on a warm compilation cache: loading, then per bucket the step's trace and lowering
    (paid at every start: the cache is looked up by the lowered module) and the rest of the warm-up."""
    import jax

    from jaxinfer import LLM

    LLM(args.model, args.config)  # fills the compilation cache
    for repeat in range(args.repeats):
        start = time.perf_counter()
        llm = LLM(args.model, args.config)
        total = time.perf_counter() - start
        runner = llm.runner
        jax.clear_caches()  # else `lower` finds the warm-up's trace
        lower_start = time.perf_counter()
        for bucket in llm.config.token_buckets:
            runner._jitted.lower(runner.graphdef, runner.state, runner.caches, runner.penalty_counts, runner.no_tokens,
                                 runner.abstract_inputs(bucket), *runner._exec_args())
        lower = time.perf_counter() - lower_start
        emit(dict(what="engine_start", repeat=repeat, start_s=round(total, 2), load_s=round(llm.load_seconds, 2),
                  warmup_s=round(llm.warmup_seconds, 2), trace_and_lower_s=round(lower, 2),
                  buckets=list(llm.config.token_buckets)))
        del llm, runner


def bench_all(args: argparse.Namespace) -> None:
    llm = load_llm(args)
    bench_offline(args, llm)
    bench_shared_prefix(args, llm)
    bench_host(args, llm)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--config", default=str(REPO / "configs" / "engine-cpu.toml"), help="engine TOML")
    p.add_argument("--no-peer", action="store_true")
    sub = p.add_subparsers(dest="workload", required=True)
    uniform = sub.add_parser("uniform")
    uniform.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    uniform.add_argument("--in-len", type=int, default=64)
    uniform.add_argument("--out-len", type=int, default=32)
    spec = sub.add_parser("spec")
    spec.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    spec.add_argument("--out-len", type=int, default=128)
    spec.add_argument("--draft-model", default="", help="default: the target's first --draft-layers layers")
    spec.add_argument("--draft-layers", type=int, default=2)
    spec.add_argument("--num-draft-tokens", type=int, default=4)
    spec.add_argument("--draft-confidence", type=float, default=0.0)
    exec_ = sub.add_parser("exec", description=bench_exec.__doc__.splitlines()[0])
    exec_.add_argument("--batch-size", type=int, default=8)
    exec_.add_argument("--in-len", type=int, default=32)
    exec_.add_argument("--out-len", type=int, default=64)
    exec_.add_argument("--steps-per-step", type=int, default=0, help="engine.exec_steps_per_step (0: by platform)")
    lora = sub.add_parser("lora", description=bench_lora.__doc__.splitlines()[0])
    lora.add_argument("--batch-size", type=int, default=8)
    lora.add_argument("--in-len", type=int, default=32)
    lora.add_argument("--out-len", type=int, default=64)
    lora.add_argument("--adapters", type=int, default=4, choices=range(1, 65), metavar="1..64")
    lora.add_argument("--rank", type=int, default=16)
    gemm = sub.add_parser("gemm")
    gemm.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64, 256])
    sampler = sub.add_parser("sampler", description=bench_sampler.__doc__.splitlines()[0])
    sampler.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    sampler.add_argument("--vocab", type=int, default=128256)
    sampler.add_argument("--repeats", type=int, default=5)
    shape_bench.add_arguments(sub.add_parser("shape", description=shape_bench.__doc__.splitlines()[0]))
    start = sub.add_parser("start", description=bench_start.__doc__.splitlines()[0])
    start.add_argument("--repeats", type=int, default=3)
    processor_bench.add_arguments(sub.add_parser("processor", description=processor_bench.__doc__.splitlines()[0],
                                                 epilog=processor_bench.ISSUE_SCALE))
    workloads = {"offline": bench_offline, "shared-prefix": bench_shared_prefix, "host": bench_host,
                 "tiers": bench_tiers, "disagg": bench_disagg, "penalties": bench_penalties, "scoring": bench_scoring,
                 "all": bench_all}
    for name in workloads:
        w = sub.add_parser(name)
        w.add_argument("--requests", type=int, default=64)
        w.add_argument("--prefix-requests", type=int, default=32)
        w.add_argument("--min-len", type=int, default=16)
        w.add_argument("--max-len", type=int, default=256)
        w.add_argument("--out-len", type=int, default=64)
        w.add_argument("--hf-batch", type=int, nargs="+", default=[64])
        w.add_argument("--prefix-len", type=int, default=512)
        w.add_argument("--batch-size", type=int, default=32)
        w.add_argument("--in-len", type=int, default=128)
        w.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.workload == "uniform":
        bench_uniform(args)
    elif args.workload == "gemm":
        bench_gemm(args)
    elif args.workload == "sampler":
        bench_sampler(args)
    elif args.workload == "spec":
        bench_spec(args)
    elif args.workload == "processor":
        processor_bench.bench(args)
    elif args.workload == "shape":
        shape_bench.bench(args)
    elif args.workload == "exec":
        bench_exec(args)
    elif args.workload == "lora":
        bench_lora(args)
    elif args.workload == "start":
        bench_start(args)
    else:
        workloads[args.workload](args)


if __name__ == "__main__":
    main()
