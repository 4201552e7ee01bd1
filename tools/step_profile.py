"""Where a decode step's time goes: a `jax.profiler` trace of a few steps, summarized per kernel.

The shape benchmark calls `profile_decode` with ``--profile-steps N``. It prefills B prompts, then
traces N decode steps and reads the trace back with `jax.profiler.ProfileData`:

* the wall milliseconds per step, and the device's busy milliseconds per step (the kernels' summed
  durations); their gap is time the device waits for the host or between launches;
* the busiest kernels (ms per step, share of the busy time), and the same time in a few categories
  (attention, matmul, sort, other).

On a GPU or TPU the kernels are the device plane's events; on the CPU, the host's XLA ops.
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
import time

CATEGORIES = (("attention", re.compile(r"paged_attention|ragged|attention", re.I)),
              ("matmul", re.compile(r"gemm|matmul|dot|cublas|cutlass|xmma|wgmma", re.I)),
              ("sort", re.compile(r"sort|topk|top_k", re.I)))


def profile_decode(llm, batch: int, in_len: int, steps: int) -> dict:
    """Traces `steps` decode steps of `batch` sequences past their prefill and summarizes the trace."""
    import jax
    from bench_common import exact, fresh_engine, random_prompts

    engine = fresh_engine(llm, prefix_caching=False)
    sequences = [engine.add_request(llm.request(p, exact(steps + 3)))
                 for p in random_prompts(llm, [in_len] * batch, seed=batch + 1)]
    while min(len(seq.output_ids) for seq in sequences) < 1:  # prefill, untraced
        engine.step()
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            jax.block_until_ready(engine.runner.caches)  # the last step's outputs: it has run
            wall_ms = (time.perf_counter() - start) * 1e3 / steps
        kernels = kernel_times(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)[0])
    while engine.has_unfinished():
        engine.step()
    return summarize(kernels, steps, wall_ms)


def kernel_times(path: str) -> collections.Counter:
    """Nanoseconds per kernel name on the device planes (the host's XLA ops where there is no device)."""
    from jax.profiler import ProfileData

    planes = list(ProfileData.from_file(path).planes)
    device = [p for p in planes if p.name.startswith("/device:")]
    totals: collections.Counter = collections.Counter()
    for plane in device or [p for p in planes if p.name == "/host:CPU"]:
        lines = list(plane.lines)
        streams = [line for line in lines if line.name.startswith("Stream")]
        for line in streams or lines:
            for event in line.events:
                if device or any(key == "hlo_op" for key, _ in event.stats):
                    totals[event.name] += event.duration_ns
    return totals


def summarize(kernels: collections.Counter, steps: int, wall_ms: float, top: int = 12) -> dict:
    busy_ms = sum(kernels.values()) / 1e6 / steps
    share = (lambda ns: round(ns / 1e6 / steps / busy_ms, 3)) if busy_ms else (lambda ns: 0.0)
    by_category: collections.Counter = collections.Counter()
    for name, ns in kernels.items():
        by_category[next((c for c, pattern in CATEGORIES if pattern.search(name)), "other")] += ns
    return dict(wall_ms_per_step=round(wall_ms, 3), device_busy_ms_per_step=round(busy_ms, 3),
                busy_fraction=round(busy_ms / wall_ms, 3) if wall_ms else 0.0,
                categories={c: dict(ms_per_step=round(ns / 1e6 / steps, 3), share=share(ns))
                            for c, ns in by_category.most_common()},
                kernels=[dict(name=name[:80], ms_per_step=round(ns / 1e6 / steps, 3), share=share(ns))
                         for name, ns in kernels.most_common(top)])
