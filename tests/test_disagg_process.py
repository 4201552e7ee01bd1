"""Disaggregated serving with two real server processes: a prefill worker and a decode front that share a
KV store on disk. Outputs equal one engine's; the decode worker restores the prompt pages from the store."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import engine_toml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer import SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.errors import ConfigError
from serving.client import InferenceClient
from serving.server import load_configs

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
SYSTEM = "You are the harbour master's assistant. Answer briefly about ships, tides and the weather. " * 2


def start(tmp_path: Path, name: str, serve: str, store: Path) -> tuple[subprocess.Popen, str, int | None]:
    config = tmp_path / f"{name}.toml"
    config.write_text(f'[serve]\nhost = "127.0.0.1"\nport = 0\n{serve}\n' + engine_toml(kv_store=str(store)))
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--config", str(config)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    listening = json.loads(proc.stdout.readline())  # printed once bound, before the model loads
    return proc, f"127.0.0.1:{listening['port']}", listening["metrics_port"]


def wait_serving(proc: subprocess.Popen, target: str) -> None:
    deadline = time.time() + 300
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"{target} did not become SERVING")


@pytest.fixture()
def workers(tmp_path):
    store = tmp_path / "kv"
    prefill = start(tmp_path, "prefill", 'role = "prefill"\nmetrics_port = -1', store)
    decode = start(tmp_path, "decode", f'role = "decode"\nprefill_peers = ["{prefill[1]}"]\nmetrics_port = 0', store)
    procs = (prefill[0], decode[0])
    try:
        wait_serving(prefill[0], prefill[1])
        wait_serving(decode[0], decode[1])
        yield decode[1], decode[2], procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def generated(client: InferenceClient, prompt: str, **sampling) -> tuple[list[int], str, object]:
    ids, text, last = [], [], None
    for last in client.stream(prompt, **sampling):
        ids += last.token_ids
        text.append(last.text)
    return ids, "".join(text), last


def test_prefill_and_decode_processes_give_the_single_engine_output(workers, smollm2_llm):
    target, metrics_port, procs = workers
    single = Engine(smollm2_llm.runner, smollm2_llm.tokenizer, smollm2_llm.max_model_len, prefix_caching=False)
    cases = [
        (SYSTEM + "When does the ferry leave?", dict(max_tokens=12, temperature=0.0, ignore_eos=True)),
        (SYSTEM + "Is a storm coming?", dict(max_tokens=10, temperature=0.9, top_k=40, seed=11, ignore_eos=True)),
        (SYSTEM + "Name one ship.", dict(max_tokens=1, temperature=0.0)),  # ends on the prefill worker
    ]
    page = 8
    with InferenceClient(target, timeout=300) as client:
        for prompt, sampling in cases:
            expected = single.generate([smollm2_llm.request(prompt, SamplingParams(**sampling))])[0]
            ids, text, last = generated(client, prompt, **sampling)
            assert ids == expected.token_ids and text == expected.text
            assert last.usage.completion_tokens == len(expected.token_ids)
            if sampling["max_tokens"] > 1:  # decoded here from the pages the prefill worker stored
                assert last.usage.cached_tokens == len(expected.prompt_token_ids) // page * page
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        scraped = response.read().decode()
    restored = re.search(r'^jaxinfer_kv_tier_hit_tokens_total\{tier="l3"\} (\S+)$', scraped, re.M)
    # The first prompt's pages come from the store; the second finds the shared part on the device.
    assert restored and float(restored.group(1)) >= 5 * page
    for proc in procs:
        proc.terminate()
    assert [proc.wait(timeout=60) for proc in procs] == [0, 0]
    prefill_log = [json.loads(line) for line in procs[0].stderr.read().splitlines() if line.startswith("{")]
    assert not prefill_log or all(entry.get("status") != "error" for entry in prefill_log)


def test_roles_are_checked_at_start(tmp_path):
    config = tmp_path / "serve.toml"
    for serve, engine, wrong in [
        ('role = "decode"\nprefill_peers = ["127.0.0.1:1"]', "", "engine.kv_store"),
        ('role = "decode"', 'kv_store = "kv"', "serve.prefill_peers"),
        ('role = "prefill"\nprefill_peers = ["127.0.0.1:1"]', 'kv_store = "kv"', "serve.prefill_peers"),
        ('role = "router"', "", "serve.role"),
        ('role = "decode"\nprefill_peers = ["127.0.0.1:1"]\nprefill_timeout_seconds = 0', 'kv_store = "kv"',
         "serve.prefill_timeout_seconds must be a positive number"),
        ('role = "decode"\nprefill_peers = ["127.0.0.1:1"]\nprefill_tls_ca = "/nowhere/ca.pem"', 'kv_store = "kv"',
         "serve.prefill_tls_ca: no such file"),
    ]:
        config.write_text(f"[serve]\n{serve}\n[engine]\n{engine}\n")
        with pytest.raises(ConfigError, match=re.escape(wrong)):
            load_configs(config)


def test_a_router_with_no_live_peer_hands_the_request_back_for_local_prefill():
    import asyncio
    import socket

    from jaxinfer.engine.params import Request
    from serving.disagg import PrefillRouter

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"

    async def route():
        router = PrefillRouter((dead, dead))
        try:
            request = Request([1, 2, 3], SamplingParams(max_tokens=4))
            return await router.prefill(request, (), timeout=5), router.remote, router.local
        finally:
            await router.close()

    assert asyncio.run(route()) == (None, 0, 1)
