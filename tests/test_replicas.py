"""Data-parallel replicas (engine.mesh_data = 2) on two CPU devices: one engine interface, two
independent copies of the model, requests balanced between them and routed by cached prefix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import dataclasses, json
from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.params import Request
from jaxinfer.errors import ConfigError

engine = dict(token_buckets=(8,), max_seqs=8, page_size=8, num_pages=256, compile_guard="raise")
system = "You are a helpful assistant who answers in one short sentence. " * 3
questions = ("Name a color.", "What is 7 times 8?", "Say hello.", "Name a fruit.", "What is the capital of Italy?")
chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
greedy = SamplingParams(max_tokens=16, temperature=0.0)
report = {}

one = LLM("smollm2-135m", mesh_model=1, **engine)
reference = [o.token_ids for o in one.generate_chat(chats, greedy)]
two = LLM("smollm2-135m", mesh_data=2, mesh_model=1, **engine)
outputs = two.generate_chat(chats, greedy)
replicas = two.engine.engines
report["same_tokens"] = [o.token_ids for o in outputs] == reference
report["indices"] = [o.index for o in outputs]
report["steps"] = [e.stats.steps for e in replicas]
report["devices"] = [sorted(str(d) for d in r.caches[0].k.devices()) for r in two.runners]
report["metrics"] = {k: two.engine.metrics()[k] for k in ("replicas", "running", "waiting", "steps")}
report["free_after"] = [e.pool.num_free for e in replicas]

# Prefix affinity: a long document answered on replica 1 draws the follow-up question there,
# although replica 0 would win a tie on load.
document = "The lighthouse keeper logged every ship that passed the cape. " * 8
first = [{"role": "user", "content": document + "How many ships passed?"}]
later = [{"role": "user", "content": document + "What did the keeper log?"}]
busy = two.engine.add_request(two.chat_request(chats[0], greedy))  # replica 0 gets this one
doc = two.engine.add_request(two.chat_request(first, greedy))  # so this goes to replica 1
while two.engine.has_unfinished():
    two.engine.step()
report["doc_replica"] = doc.index % 2
report["follow_up_replica"] = replicas.index(two.engine.route(two.chat_request(later, greedy)))
report["unrelated_replica"] = replicas.index(two.engine.route(two.request("Tell me about volcanoes.", greedy)))
report["cached_question_replica"] = replicas.index(two.engine.route(two.chat_request(chats[1], greedy)))

# One exec session always lands on the same replica; sessions spread over both.
def session_replica(session, tenant="t"):
    params = SamplingParams(exec=True, exec_session=session)
    return replicas.index(two.engine.route(dataclasses.replace(two.request("x", params), tenant=tenant)))
report["session_stable"] = all(session_replica(f"s{i}") == session_replica(f"s{i}") for i in range(8))
report["sessions_spread"] = sorted({session_replica(f"s{i}") for i in range(16)})

# Abort goes to the replica that owns the index; its pages come back.
server_engine = two.new_engine()
free = [e.pool.num_free for e in server_engine.engines]
queued = [server_engine.add_request(two.chat_request(c, greedy)) for c in chats[:2]]
while not queued[1].output_ids:  # abort once it decodes: its prompt's pages and a generated token's
    server_engine.step()
aborted = server_engine.abort(queued[1].index)
report["aborted"] = [aborted.index, aborted.finish_reason, queued[1].index % 2]
while server_engine.has_unfinished():
    server_engine.step()
report["free_restored"] = [e.pool.num_free for e in server_engine.engines] == free

# Served over gRPC: both replicas take streams; a step that fails on one replica ends only its streams.
import sys
sys.path.insert(0, "tests")
import grpc
from servers import RunningServer
from serving.client import InferenceClient
running = RunningServer(two)
running.call(running.server.load())
served = running.server.worker.engine
with InferenceClient(running.target, timeout=300) as client:
    texts = [client.generate(q, max_tokens=6, temperature=0.0)[0] for q in questions[:2]]
    report["served"] = texts == [o.text for o in one.generate(list(questions[:2]), SamplingParams(max_tokens=6,
                                                                                              temperature=0.0))]
    step, calls = served.engines[1].step, []
    def flaky():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("replica 1 lost its device")
        return step()
    served.engines[1].step = flaky
    streams = [client.stream(q, max_tokens=12, temperature=0.0, ignore_eos=True) for q in questions[2:4]]
    ends = []
    for stream in streams:
        try:
            ends.append(sum(len(d.token_ids) for d in stream))
        except grpc.RpcError as error:
            ends.append(f"{error.code().name}: {error.details()}")
    report["fault"] = ends
    report["after_fault"] = client.generate("Say hello.", max_tokens=4, temperature=0.0)[1].usage.completion_tokens
    report["failed_replicas"] = sorted(served.failed)  # out of routing: the request above ran on replica 0
    def broken():
        raise RuntimeError("replica 0 lost its device")
    served.engines[0].step = broken
    try:
        client.generate("Name a fruit.", max_tokens=4)
    except grpc.RpcError as error:
        report["last_replica_fault"] = error.code().name
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(running.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(100):
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            import time
            time.sleep(0.1)
        report["health_after_all_failed"] = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
running.close()
report["served_free"] = [e.pool.num_free for e in served.engines] == free

try:
    LLM("smollm2-135m", mesh_data=2, mesh_model=1, kv_store="/tmp/never", **engine)
except ConfigError as error:
    report["refused"] = str(error)
print("REPORT " + json.dumps(report))
"""


def test_two_replicas_answer_like_one_and_route_by_prefix():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))[len("REPORT "):])
    assert report["same_tokens"], report
    assert report["indices"] == [0, 1, 2, 3, 4], report
    assert all(steps > 0 for steps in report["steps"]), report  # both replicas computed
    assert len(report["devices"][0]) == 1 and report["devices"][0] != report["devices"][1], report
    assert report["metrics"] == {"replicas": 2, "running": 0, "waiting": 0, "steps": sum(report["steps"])}, report
    assert report["free_after"][0] == report["free_after"][1], report
    assert report["doc_replica"] == 1 and report["follow_up_replica"] == 1, report
    assert report["unrelated_replica"] == 0, report  # nothing cached anywhere, equal load: the first
    assert report["cached_question_replica"] == 1, report  # index 1 of the first batch ran there
    assert report["session_stable"] and report["sessions_spread"] == [0, 1], report
    assert report["aborted"] == [1, "abort", 1] and report["free_restored"], report
    assert report["served"] and report["after_fault"] == 4 and report["served_free"], report
    assert report["failed_replicas"] == [1] and report["last_replica_fault"] == "INTERNAL", report
    assert report["health_after_all_failed"] == "NOT_SERVING", report
    ok, failed = sorted(report["fault"], key=lambda end: isinstance(end, str))
    assert ok == 12 and failed.startswith("INTERNAL: engine step failed: replica 1: RuntimeError"), report
    assert report["refused"] == ("engine.kv_store is not supported with engine.mesh_data > 1 (replicas) "
                                 "(set engine.kv_store off)"), report
