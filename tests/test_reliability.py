"""The reliability campaign's short versions (docs/reliability.md): a fuzz run and a soak against one real
server process, kills of a KV store writer, and the checks themselves failing on what they must catch
(an unclear status, a request still holding pages)."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO, TEST_ENGINE, engine_toml

sys.path.insert(0, str(REPO / "tools"))

import fuzz_serving
import kv_fault
import soak
from serve_probe import start_server

from jaxinfer.engine.held import held_resources, leaks
from jaxinfer.engine.params import SamplingParams

MAX_MODEL_LEN = 1024
SECONDS = "45"  # each of the fuzz run and the soak (the long runs: docs/reliability.md)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The test engine with every per-request resource in play: penalties, processor slots, the exec adapter."""
    config = tmp_path_factory.mktemp("reliability") / "serve.toml"
    engine = engine_toml(exec_slots=2, max_adapters=1, adapters=["smollm2-135m-exec"], compile_guard="warn",
                         max_model_len=MAX_MODEL_LEN)
    config.write_text('[serve]\nmodel = "smollm2-135m"\nmax_queued = 64\ngrace_seconds = 5\n' + engine)
    server = start_server(str(config), metrics=True)
    yield server
    assert server.stop() == 0


@pytest.mark.slow
def test_a_fuzz_run_ends_every_call_clearly_and_leaves_nothing_held(served, capsys):
    status = fuzz_serving.main(["--target", served.target, "--http-target", served.http_target, "--metrics",
                                served.metrics_target, "--seconds", SECONDS, "--max-model-len", str(MAX_MODEL_LEN),
                                "--call-timeout", "20"])
    result = capsys.readouterr().out
    assert status == 0, result
    assert '"held_after": {}' in result and '"unclear_statuses": 0' in result
    assert served.proc.poll() is None


@pytest.mark.slow
def test_a_soak_matches_its_references_and_leaves_nothing_held(served, capsys):
    status = soak.main(["--target", served.target, "--metrics", served.metrics_target, "--pid",
                        str(served.proc.pid), "--seconds", SECONDS, "--streams", str(2 * TEST_ENGINE["max_seqs"]),
                        "--prompts", "10", "--sample-every", "2"])
    result = capsys.readouterr().out
    assert status == 0, result
    assert '"mismatches": 0' in result and '"compiles_after_warmup": 0.0' in result


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["file", "ocdbt"])
def test_kv_store_writers_killed_at_random_leave_a_whole_store(driver, capsys):
    status = kv_fault.main(["--trials", "3", "--driver", driver, "--seed", "7"])
    result = capsys.readouterr().out
    assert status == 0, result
    assert '"served_corrupt": 0' in result and '"lost_done": 0' in result


@pytest.mark.parametrize("code, details, problem", [
    ("INTERNAL", "Exception calling application", "status INTERNAL"),
    ("UNKNOWN", "", "status UNKNOWN"),
    ("INVALID_ARGUMENT", "", "no message"),
    ("INVALID_ARGUMENT", "something is wrong", "names no field"),
    ("RESOURCE_EXHAUSTED", "", "no message"),
])
def test_the_fuzzer_calls_unclear_what_is_unclear(code, details, problem):
    assert problem in fuzz_serving.grpc_problem(code, details, {"max_tokens", "prompt"})


def test_the_fuzzer_accepts_clear_statuses():
    names = {"max_tokens"}
    assert fuzz_serving.grpc_problem("INVALID_ARGUMENT", "max_tokens: must be at least 1", names) is None
    assert fuzz_serving.grpc_problem("CANCELLED", "", names) is None
    assert fuzz_serving.http_problem(400, b'{"error": {"message": "bad", "param": "n"}}', names) is None
    assert "HTTP 500" in fuzz_serving.http_problem(500, b"Internal Server Error", names)
    assert "without an error object" in fuzz_serving.http_problem(422, b"nope", names)


def test_held_counts_see_a_running_request_and_its_release(smollm2_llm):
    engine = smollm2_llm.engine
    assert not leaks(engine.metrics())
    seq = engine.add_request(smollm2_llm.request("a river", SamplingParams(max_tokens=8, temperature=0.0,
                                                                            repetition_penalty=1.2)))
    engine.step()
    held = held_resources(engine)
    assert held["held_sequences"] == 1 and held["held_kv_pages"] >= 1 and held["held_penalty_slots"] == 1
    engine.abort(seq.index)
    while engine.has_unfinished():
        engine.step()
    assert not leaks(engine.metrics())
