"""`python -m serving` as a real process: health transitions, structured request logs, SIGTERM drain, bad config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from conftest import engine_toml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.client import InferenceClient

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]

CONFIG = """
[serve]
model = "smollm2-135m"
host = "127.0.0.1"
port = 0
metrics_port = -1
grace_seconds = 60

""" + engine_toml()


def health(target: str) -> int | None:
    with grpc.insecure_channel(target) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return None


@pytest.fixture()
def served(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--config", str(config)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    listening = json.loads(proc.stdout.readline())
    target = f"127.0.0.1:{listening['port']}"
    states = [health(target)]
    deadline = time.time() + 300
    while states[-1] != health_pb2.HealthCheckResponse.SERVING and time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.2)
        states.append(health(target))
    yield proc, target, states
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_sigterm_drains_in_flight_requests_then_exits_zero(served):
    proc, target, states = served
    assert states[0] == health_pb2.HealthCheckResponse.NOT_SERVING  # answered while loading
    assert states[-1] == health_pb2.HealthCheckResponse.SERVING
    with InferenceClient(target, timeout=120) as client:
        stream = client.stream("Tell me a story about a lighthouse.", max_tokens=48, temperature=0.0,
                               ignore_eos=True)
        first = next(stream)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert health(target) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            client.generate("Hi", max_tokens=2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)  # the in-flight request still finishes
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 48
    assert rest[-1].finish_reason != 0
    assert proc.wait(timeout=60) == 0
    request_logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
    finished = [r for r in request_logs if r.get("status") == "ok"]
    assert finished and finished[-1]["completion_tokens"] == 48 and finished[-1]["tenant"] == "local"


def serve_once(tmp_path, config_text: str) -> subprocess.CompletedProcess:
    config = tmp_path / "serve.toml"
    config.write_text(config_text)
    return subprocess.run([sys.executable, "-m", "serving", "--config", str(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_a_bad_config_exits_2_naming_the_setting(tmp_path):
    proc = serve_once(tmp_path, '[serve]\nauth = true\nport = 0\n')
    assert proc.returncode == 2
    assert "serve.auth" in proc.stderr and "Traceback" not in proc.stderr


def test_a_model_that_fails_to_load_exits_2_naming_it(tmp_path):
    proc = serve_once(tmp_path, '[serve]\nmodel = "nope-1b"\nport = 0\nmetrics_port = -1\n')
    assert proc.returncode == 2
    assert "nope-1b" in proc.stderr and "Traceback" not in proc.stderr.split("error:")[-1]


def test_sigterm_while_the_model_loads_exits_at_once(tmp_path):
    """A SIGTERM right after the port is bound (the model still loading and warming up) ends the
    process with 0 without waiting for the load: before, the loading thread was joined at exit, so
    a pod being rescheduled held on for the whole load (minutes for a large model)."""
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--config", str(config)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        json.loads(proc.stdout.readline())  # listening: the load has just begun
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stderr.read()
    assert "stopped while the model was loading" in log and "Traceback" not in log
    assert "warm-up" not in log  # the load never finished: nothing waited for it


def test_the_http_server_process_serves_openai_clients_and_drains_on_sigterm(tmp_path):
    """`python -m serving.http`: /health 503 while loading, then an openai stream that SIGTERM lets finish."""
    import httpx2 as httpx
    import openai

    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    proc = subprocess.Popen([sys.executable, "-m", "serving.http", "--config", str(config), "--port", "0"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        listening = json.loads(proc.stdout.readline())
        assert listening["port"] == -1  # no gRPC port unless --grpc-port asks for one
        base = f"http://127.0.0.1:{listening['http_port']}"
        codes = [httpx.get(f"{base}/health").status_code]
        deadline = time.time() + 300
        while codes[-1] != 200 and time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
            codes.append(httpx.get(f"{base}/health").status_code)
        assert codes[0] == 503 and codes[-1] == 200
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(model="smollm2-135m", prompt="Tell me a story about a lighthouse.",
                                           max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = [next(stream)]
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert httpx.get(f"{base}/health").status_code == 503
        chunks += list(stream)  # the request in flight still finishes
        assert chunks[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
