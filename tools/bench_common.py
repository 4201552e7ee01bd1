"""What the benchmark tools share: JSON lines out, the model loaded, seeded random prompts, exact-length requests,
timed engines.

`bench.py`, its benchmark families (`bench_throughput.py`, `bench_kv.py`, `bench_features.py`, `bench_compute.py`),
`bench_peers.py`, `shape_bench.py` and `step_profile.py` import it; it imports none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import weakref

import numpy as np


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


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


def random_prompts(llm, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, llm.model_config.vocab_size - 1, n).tolist() for n in lengths]


def exact(n: int):
    from jaxinfer import SamplingParams

    return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)


_COMPILE_MARKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> XLA compile count at its start


def fresh_engine(llm, **flags):
    """A new engine on the loaded model's runner; `step_summary` counts the XLA compiles from here."""
    from jaxinfer.engine.engine import Engine
    from jaxinfer.engine.xla_compiles import XLA_COMPILES

    engine = Engine(llm.runner, llm.tokenizer, llm.max_model_len, **flags)
    _COMPILE_MARKS[engine] = XLA_COMPILES.mark()
    return engine


def timed_generate(engine, requests) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = engine.generate(requests)
    return time.perf_counter() - start, outputs


def step_summary(engine) -> dict:
    from jaxinfer.engine.xla_compiles import XLA_COMPILES

    m = engine.metrics()
    return dict(steps=m["steps"], tokens_per_step=round(m["tokens_per_step"], 1), step_ms=round(m["step_ms"], 1),
                host_ms_per_step=round(m["host_ms_per_step"], 2), host_fraction=round(m["host_fraction"], 4),
                discarded_samples=m["discarded_samples"], compiles_after_warmup=engine.runner.compiles_after_warmup,
                xla_compiles=XLA_COMPILES.since(_COMPILE_MARKS[engine]))
