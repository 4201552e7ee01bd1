"""XLA flags jaxinfer sets for the process before any backend starts: on a CPU-only install, XLA's
CPU scheduler orders for memory instead of concurrency.

On the CPU, XLA's concurrency-optimized scheduler (on by default) orders a computation so that
independent work can run at once, and keeps every temporary that order needs alive together. A step
over packed weights then holds every layer's dequantized weight at the same time: SmolLM2's packed
step had 538 MB of temporaries (the whole float32 model) and a decode step took 205 ms on 2 cores
(tests/harness.py's forward). With it off, XLA schedules for memory: 3.6 MB (one weight chunk,
layers/chunked_matmul.py) and 42 ms; the float32 step was no slower (docs/benchmarks.md, "CPU:
packed weights"). The flag cannot be passed per compilation (`jax.jit(compiler_options=...)` leaves
it on), so it goes into `XLA_FLAGS`. An install with a GPU or TPU plugin is left alone, and so is a
process that set the flag itself.
"""

from __future__ import annotations

import importlib.util
import os

CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin", "libtpu")


def cpu_only_install() -> bool:
    return not any(importlib.util.find_spec(name) for name in ACCELERATOR_PLUGINS)


def prefer_memory_scheduling() -> bool:
    """Adds the flag to `XLA_FLAGS` on a CPU-only install (effective if no backend has started yet);
    returns whether it is set now."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_concurrency_optimized_scheduler" in flags:
        return CPU_SCHEDULER_FLAG in flags
    if not cpu_only_install():
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}".strip()
    return True
