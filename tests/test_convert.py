"""tools/convert.py turns the real SmolLM2 GGUF into an orbax checkpoint the engine serves unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from conftest import TEST_ENGINE
from servers import RunningServer

from jaxinfer import LLM, SamplingParams
from jaxinfer.weights import self_test
from jaxinfer.weights.registry import resolve
from serving.client import AsyncInferenceClient

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("convert") / "smollm2-orbax"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert.py"), "--model", "smollm2-135m",
                           "--output", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def restored(converted):
    return LLM(converted, **TEST_ENGINE)


def test_convert_gguf_to_orbax_and_serve(converted, restored, smollm2_llm):
    assert resolve(converted).kind == "orbax"
    chat = [[{"role": "user", "content": "Name two planets."}], [{"role": "user", "content": "What is 3+4?"}]]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    assert [o.token_ids for o in restored.generate_chat(chat, greedy)] == [
        o.token_ids for o in smollm2_llm.generate_chat(chat, greedy)
    ]
    assert restored.tokenizer.eos_ids == smollm2_llm.tokenizer.eos_ids
    assert restored.tokenizer.encode_chat(chat[0]) == smollm2_llm.tokenizer.encode_chat(chat[0])


def test_convert_reports_a_bad_model_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert.py"), "--model", "nope-1b",
                           "--output", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown model 'nope-1b'" in proc.stderr and "smollm2-135m" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_fingerprint_is_the_original_models_greedy_output(converted, smollm2_llm):
    stored = self_test.stored(converted)
    greedy = SamplingParams(max_tokens=self_test.MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert stored["token_ids"] == smollm2_llm.generate([self_test.PROMPT], greedy)[0].token_ids
    assert stored["dtype"] == "float32" and len(stored["top2"]) == self_test.MAX_TOKENS


def serving_status(llm, model: Path) -> tuple[str, str]:
    """Health after a server's load, and what a Generate call gets."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = RunningServer(llm, model=str(model))
    try:
        server.call(server.server.load())
        with grpc.insecure_channel(server.target) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status

        async def generate() -> str:
            async with AsyncInferenceClient(server.target) as client:
                try:
                    await client.generate("hi", max_tokens=2)
                except grpc.aio.AioRpcError as exc:
                    return f"{exc.code().name}: {exc.details()}"
                return "OK"

        return health_pb2.HealthCheckResponse.ServingStatus.Name(status), server.call(generate())
    finally:
        server.close()


def test_a_server_serves_only_when_the_self_test_passes(converted, restored):
    assert serving_status(restored, converted) == ("SERVING", "OK")
    original = (converted / self_test.FILE).read_text()
    tampered = json.loads(original)
    tampered["token_ids"][2] += 1  # what weights restored wrongly would give
    tampered["top2"][2] = [[0, -0.1], [1, -5.0]]  # no near tie there
    (converted / self_test.FILE).write_text(json.dumps(tampered))
    try:
        status, call = serving_status(restored, converted)
    finally:
        (converted / self_test.FILE).write_text(original)
    assert status == "NOT_SERVING"
    assert call.startswith("UNAVAILABLE: self-test failed: token 2 of the greedy output"), call


def test_a_near_tie_that_flips_is_not_a_mismatch():
    expected = {"prompt": "p", "token_ids": [5, 6, 7], "top2": [[[5, -0.1], [9, -3.0]], [[6, -0.70], [8, -0.72]],
                                                               [[7, -0.1], [1, -4.0]]]}
    assert self_test.mismatch(expected, {"token_ids": [5, 8, 3]}) is None  # the tie at step 1 flipped
    assert "token 1" in self_test.mismatch(expected, {"token_ids": [5, 4, 7]})  # not the runner-up
    assert "token 0" in self_test.mismatch(expected, {"token_ids": [9, 6, 7]})  # no tie at step 0
