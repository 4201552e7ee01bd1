"""What the benchmark tools share: JSON lines out, seeded random prompts, exact-length requests, timed engines.

`bench.py`, `shape_bench.py` and `step_profile.py` import it; it imports none of them.
"""

from __future__ import annotations

import json
import time
import weakref

import numpy as np


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


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
