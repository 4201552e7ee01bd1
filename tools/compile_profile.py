"""A pytest plugin that sums JAX's compile events per test file: where the suite's compile time goes.

    PYTHONPATH=tools .venv/bin/python -m pytest -p compile_profile -n 2 --dist loadfile ...

Each pytest process (each xdist worker) writes `<prefix>.<worker>.json` at the end, prefix from
$COMPILE_PROFILE_OUT (default /tmp/compile_profile): per test file, per `jax.monitoring` duration
event (backend compile, tracing, lowering, persistent cache hits), the seconds and the count. Module
and session fixtures count toward the file of the test that first needs them. Child processes that
tests start are not counted.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any

import jax.monitoring

_seconds: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
_counts: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
_current_file = ["(collection)"]


def _record(event: str, duration: float, **_: Any) -> None:
    _seconds[_current_file[0]][event] += duration
    _counts[_current_file[0]][event] += 1


jax.monitoring.register_event_duration_secs_listener(_record)


def pytest_runtest_setup(item: Any) -> None:
    _current_file[0] = item.path.name


def pytest_sessionfinish(session: Any) -> None:
    prefix = os.environ.get("COMPILE_PROFILE_OUT", "/tmp/compile_profile")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    report = {name: {event: [round(seconds, 2), _counts[name][event]] for event, seconds in events.items()}
              for name, events in _seconds.items()}
    with open(f"{prefix}.{worker}.json", "w") as out:
        json.dump(report, out, indent=1)
