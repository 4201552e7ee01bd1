"""Benchmarks of compiled pieces rather than workloads: XLA's GEMM rate on SmolLM2's MLP shapes, the jitted
sampler alone and with each filter, and what an engine start pays to load, trace and lower its step.
"""

from __future__ import annotations

import argparse
import time

from bench_common import emit


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
