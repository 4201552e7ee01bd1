"""A served model for the load and reliability tools: `python -m serving` started as a real process on free
loopback ports, and what they read from outside it (health, the `/metrics` page, the `jaxinfer_held`
counts that prove nothing leaked, the process's resident memory).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Served:
    """A server process and its addresses; `metrics_target` is "" when its metrics port is off."""

    proc: subprocess.Popen
    target: str
    http_target: str
    metrics_target: str
    log_path: str

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (in-flight requests finish within the grace time), then the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def start_server(config: str, metrics: bool = False, extra: tuple[str, ...] = (), wait_s: float = 600.0) -> Served:
    """Starts the server with both APIs (its log in a temporary file) and waits until health says SERVING."""
    command = [sys.executable, "-m", "serving", "--config", config, "--port", "0", "--http-port", "0",
               "--metrics-port", "0" if metrics else "-1", *extra]
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
                                env=dict(os.environ))
    listening = json.loads(proc.stdout.readline() or "{}")
    if "port" not in listening:
        raise SystemExit(f"the server did not start; its log: {log.name}")
    metrics_port = listening.get("metrics_port") or 0
    served = Served(proc, f"127.0.0.1:{listening['port']}", f"127.0.0.1:{listening['http_port']}",
                    f"127.0.0.1:{metrics_port}" if metrics_port > 0 else "", log.name)
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited; its log: {log.name}")
        if health(served.target) == "SERVING":
            return served
        time.sleep(0.5)
    served.stop()
    raise SystemExit(f"the server did not become ready; its log: {log.name}")


def health(target: str, timeout: float = 5.0) -> str:
    """The overall health status's name (SERVING, NOT_SERVING, ...), or the RPC error's code name."""
    with grpc.insecure_channel(target) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def scrape(metrics_target: str, timeout: float = 10.0) -> dict[str, float]:
    """The `/metrics` samples by name, labels folded in as `name{key=value}`."""
    with urllib.request.urlopen(f"http://{metrics_target}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def held(samples: dict[str, float]) -> dict[str, float]:
    """The `jaxinfer_held` counts by resource (every one 0 when no request is left)."""
    prefix = "jaxinfer_held{resource="
    return {key[len(prefix):-1]: value for key, value in samples.items() if key.startswith(prefix)}


def wait_released(metrics_target: str, timeout: float = 30.0) -> dict[str, float]:
    """Polls until every held count is 0 (a cancel frees within a step); returns what is still held."""
    deadline = time.time() + timeout
    while True:
        counts = held(scrape(metrics_target))
        left = {key: value for key, value in counts.items() if value}
        if not counts:
            raise SystemExit("the server's /metrics has no jaxinfer_held series")
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


def rss_mb(pid: int) -> float:
    """Resident memory of a process, in MiB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_checked(serve_config: str | None, metrics: str | None, work: Callable[[Served | None, str], dict]) -> int:
    """Starts a server for `serve_config` (or uses the running one whose /metrics is `metrics`), runs
    `work(served, metrics)`, stops the server, prints the result as one JSON line; exit status 1 when
    the result lists failed checks."""
    served = start_server(serve_config, metrics=True) if serve_config else None
    try:
        metrics = served.metrics_target if served else metrics
        if not metrics:
            raise SystemExit("--metrics: the server's /metrics address is needed to check what is held")
        result = work(served, metrics)
    finally:
        if served is not None:
            served.stop()
    print(json.dumps(result), flush=True)
    return 1 if result["checks_failed"] else 0
