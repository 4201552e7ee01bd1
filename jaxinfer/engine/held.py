"""What an engine still holds on behalf of requests: sequences, a step in flight, referenced KV pages
and the per-request slots (penalty counts, processor slots and waiting programs, grammar mask rows).

Every count is 0 when no request is left, whatever ran before: pages kept only by the prefix cache
are free (any request may take them), so they are not counted. The reliability tools (tools/soak.py,
tools/fuzz_serving.py) read these counts from `Engine.metrics()` (`held_*`) and from `/metrics`
(`jaxinfer_held{resource=...}`) to prove that a run leaked nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

HELD_PREFIX = "held_"


def held_resources(engine: Any) -> dict[str, int]:
    """The engine's holds as `held_<resource>` counts; a `Replicas` sums its engines' and counts each
    runner's slots once (engines may share a runner)."""
    engines = getattr(engine, "engines", None) or [engine]
    holds = [_engine_holds(one) for one in engines] + [_runner_holds(r) for r in distinct_runners(engines)]
    return {HELD_PREFIX + key: value for key, value in summed(holds).items()}


def distinct_runners(engines: Iterable[Any]) -> list[Any]:
    """The engines' runners, each once (engines may share one)."""
    return list({id(one.runner): one.runner for one in engines}.values())


def summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Each key's total over `counts`."""
    totals: dict[str, int] = {}
    for count in counts:
        for key, value in count.items():
            totals[key] = totals.get(key, 0) + value
    return totals


def _engine_holds(engine: Any) -> dict[str, int]:
    scheduler, pool, executor = engine.scheduler, engine.pool, engine.executor
    return {
        "sequences": len(scheduler.running) + len(scheduler.waiting),
        "steps_in_flight": int(engine._inflight is not None),
        "kv_pages": pool.capacity - pool.num_free,
        "exec_slots": executor.unit.shape.slots - len(executor.unit.free) if executor is not None else 0,
        "exec_waiting": len(executor.pending) if executor is not None else 0,
    }


def _runner_holds(runner: Any) -> dict[str, int]:
    return {"penalty_slots": runner.penalty_slots_in_use,
            "guide_mask_rows": runner.cfg.guided_host_rows - len(runner.free_mask_rows)}


def leaks(metrics: dict[str, float]) -> dict[str, float]:
    """The `held_*` entries of a metrics snapshot that are not 0 (empty: nothing leaked)."""
    return {key: value for key, value in metrics.items() if key.startswith(HELD_PREFIX) and value}
