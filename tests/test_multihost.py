"""Multi-host serving on the CPU with real processes: two processes of 1 CPU device each (gloo
collectives, coordinator on 127.0.0.1) run one model sharded over both devices in lockstep, with
LoRA adapters the leader reads and sends to the follower.

Also: a sharded orbax checkpoint saved from one layout restores into other mesh shapes, a leader
that stops takes its followers with it, a lost process or one with other weights stops the group with
a clear error, and host arrays reach the group's mesh without a cross-process check.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.parallel.lockstep import FOLLOWER_LOST_EXIT, LEADER_LOST_EXIT, REPLAY_FAILED_EXIT

REPO = Path(__file__).resolve().parents[1]
# The groups run 1 device a process: every layer's all-reduce crosses processes over gloo, and on 2 cores
# the main test's batch run (71 steps) took 92.6 s with 2 devices a process and 27.2 s with 1 (alone on
# the machine; 4 devices a process were slower still). Several local devices a process are covered by
# the transfer test, which is cheap.
DEVICES_PER_PROCESS = 1
# How long a group's start and its batch run may take. Each step waits on about 170 cross-process
# collectives, and each costs about a scheduler time slice when the 2 cores also run the other test
# worker: on a busy 2-core machine the main test's run took 202 s (71 steps) after a 200 s cold-cache
# warm-up, where alone it takes 27 s in all.
GROUP_SECONDS = 900
TRANSFER_DEVICES_PER_PROCESS = 2
ENGINE_SETTINGS = """max_seqs = 8
num_pages = 256
page_size = 8
compile_guard = "raise"
"""
ENGINE_TOML = "[engine]\ntoken_buckets = [8, 64]\n" + ENGINE_SETTINGS
# For the groups that only have to start and fail: one bucket, no adapters or processor, so each
# process's warm-up is one small program, and one line long enough (ignore_eos) to outlast the fault.
LIGHT_ENGINE_TOML = "[engine]\ntoken_buckets = [8]\n" + ENGINE_SETTINGS
LIGHT_LINE = {"id": "long", "prompt": "1, 2, 3, 4,", "max_tokens": 200, "ignore_eos": True}
ADAPTER_LINES = """max_adapters = 3
adapters = ["preloaded={preloaded}", "smollm2-135m-exec"]
exec_slots = 2
"""
LINES = [
    {"id": "capital", "prompt": "What is the capital of France?", "max_tokens": 12},
    {"id": "colors", "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 16},
    {"id": "count", "prompt": "1, 2, 3, 4,", "max_tokens": 20},
    {"id": "count-penalized", "prompt": "1, 2, 3, 4,", "max_tokens": 20, "repetition_penalty": 1.3,
     "frequency_penalty": 0.5},  # the leader sends the counts it loads, as it sends adapter loads
    # Scored prompt and a bias against "5" (id 37, the greedy continuation's first digit): step inputs only.
    {"id": "count-scored-biased", "prompt": "1, 2, 3, 4,", "max_tokens": 12, "prompt_logprobs": 2,
     "logit_bias": {"37": -100}},
    {"id": "story", "messages": [{"role": "user", "content": "Tell me a very long story about a fox."}],
     "max_tokens": 40},
    {"id": "adapted-preloaded", "prompt": "1, 2, 3, 4,", "max_tokens": 16, "adapter": "preloaded"},
    {"id": "adapted-line", "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 16,
     "adapter": "{line_adapter}"},
    # Guided output: the leader sends the automaton's table load like an adapter load, and every step
    # carries the grammar rows' bitmask; the follower must mask the same ids.
    {"id": "guided-schema", "prompt": "A person as JSON:", "max_tokens": 40, "guided": {"json_schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"]}}},
    {"id": "guided-grammar", "prompt": "Yes or no, in parentheses:", "max_tokens": 12,
     "guided": {"grammar": 'root ::= "yes" | "no" | "(" root ")"'}},
    {"id": "program", "messages": [{"role": "user", "content": "What is 48213 * 99817?"}], "max_tokens": 400,
     "adapter": "smollm2-135m-exec", "exec": True},  # the exec adapter writes a program; the group runs it
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_env(devices: int) -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The engine config, the input lines, and SmolLM2 converted to orbax sharded over 2 devices."""
    from test_batch_cli import write_random_adapter

    root = tmp_path_factory.mktemp("multihost")
    write_random_adapter(root / "lora-preloaded", seed=0)  # engine.adapters: loaded while the group loads
    write_random_adapter(root / "lora-line", seed=1)  # named by a line: loaded by the batch runner later
    (root / "engine.toml").write_text(ENGINE_TOML + ADAPTER_LINES.format(preloaded=root / "lora-preloaded"))
    lines = [{**line, "adapter": str(root / "lora-line")} if line.get("adapter") == "{line_adapter}" else line
             for line in LINES]
    (root / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (root / "light.toml").write_text(LIGHT_ENGINE_TOML)
    (root / "light.jsonl").write_text(json.dumps(LIGHT_LINE) + "\n")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert.py"), "--model", "smollm2-135m",
                           "--output", str(root / "orbax"), "--mesh-model", "2"], env=cpu_env(2),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


