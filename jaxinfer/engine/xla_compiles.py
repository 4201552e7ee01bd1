"""Every XLA compile in this process, whatever asked for it: the step programs, the processor's and the
KV tiers' programs, and an eager operation run for the first time (each compiles a small program).

The runner's compile guard sees only the step programs it compiles itself; this count is how the batch
runner, the server and the benchmarks check that nothing at all compiles after warm-up. `jax.monitoring`
listeners are process-wide, so there is one shared counter per process, listening from its first mark.
A persistent-cache hit counts too: JAX reports the same event around compile-or-load.
"""

from __future__ import annotations

import threading

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class XlaCompiles:
    def __init__(self) -> None:
        self.total = 0
        self._listening = False
        self._lock = threading.Lock()

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with self._lock:
                self.total += 1

    def mark(self) -> int:
        """The count now (starting to listen on the first call): pass it to `since`."""
        with self._lock:
            if not self._listening:
                jax.monitoring.register_event_duration_secs_listener(self._on_event)
                self._listening = True
            return self.total

    def since(self, mark: int) -> int:
        return self.total - mark


XLA_COMPILES = XlaCompiles()
