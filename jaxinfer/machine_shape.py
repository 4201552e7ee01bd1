"""The embedded processor's machine shape: its static sizes and loop kinds, as configuration data.

It sits below both the engine settings (`config.EngineConfig.exec_machine_shape`) and the machine
that compiles to it (`processor/machine.py`), so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

EXEC_LOOPS = ("auto", "while", "pallas")  # MachineShape.loop
PAGE_BYTES = 65536  # a WebAssembly memory page


@dataclass(frozen=True)
class MachineShape:
    """The static sizes one compiled machine serves."""

    slots: int
    code_length: int
    registers: int
    memory_pages: int
    max_depth: int
    trace_entries: int = 0  # per-slot trace buffer rows (0: tracing compiled out)
    # "auto": one kernel on the CPU, a while loop elsewhere; "while": the while loop everywhere;
    # "pallas": the Pallas kernel of gpu_kernel.py on CUDA GPUs (its interpreter on the CPU)
    loop: str = "auto"

    def __post_init__(self) -> None:
        if self.loop not in EXEC_LOOPS:
            raise ValueError(f"loop must be one of {EXEC_LOOPS}, got {self.loop!r}")

    @property
    def memory_bytes(self) -> int:
        return self.memory_pages * PAGE_BYTES