class Group:
    """`python -m jaxinfer.batch` started as processes 0..n-1 of one group; stderr goes to files."""

    def __init__(self, workdir: Path, *extra: str, processes: int = 2, name: str = "run", config: str = "engine.toml",
                 own_args: dict[int, tuple[str, ...]] | None = None, own_code: dict[int, str] | None = None):
        """`config`: the engine config in `workdir`; `own_args`: extra arguments of one process; `own_code`:
        Python run instead of `-m jaxinfer.batch` (with the same arguments), to inject a fault into one
        process."""
        self.port = free_port()
        self.logs = [workdir / f"{name}-{i}.log" for i in range(processes)]
        self.output = workdir / f"{name}.jsonl"
        args = ["--config", str(workdir / config), "--output", str(self.output), "--no-progress", "-v",
                "--coordinator", f"127.0.0.1:{self.port}", "--num-processes", str(processes), *extra]
        self.procs = []
        for i, log_path in enumerate(self.logs):
            with open(log_path, "w") as log_file:
                own = ("--process-id", str(i), *(own_args or {}).get(i, ()))
                launch = ["-c", own_code[i]] if i in (own_code or {}) else ["-m", "jaxinfer.batch"]
                self.procs.append(subprocess.Popen(
                    [sys.executable, *launch, *args, *own], cwd=REPO,
                    env=cpu_env(DEVICES_PER_PROCESS), stdout=subprocess.DEVNULL, stderr=log_file))

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def wait_for(self, i: int, text: str, timeout: float = GROUP_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(i):
            assert self.procs[i].poll() is None, f"process {i} exited early:\n{self.log(i)[-3000:]}"
            assert time.monotonic() < deadline, f"process {i} never logged {text!r}:\n{self.log(i)[-3000:]}"
            time.sleep(0.2)

    def wait(self, i: int, timeout: float = GROUP_SECONDS) -> int:
        return self.procs[i].wait(timeout)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def groups():
    started: list[Group] = []
    yield started
    for group in started:
        group.kill_all()


def token_ids(path: Path) -> dict[str, list[int]]:
    return {record["id"]: record["token_ids"] for record in map(json.loads, path.read_text().splitlines())}


def no_output_lines(group: Group) -> bool:
    """The batch output is appended as lines finish (opened when the run starts): a group stopped
    before its line finished leaves no file, or an empty one."""
    return not group.output.exists() or group.output.read_text() == ""


def test_two_processes_serve_one_sharded_model_like_one_process(workdir, groups):
    """Greedy output over 2 processes x 1 device (weights restored from the orbax checkpoint saved
    sharded over 2 devices) equals one process of 2 devices on the GGUF."""
    group = Group(workdir, "--model", str(workdir / "orbax"), "--input", str(workdir / "in.jsonl"),
                  "--stats-json", str(workdir / "stats.json"))
    groups.append(group)
    # The one-process run goes beside the group: the group's steps mostly wait on collectives.
    single = workdir / "single.jsonl"
    alone = subprocess.Popen([sys.executable, "-m", "jaxinfer.batch", "--config", str(workdir / "engine.toml"),
                              "--input", str(workdir / "in.jsonl"), "--output", str(single), "--no-progress"],
                             cwd=REPO, env=cpu_env(2 * DEVICES_PER_PROCESS), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        _, alone_stderr = alone.communicate(timeout=GROUP_SECONDS)
    finally:
        alone.kill()
    assert alone.returncode == 0, alone_stderr[-3000:]
    assert group.wait(0) == 0, group.log(0)[-3000:]
    assert group.wait(1) == 0, group.log(1)[-3000:]
    replayed = [line for line in group.log(1).splitlines() if "replayed" in line]
    assert replayed and int(replayed[-1].split()[3]) > 0, group.log(1)[-2000:]
    assert "lockstep leader at" in group.log(0)
    assert not (workdir / "run.jsonl.tmp").exists()
    # Nothing compiled after warm-up, the checks JAX runs on inputs sent across processes included.
    assert json.loads((workdir / "stats.json").read_text())["xla_compiles_after_warmup"] == 0

    expected = token_ids(single)
    assert sorted(expected) == sorted(line["id"] for line in LINES)
    assert all(expected.values())
    assert token_ids(group.output) == expected
    assert expected["adapted-preloaded"] != expected["count"][:16]  # the adapters changed the text
    assert expected["adapted-line"] != expected["colors"]
    assert expected["count-penalized"] != expected["count"]
    assert 37 in expected["count"] and 37 not in expected["count-scored-biased"]
    scored = [next(json.loads(line) for line in path.read_text().splitlines() if '"count-scored-biased"' in line)
              for path in (single, group.output)]
    assert scored[0]["prompt_logprobs"][0] is None
    assert len(scored[0]["prompt_top_logprobs"]) == scored[0]["usage"]["prompt_tokens"] > 1
    np.testing.assert_allclose(scored[1]["prompt_logprobs"][1:], scored[0]["prompt_logprobs"][1:], atol=1e-3)
    by_id = {record["id"]: record for record in map(json.loads, group.output.read_text().splitlines())}
    assert set(json.loads(by_id["guided-schema"]["text"])) == {"name", "age"}
    assert by_id["guided-grammar"]["text"].strip("()") in ("yes", "no")
    answer = json.loads(next(line for line in group.output.read_text().splitlines() if '"program"' in line))
    assert "<|result|>4812477021" in answer["text"], answer["text"]  # 48213 * 99817, run in lockstep
    follower_log = group.log(1)  # the follower wrote both adapters from the tensors the leader sent
    assert "loaded adapter preloaded" in follower_log and f"loaded adapter {workdir / 'lora-line'}" in follower_log


RESTORE_CHILD = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jaxinfer.parallel import make_mesh
from jaxinfer.weights.loader import load_model, parameters

folder = sys.argv[1]
reference = parameters(load_model("smollm2-135m", make_mesh(1, 1), jnp.float32).model)
report = {}
for data, model in ((1, 8), (2, 4), (4, 1)):
    params = parameters(load_model(folder, make_mesh(data, model), jnp.float32).model)
    up = params["model.layers.0.mlp.up_proj.kernel"].get_value()
    report[f"{data}x{model}"] = dict(
        equal=all(np.array_equal(np.asarray(p.get_value()), np.asarray(reference[name].get_value()))
                  for name, p in params.items()),
        spec=str(up.sharding.spec), shard=list(up.addressable_shards[0].data.shape), full=list(up.shape))
print("REPORT " + json.dumps(report))
"""


def test_orbax_saved_over_two_devices_restores_into_other_mesh_shapes(workdir):
    proc = subprocess.run([sys.executable, "-c", RESTORE_CHILD, str(workdir / "orbax")], cwd=REPO, env=cpu_env(8),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))[len("REPORT "):])
    for mesh, model_axis in (("1x8", 8), ("2x4", 4), ("4x1", 1)):
        assert report[mesh]["equal"], report
        full, shard = report[mesh]["full"], report[mesh]["shard"]
        assert shard == [full[0], full[1] // model_axis], report  # each device holds its slice only


SERVE_TOML = """[serve]
model = "smollm2-135m"
host = "127.0.0.1"
port = 0
metrics_port = -1

""" + LIGHT_ENGINE_TOML


def test_two_process_grpc_server_streams_and_sigterm_stops_the_group(workdir, smollm2_llm):
    """`python -m serving` as process 0 of 2: health goes SERVING once both hosts loaded, Generate
    streams the same greedy tokens as one process, and SIGTERM ends both with status 0."""
    from grpc_health.v1 import health_pb2
    from test_serving_process import health

    from jaxinfer import SamplingParams
    from serving.client import InferenceClient

    (workdir / "serve.toml").write_text(SERVE_TOML)
    port = free_port()
    args = ["--config", str(workdir / "serve.toml"), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    follower_log = workdir / "serve-1.log"
    with open(follower_log, "w") as log_file:
        follower = subprocess.Popen([sys.executable, "-m", "serving", *args, "--process-id", "1"], cwd=REPO,
                                    env=cpu_env(DEVICES_PER_PROCESS), stdout=subprocess.DEVNULL, stderr=log_file)
    leader = subprocess.Popen([sys.executable, "-m", "serving", *args, "--process-id", "0"], cwd=REPO,
                              env=cpu_env(DEVICES_PER_PROCESS), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    try:
        target = f"127.0.0.1:{json.loads(leader.stdout.readline())['port']}"
        deadline = time.monotonic() + 300
        while health(target) != health_pb2.HealthCheckResponse.SERVING:
            assert leader.poll() is None and follower.poll() is None, follower_log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        with InferenceClient(target, timeout=120) as client:
            ids = [i for delta in client.stream("1, 2, 3, 4,", max_tokens=20, temperature=0.0)
                   for i in delta.token_ids]
        expected = smollm2_llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=20, temperature=0.0))[0]
        assert ids == expected.token_ids
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=120) == 0
        assert follower.wait(timeout=120) == 0, follower_log.read_text()[-3000:]
        assert "the leader stopped after" in follower_log.read_text()
    finally:
        for proc in (leader, follower):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_leader_stop_ends_followers_cleanly(workdir, groups):
    """The leader fails before loading (no input file): the follower is told to stop and exits 0."""
    group = Group(workdir, "--input", str(workdir / "missing.jsonl"), name="stop")
    groups.append(group)
    assert group.wait(0) == 2
    assert "--input: file not found" in group.log(0)
    assert group.wait(1) == 0, group.log(1)[-3000:]
    assert "process 1: replayed 0 steps" in group.log(1)
    assert no_output_lines(group)


def test_a_follower_with_other_weights_stops_the_group_before_loading(workdir, groups):
    """Each process reads its own copy of the checkpoint, and placing weights compares nothing across
    processes: of three processes, follower 2 is given other files (the orbax conversion; the others
    read the GGUF). It refuses to load, naming both fingerprints, and waits for the leader's stop;
    follower 1, ready, never starts loading alone. All exit in order (no abort in the coordination
    service's shutdown, no follower stuck in a collective)."""
    from jaxinfer.weights.fingerprint import fingerprint
    from jaxinfer.weights.registry import resolve

    group = Group(workdir, "--input", str(workdir / "in.jsonl"), name="other-weights", processes=3,
                  own_args={2: ("--model", str(workdir / "orbax"))})
    groups.append(group)
    assert group.wait(2) == 2, group.log(2)[-3000:]
    log = group.log(2)
    assert "other files than the leader's (process 0) 'smollm2-135m'" in log, log[-3000:]
    assert fingerprint(workdir / "orbax") in log and fingerprint(resolve("smollm2-135m").path) in log
    assert group.wait(0, timeout=120) == 2, group.log(0)[-3000:]
    assert "error: follower process 2 refused to load: model: process 2 reads" in group.log(0)
    assert group.wait(1, timeout=120) == 0, group.log(1)[-3000:]
    assert "process 1: replayed 0 steps" in group.log(1) and "loaded smollm2" not in group.log(1)
    assert no_output_lines(group)


def test_a_follower_with_other_engine_settings_stops_the_group_before_loading(workdir, groups):
    """Hosts that disagree on a setting that shapes the step (here the KV pool) would run and return
    garbage: the follower compares the leader's settings with its own and refuses, naming the setting;
    a host's own paths (its copy of an adapter) may differ."""
    other = workdir / "engine-other.toml"
    preloaded = workdir / "lora-copy"
    shutil.copytree(workdir / "lora-preloaded", preloaded, dirs_exist_ok=True)
    other.write_text(ENGINE_TOML.replace("num_pages = 256", "num_pages = 8")
                     + ADAPTER_LINES.format(preloaded=preloaded))
    group = Group(workdir, "--input", str(workdir / "in.jsonl"), name="other-settings",
                  own_args={1: ("--config", str(other))})
    groups.append(group)
    assert group.wait(1) == 2, group.log(1)[-3000:]
    assert ("engine.num_pages: the leader (process 0) runs 256, process 1 8; every process of a group needs "
            "the same engine settings") in group.log(1)
    assert group.wait(0, timeout=120) == 2, group.log(0)[-3000:]
    assert "error: follower process 1 refused to load: engine.num_pages" in group.log(0)
    assert no_output_lines(group)


FAILING_REPLAY = """
import runpy
from jaxinfer.engine.step import ModelRunner
replay, replayed = ModelRunner.replay, []
def failing(self, *args):
    replayed.append(1)
    if len(replayed) == 3:
        raise RuntimeError("injected: the device lost its memory")
    return replay(self, *args)
ModelRunner.replay = failing
runpy.run_module("jaxinfer.batch", run_name="__main__", alter_sys=True)
"""


def test_a_follower_that_fails_to_replay_a_step_stops_the_group_at_once(workdir, groups):
    """The follower's third step raises (an injected device fault): it exits 6 at once, closing its
    connection, and the leader exits 3; neither waits out the step's collective or JAX's exit barrier
    (minutes)."""
    group = Group(workdir, "--input", str(workdir / "light.jsonl"), name="replay-fails", config="light.toml",
                  own_code={1: FAILING_REPLAY})
    groups.append(group)
    assert group.wait(1, timeout=240) == REPLAY_FAILED_EXIT, group.log(1)[-3000:]
    assert "error: follower 1: replaying the leader's step" in group.log(1)
    assert "injected: the device lost its memory" in group.log(1)
    assert group.wait(0, timeout=60) == FOLLOWER_LOST_EXIT, group.log(0)[-3000:]
    assert "error: follower process 1 left the group" in group.log(0)
    assert no_output_lines(group)


def test_lost_follower_stops_the_leader_with_an_error(workdir, groups):
    group = Group(workdir, "--input", str(workdir / "light.jsonl"), name="lost-follower", config="light.toml")
    groups.append(group)
    group.wait_for(0, "lockstep leader at")
    group.procs[1].send_signal(signal.SIGKILL)
    assert group.wait(0, timeout=120) == FOLLOWER_LOST_EXIT, group.log(0)[-3000:]
    assert "error: follower process 1 left the group" in group.log(0)
    assert no_output_lines(group)


def test_lost_leader_stops_the_follower_with_an_error(workdir, groups):
    group = Group(workdir, "--input", str(workdir / "light.jsonl"), name="lost-leader", config="light.toml")
    groups.append(group)
    """Whichever notices first ends the follower: its control channel (exit 4) or JAX's coordination
    service, which aborts every task of a group whose coordinator (process 0) is gone."""
    group.wait_for(1, "replaying the leader's steps")
    group.procs[0].send_signal(signal.SIGKILL)
    status = group.wait(1, timeout=120)
    log = group.log(1)
    assert status in (LEADER_LOST_EXIT, -signal.SIGABRT), log[-3000:]
    assert ("the leader's control connection closed without a stop message" in log
            or "the JAX distributed service detected fatal errors" in log), log[-3000:]


def test_process_group_from_flags_and_environment():
    from jaxinfer.errors import ConfigError
    from jaxinfer.parallel.distributed import ProcessGroup

    env = {"JAXINFER_COORDINATOR": "10.0.0.2:1234", "JAXINFER_NUM_PROCESSES": "4", "JAXINFER_PROCESS_ID": "3"}
    assert ProcessGroup.resolve(environ=env) == ProcessGroup("10.0.0.2:1234", 4, 3)
    assert ProcessGroup.resolve(None, None, 1, environ=env).process_id == 1  # a flag wins over the environment
    assert not ProcessGroup.resolve(environ={}).distributed
    assert ProcessGroup.resolve("auto", environ={}).distributed
    assert ProcessGroup("[::1]:80", 2, 0).coordinator_host == "::1"
    bad = [(("h:1", 2, 2), "--process-id must be in [0, 2)"), (("", 2, 0), "--coordinator HOST:PORT is needed"),
           (("nohost", 2, 1), "--coordinator must be HOST:PORT"), (("h:99999", 2, 1), "must be HOST:PORT"),
           (("h:1", 0, 0), "--num-processes must be at least 1")]
    for args, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            ProcessGroup(*args)
    with pytest.raises(ConfigError, match="JAXINFER_PROCESS_ID must be a non-negative integer"):
        ProcessGroup.resolve(environ={**env, "JAXINFER_PROCESS_ID": "one"})


def test_settings_a_group_cannot_replay_are_refused():
    from jaxinfer.config import EngineConfig
    from jaxinfer.errors import ConfigError
    from jaxinfer.llm import check_multi_process

    check_multi_process(EngineConfig(exec_slots=2, max_adapters=2))  # both replayed: allowed
    with pytest.raises(ConfigError, match=r"engine.draft_model is not supported with more than one process "
                                          r"\(set engine.draft_model, engine.kv_store off\)"):
        check_multi_process(EngineConfig(draft_model="smollm2-135m", kv_store="/tmp/kv"))


def test_control_frames_round_trip_without_pickle():
    import numpy as np

    from jaxinfer.parallel.lockstep import encode, receive

    arrays = {"tokens": np.arange(5, dtype=np.int32), "top_p": np.ones((2, 3), np.float32),
              "seed": np.array([7], np.uint32), "empty": np.zeros((0, 4), np.int32)}
    left, right = socket.socketpair()
    with left, right:
        left.sendall(encode({"op": "step", "number": 3}, arrays))
        left.sendall(encode({"op": "stop"}, {}))
        header, received = receive(right)
        assert header == {"op": "step", "number": 3}
        for name, array in arrays.items():
            assert received[name].dtype == array.dtype and np.array_equal(received[name], array)
        assert receive(right) == ({"op": "stop"}, {})
        left.sendall(encode({"op": "step"}, {"bad": np.array([None, 1], dtype=object)}))
        with pytest.raises(ValueError, match="array bad has an object dtype"):
            receive(right)
        left.sendall(encode({"op": "step"}, arrays)[:12])
        left.close()
        assert receive(right) is None  # a frame cut short is the end of the channel
    frame = bytearray(encode({"op": "step"}, {"tokens": arrays["tokens"]}))
    frame[4:8] = (int.from_bytes(frame[4:8], "big") + 4).to_bytes(4, "big")
    for data, limit, message in ((encode({"op": "hello", "pad": "x" * 5000}, {}), 4096, "exceeds 4096 bytes"),
                                 (bytes(frame) + bytes(4), None, "payload is longer than its arrays")):
        left, right = socket.socketpair()  # the leader closes a connection whose frame it refuses
        with left, right:
            left.sendall(data)
            with pytest.raises(ValueError, match=message):
                receive(right, limit=limit)


TRANSFER_CHILD = r"""
import json, sys
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxinfer.engine.xla_compiles import XLA_COMPILES
from jaxinfer.parallel import make_mesh
from jaxinfer.parallel.distributed import ProcessGroup, initialize
from jaxinfer.parallel.transfer import to_devices
initialize(ProcessGroup(f"127.0.0.1:{sys.argv[1]}", 2, int(sys.argv[2])))
mesh = make_mesh()
host = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
shardings = [NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(None, "model"))]
mark = XLA_COMPILES.mark()
placed = [to_devices(host, sharding) for sharding in shardings]
half = host.astype(jax.numpy.bfloat16)
scalar, placed_half, wide = to_devices((np.int32(7), half, np.arange(4, dtype=np.int64)), shardings[0])
compiles_to_devices = XLA_COMPILES.since(mark)
tree = dict(scalar=[int(scalar.addressable_data(0)), list(scalar.shape), str(scalar.dtype)],
            wide=[str(wide.dtype), str(jax.device_put(np.arange(4, dtype=np.int64)).dtype),
                  np.asarray(wide.addressable_data(0)).tolist()],
            half=[str(placed_half.dtype),
                  all(np.array_equal(np.asarray(shard.data), half) for shard in placed_half.addressable_shards)])
local = [[np.array_equal(np.asarray(shard.data), host[shard.index]) for shard in array.addressable_shards]
         for array in placed]
total = jax.jit(lambda a: (a * 2).sum(), out_shardings=shardings[0])(placed[1])
mark = XLA_COMPILES.mark()
jax.block_until_ready(jax.device_put(host + 1, shardings[0]))
compiles_device_put = XLA_COMPILES.since(mark)
sys.stdout.write("RESULT " + json.dumps(dict(local=local, total=float(total.addressable_data(0)), tree=tree,
                                             compiles_to_devices=compiles_to_devices,
                                             compiles_device_put=compiles_device_put,
                                             shards=[len(a.addressable_shards) for a in placed])) + "\n")
"""


def reported(stdout: str) -> dict:
    """The child's result. Gloo's threads print to the same stdout, once between a print's text and its
    newline: the result is one write, found by its marker and decoded up to its own end."""
    return json.JSONDecoder().raw_decode(stdout, stdout.index("RESULT ") + len("RESULT "))[0]


def test_host_arrays_reach_a_two_process_mesh_without_a_cross_process_check():
    """to_devices places each process's own copy: the right slice on every local device (also for 0-d and
    bfloat16 leaves of a tree, and int64 narrowed as device_put narrows it), usable by a program over
    both processes, and no compiled check (jax.device_put compiles one for the same array)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", TRANSFER_CHILD, str(port), str(i)], cwd=REPO,
                              env=cpu_env(TRANSFER_DEVICES_PER_PROCESS), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in (0, 1)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, stderr[-3000:]
    for stdout, _ in outputs:
        result = reported(stdout)
        assert result["shards"] == [TRANSFER_DEVICES_PER_PROCESS, TRANSFER_DEVICES_PER_PROCESS]
        assert result["local"] == [[True] * TRANSFER_DEVICES_PER_PROCESS] * 2
        assert result["total"] == 2 * sum(range(6 * 8))
        assert result["tree"] == {"scalar": [7, [], "int32"], "half": ["bfloat16", True],  # 0-d and bf16 leaves keep
                                  "wide": ["int32", "int32", [0, 1, 2, 3]]}  # int64 narrows as device_put's
        assert result["compiles_to_devices"] == 0
        assert result["compiles_device_put"] > 0  # what to_devices avoids: JAX's check of every process's copy
