"""Multi-host start-up: which process this is, and `jax.distributed.initialize` for the group.

Every host of a pod slice runs the same program on its local chips (JAX's multi-controller SPMD).
A `ProcessGroup` comes from command-line flags (`--coordinator HOST:PORT --num-processes N
--process-id I`), else from the environment (`JAXINFER_COORDINATOR`, `JAXINFER_NUM_PROCESSES`,
`JAXINFER_PROCESS_ID`). `--coordinator auto` lets JAX read the platform's own settings (TPU pod
slices, SLURM, ...). Process 0 is the leader: it runs the scheduler and the front end.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

import jax

from jaxinfer.errors import ConfigError

log = logging.getLogger(__name__)

AUTO = "auto"
ENV_COORDINATOR = "JAXINFER_COORDINATOR"
ENV_NUM_PROCESSES = "JAXINFER_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXINFER_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """The processes that drive one mesh together ("" coordinator: a single process)."""

    coordinator: str = ""
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self) -> None:
        if self.coordinator == AUTO:
            return
        if self.num_processes < 1:
            raise ConfigError(f"--num-processes must be at least 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ConfigError(f"--process-id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.num_processes > 1 and not self.coordinator:
            raise ConfigError("--coordinator HOST:PORT is needed with --num-processes > 1")
        if self.coordinator:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--coordinator must be HOST:PORT or auto, got {self.coordinator!r}")

    @property
    def distributed(self) -> bool:
        return self.coordinator == AUTO or self.num_processes > 1

    @property
    def coordinator_host(self) -> str:
        return self.coordinator.rpartition(":")[0].strip("[]") if self.coordinator != AUTO else ""

    @classmethod
    def resolve(cls, coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
                environ: Mapping[str, str] = os.environ) -> ProcessGroup:
        """Flags first, then the environment, then a single process."""
        def number(value: int | None, name: str, default: int) -> int:
            if value is not None:
                return value
            text = environ.get(name, "")
            if not text:
                return default
            if not text.isdigit():
                raise ConfigError(f"{name} must be a non-negative integer, got {text!r}")
            return int(text)

        coordinator = coordinator if coordinator is not None else environ.get(ENV_COORDINATOR, "")
        return cls(coordinator, number(num_processes, ENV_NUM_PROCESSES, 1), number(process_id, ENV_PROCESS_ID, 0))


def initialize(group: ProcessGroup) -> ProcessGroup:
    """Joins the group (before any device is touched; once) and returns it with JAX's process id and count.

    On the CPU, cross-process collectives go through gloo; the setting does nothing on GPU and TPU."""
    if not group.distributed:
        return group
    first_join = not jax.distributed.is_initialized()
    if first_join:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if group.coordinator == AUTO:
            jax.distributed.initialize()
        else:
            jax.distributed.initialize(group.coordinator, group.num_processes, group.process_id)
    joined = dataclasses.replace(group, num_processes=jax.process_count(), process_id=jax.process_index())
    if first_join:  # callers that join an already joined group (the batch runner, then `LLM`) log once
        log.info("process %d of %d joined; %d local of %d devices", joined.process_id, joined.num_processes,
                 jax.local_device_count(), jax.device_count())
    return joined


def key_value_store():
    """The coordination service's key-value store (shared by the group; used to find the leader)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise ConfigError("the process group is not initialized (jax.distributed.initialize)")
    return client
