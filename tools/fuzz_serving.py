"""Fuzz the server: hostile gRPC and HTTP requests against a real server on loopback, then the invariants.

    python tools/fuzz_serving.py --serve configs/serve-soak.toml --seconds 900
    python tools/fuzz_serving.py --target 127.0.0.1:50051 --http-target 127.0.0.1:8000 \\
        --metrics 127.0.0.1:9090 --seconds 120

Requests come from hypothesis strategies (tools/fuzz_requests.py): every field of every RPC, raw and
corrupted message bytes, and JSON bodies (and bytes that are not JSON) for the HTTP routes. An
accepted Generate call is read for 1 to 3 messages and then cancelled, so accepted requests cost
little. Beside them a chaos thread opens half-open connections on both ports (a partial HTTP/2
preface, a partial HTTP request), starts streams it never reads, and starts streams in bursts that
it cancels at random moments; a health thread checks health twice a second.

Checks (the exit status is 1 when one fails; the JSON line says which):
- every call ends with a clear status: gRPC OK or INVALID_ARGUMENT / RESOURCE_EXHAUSTED / NOT_FOUND /
  FAILED_PRECONDITION / OUT_OF_RANGE / PERMISSION_DENIED / UNAUTHENTICATED with a message (and for
  INVALID_ARGUMENT and OUT_OF_RANGE a message that names a field), or the fuzzer's own CANCELLED or
  DEADLINE_EXCEEDED; HTTP 200 or a 4xx with an OpenAI error object whose message is not empty;
- health answered SERVING at every check, and the server process is alive at the end;
- once the calls are over, nothing is held (`jaxinfer_held` all 0).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx2
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuzz_requests import HTTP_FIELDS, field_names, http_bodies, rpc_requests
from serve_probe import health, run_checked, wait_released

from serving.proto.jaxinfer.v1 import inference_pb2 as pb

CLEAR = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND", "FAILED_PRECONDITION", "OUT_OF_RANGE",
         "PERMISSION_DENIED", "UNAUTHENTICATED"}
OURS = {"CANCELLED", "DEADLINE_EXCEEDED"}  # the fuzzer's own cancels and deadlines
NAMING = {"INVALID_ARGUMENT", "OUT_OF_RANGE"}
MESSAGE_LIMIT = 64 << 20  # the client sends what the server must refuse (gRPC's default limit is 4 MiB)
ROUND = 200  # examples per hypothesis run; rounds go on until the time or the count is reached


@dataclass
class Campaign:
    requests: Counter = field(default_factory=Counter)  # by front and method
    statuses: Counter = field(default_factory=Counter)
    unclear: list[dict] = field(default_factory=list)
    unhealthy: list[str] = field(default_factory=list)
    chaos: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, front: str, method: str, status: str, problem: str | None, sample: object) -> None:
        with self.lock:
            self.requests[f"{front} {method}"] += 1
            self.statuses[f"{front} {status}"] += 1
            if problem is not None:
                self.unclear.append({"front": front, "method": method, "status": status, "problem": problem,
                                     "sample": repr(sample)[:300]})


def grpc_problem(code: str, details: str, names: set[str]) -> str | None:
    """Why a gRPC outcome is not a clear status, or None."""
    if code == "OK" or code in OURS:
        return None
    if code not in CLEAR:
        return f"status {code}: {details[:200]}"
    if not details.strip():
        return "no message"
    if code in NAMING and not any(re.search(rf"\b{re.escape(name)}\b", details) for name in names):
        return f"names no field: {details[:200]}"
    return None


def send_rpc(channel: grpc.Channel, method: str, data: bytes, reads: int, timeout: float) -> tuple[str, str]:
    """Sends serialized bytes as `method`; (status name, details). Generate is read `reads` times, then cancelled."""
    path = f"/jaxinfer.v1.Inference/{method}"
    try:
        if method != "Generate":
            channel.unary_unary(path)(data, timeout=timeout)
            return "OK", ""
        call = channel.unary_stream(path)(data, timeout=timeout)
        for count, _ in enumerate(call, 1):
            if count >= reads:
                call.cancel()
                return "CANCELLED", "by the fuzzer"
        return "OK", ""
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""


def http_problem(status: int, body: bytes, names: set[str]) -> str | None:
    if status == 200:
        return None
    if not 400 <= status < 500:
        return f"HTTP {status}: {body[:200]!r}"
    try:
        error = json.loads(body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status} without an error object: {body[:200]!r}"
    if not str(message).strip():
        return f"HTTP {status} with an empty message"
    if status == 400 and not error.get("param") and not any(re.search(rf"\b{re.escape(n)}\b", message) for n in names):
        return f"HTTP 400 names no field: {message[:200]}"
    return None


def send_http(client: httpx2.Client, path: str, body: bytes) -> tuple[int, bytes]:
    """POSTs a body; a 200 is read for a few chunks and then the connection is dropped (a disconnect)."""
    with client.stream("POST", path, content=body, headers={"content-type": "application/json"}) as response:
        if response.status_code == 200:
            for count, _ in enumerate(response.iter_bytes(), 1):
                if count >= 2:
                    break
            return 200, b""
        return response.status_code, response.read()


def fuzz_grpc(args: argparse.Namespace, target: str, campaign: Campaign, round_seed: int, count: int) -> None:
    names = field_names()
    options = [("grpc.max_send_message_length", MESSAGE_LIMIT), ("grpc.max_receive_message_length", MESSAGE_LIMIT)]
    with grpc.insecure_channel(target, options=options) as channel:
        @hypothesis_seed(round_seed)
        @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(rpc_requests(args.vocab, args.max_model_len), st.integers(1, 3))
        def one(request: tuple[str, bytes], reads: int) -> None:
            method, data = request
            code, details = send_rpc(channel, method, data, reads, args.call_timeout)
            campaign.record("grpc", method, code, grpc_problem(code, details, names), data[:200])

        one()


def fuzz_http(args: argparse.Namespace, http_target: str, campaign: Campaign, round_seed: int, count: int) -> None:
    names = field_names() | set(HTTP_FIELDS) | {"body"}
    with httpx2.Client(base_url=f"http://{http_target}", timeout=args.call_timeout) as client:
        @hypothesis_seed(round_seed)
        @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(http_bodies())
        def one(request: tuple[str, bytes]) -> None:
            path, body = request
            try:
                status, text = send_http(client, path, body)
            except httpx2.TimeoutException:
                campaign.record("http", path, "timeout", None, body[:200])  # the fuzzer's own deadline
                return
            campaign.record("http", path, str(status), http_problem(status, text, names), body[:200])

        one()


def watch_health(target: str, stop: threading.Event, campaign: Campaign) -> None:
    while not stop.wait(0.5):
        status = health(target)
        if status != "SERVING":
            campaign.unhealthy.append(f"{time.strftime('%H:%M:%S')} {status}")


def stream_bytes(max_tokens: int = 64) -> bytes:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(text="a story about a river", sampling=sampling).SerializeToString()


def chaos(target: str, http_target: str, stop: threading.Event, campaign: Campaign, rng: random.Random) -> None:
    """Half-open connections, streams never read, and bursts of streams cancelled at random moments."""
    opened: list[tuple[float, object]] = []  # (when, socket or (channel, call))
    while not stop.wait(0.2):
        pick = rng.random()
        if pick < 0.3:
            opened.append((time.time(), _half_open(target, b"PRI * HTTP/2.0\r\n\r\nSM\r\n")))
            campaign.chaos["half_open_grpc"] += 1
        elif pick < 0.5:
            request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n\r\n{\"prompt\": "
            opened.append((time.time(), _half_open(http_target, request)))
            campaign.chaos["half_open_http"] += 1
        elif pick < 0.75:
            channel = grpc.insecure_channel(target)
            opened.append((time.time(), (channel, channel.unary_stream("/jaxinfer.v1.Inference/Generate")(
                stream_bytes(256)))))
            campaign.chaos["never_read_streams"] += 1
        else:
            _cancel_burst(target, rng)
            campaign.chaos["cancel_bursts"] += 1
        while opened and (time.time() - opened[0][0] > 5 or len(opened) > 24):
            _close(opened.pop(0)[1])
    for _, thing in opened:
        _close(thing)


def _half_open(target: str, first_bytes: bytes) -> socket.socket:
    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(first_bytes)
    return sock


def _close(thing: object) -> None:
    if isinstance(thing, socket.socket):
        thing.close()
    else:
        channel, call = thing
        call.cancel()
        channel.close()


def _cancel_burst(target: str, rng: random.Random, streams: int = 6) -> None:
    with grpc.insecure_channel(target) as channel:
        calls = [channel.unary_stream("/jaxinfer.v1.Inference/Generate")(stream_bytes()) for _ in range(streams)]
        for call in calls:
            time.sleep(rng.uniform(0, 0.1))
            call.cancel()


def run_campaign(args: argparse.Namespace, target: str, http_target: str, metrics: str, alive) -> dict:
    campaign, stop = Campaign(), threading.Event()
    helpers = [threading.Thread(target=watch_health, args=(target, stop, campaign), daemon=True),
               threading.Thread(target=chaos, args=(target, http_target, stop, campaign, random.Random(args.seed)),
                                daemon=True)]
    for thread in helpers:
        thread.start()
    start, round_number = time.time(), 0
    while time.time() - start < args.seconds and sum(campaign.requests.values()) < args.requests:
        round_seed = args.seed * 100_003 + round_number
        fuzz_grpc(args, target, campaign, round_seed, ROUND)
        if http_target:
            fuzz_http(args, http_target, campaign, round_seed, ROUND // 2)
        round_number += 1
    stop.set()
    for thread in helpers:
        thread.join(30)
    left = wait_released(metrics)
    failed = {"unclear_statuses": len(campaign.unclear), "unhealthy_checks": len(campaign.unhealthy),
              "held_after": left, "server_died": not alive()}
    return {
        "what": "fuzz_serving", "seconds": round(time.time() - start, 1), "rounds": round_number,
        "requests": sum(campaign.requests.values()), "by_method": dict(campaign.requests),
        "statuses": dict(campaign.statuses), "chaos": dict(campaign.chaos),
        "unclear_kinds": dict(Counter(f"{u['front']} {u['method']} {u['problem'][:70]}" for u in campaign.unclear)),
        "first_unclear": campaign.unclear[:10], "first_unhealthy": campaign.unhealthy[:5],
        "checks_failed": [name for name, bad in failed.items() if bad], **failed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--serve", help="start `python -m serving --config SERVE` for the run")
    where.add_argument("--target", help="host:port of a running server's gRPC API (with --metrics)")
    p.add_argument("--http-target", default="", help="host:port of the running server's HTTP API")
    p.add_argument("--metrics", help="host:port of the running server's /metrics")
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--requests", type=int, default=10**9, help="stop after about this many requests")
    p.add_argument("--vocab", type=int, default=49152, help="the model's vocabulary size (ids past it are fuzzed)")
    p.add_argument("--max-model-len", type=int, default=2048, help="the engine's context limit")
    p.add_argument("--call-timeout", type=float, default=30.0, help="the fuzzer's deadline per call")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    def work(served, metrics: str) -> dict:
        if served is None:
            return run_campaign(args, args.target, args.http_target, metrics, lambda: health(args.target) == "SERVING")
        return run_campaign(args, served.target, served.http_target, metrics, lambda: served.proc.poll() is None)

    return run_checked(args.serve, args.metrics, work)


if __name__ == "__main__":
    sys.exit(main())
