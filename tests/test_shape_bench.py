"""`tools/bench.py shape` on the CPU: a random-weight model shape through the real engine, in a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_shape_benchmark_runs_a_random_weight_shape_and_reports_the_roofline() -> None:
    command = [sys.executable, str(REPO / "tools" / "bench.py"), "--no-peer", "shape", "--shape", "tiny-llama3",
               "--batch", "1", "3", "--in-len", "24", "--decode-tokens", "4", "--offline", "5:8:6",
               "--profile-steps", "2"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by_kind: dict[str, list[dict]] = {}
    for record in records:
        by_kind.setdefault(record["what"], []).append(record)
    env = by_kind["jaxinfer_shape_env"][0]
    assert env["shape"] == "tiny-llama3" and env["attention"] == "reference" and env["dtype"] == "float32"
    assert by_kind["ceilings"][0]["matmul_tflops"] > 0 and by_kind["ceilings"][0]["copy_tb_per_s_rw"] > 0
    steps = by_kind["jaxinfer_decode_step"]
    assert [s["batch"] for s in steps] == [1, 3]
    # tiny-llama3: 2 layers of 128 wide, an untied 128256 x 128 head; the weight bytes are float32
    expected_weights = 4 * (128256 * 128 + 2 * (128 * (128 + 64 + 64 + 128) + 3 * 128 * 256 + 2 * 128) + 128)
    for step in steps:
        assert step["weight_bytes"] == expected_weights
        assert step["ms_per_step"] > 0 and step["fraction_of_roofline"] > 0
        assert step["floor_ms"] == max(step["memory_floor_ms"], step["compute_floor_ms"])
        assert step["compiles_after_warmup"] == 0 and step["xla_compiles"] == 0  # no program of any kind
    profiles = by_kind["step_profile"]
    assert [p["batch"] for p in profiles] == [1, 3]
    for profile in profiles:  # the trace of 2 decode steps, read back per kernel
        assert profile["wall_ms_per_step"] > 0 and profile["device_busy_ms_per_step"] > 0
        assert profile["kernels"] and sum(k["share"] for k in profile["kernels"]) <= 1.001
        assert sum(c["ms_per_step"] for c in profile["categories"].values()) == pytest.approx(
            profile["device_busy_ms_per_step"], abs=0.01)
    offline = by_kind["jaxinfer_offline"][0]
    assert offline["new_tokens"] == 5 * 6 and offline["compiles_after_warmup"] == offline["xla_compiles"] == 0
