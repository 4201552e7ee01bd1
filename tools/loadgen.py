"""Load generator for the gRPC and HTTP servers: Poisson arrivals, concurrent streams; throughput and latency.

    python tools/loadgen.py --serve configs/serve-smollm2.toml --requests 64 --rate 2 --concurrency 32
    python tools/loadgen.py --target 127.0.0.1:50051 --requests 200 --rate 8
    python tools/loadgen.py --serve configs/serve-smollm2.toml --front both --requests 128 --rate 1000

`--front grpc` (the default) drives the gRPC API, `http` the OpenAI-compatible one (streamed
/v1/completions; `--http-target host:port` with `--target`), and `both` runs the same workload
(same seed: same prompts and arrival times) through gRPC and then HTTP on one server and reports
the HTTP front end's throughput as a ratio of gRPC's. Over HTTP an inter-token latency is the gap
between stream chunks (one chunk per engine step, as each gRPC message is).

`--serve CONFIG` starts `python -m serving` with that config on a free port, waits for SERVING,
runs the load and stops it with SIGTERM; `--target` uses a running server. Requests arrive as a
Poisson process of `--rate` per second (at most `--concurrency` open streams); prompts are
random word sequences of `--min-words`..`--max-words` words, each asking for exactly
`--max-tokens` tokens (EOS ignored, greedy). Prints one JSON object: request throughput, output
tokens per second, time to first token and inter-token latency percentiles, and errors by status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import grpc
import httpx2
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from serve_probe import start_server  # noqa: E402

from serving.client import AsyncInferenceClient  # noqa: E402

WORDS = ("river mountain light story quiet engine paper window garden winter signal market "
         "silver forest letter bridge morning harbor candle music").split()


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    data = np.asarray(values)
    return {f"p{q}": round(float(np.percentile(data, q)), 4) for q in (50, 95, 99)}


async def one_request(client: AsyncInferenceClient, prompt: str, max_tokens: int, record: dict) -> None:
    sent = time.perf_counter()
    last = None
    try:
        async for delta in client.stream(prompt, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                                         temperature=0.0):
            if not delta.token_ids:
                continue
            now = time.perf_counter()
            if last is None:
                record["ttft"].append(now - sent)
            else:
                record["itl"].extend([(now - last) / len(delta.token_ids)] * len(delta.token_ids))
            last = now
            record["tokens"] += len(delta.token_ids)
        record["ok"] += 1
    except grpc.aio.AioRpcError as exc:
        record["errors"][exc.code().name] = record["errors"].get(exc.code().name, 0) + 1


async def one_http_request(client: httpx2.AsyncClient, prompt: str, max_tokens: int, record: dict) -> None:
    """A streamed /v1/completions call; its token count from the usage chunk at the end."""
    body = {"model": "", "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            record["errors"][str(response.status_code)] = record["errors"].get(str(response.status_code), 0) + 1
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                record["tokens"] += chunk["usage"]["completion_tokens"]
            if not chunk.get("choices") or not chunk["choices"][0]["text"]:
                continue
            now = time.perf_counter()
            if last is None:
                record["ttft"].append(now - sent)
            else:
                record["itl"].append(now - last)
            last = now
    record["ok"] += 1


async def run_load(args: argparse.Namespace, target: str, front: str = "grpc") -> dict:
    rng = random.Random(args.seed)
    record = {"ttft": [], "itl": [], "tokens": 0, "ok": 0, "errors": {}}
    gate = asyncio.Semaphore(args.concurrency)

    async def gated(prompt: str) -> None:
        async with gate:
            if front == "http":
                await one_http_request(client, prompt, args.max_tokens, record)
            else:
                await one_request(client, prompt, args.max_tokens, record)

    if front == "http":
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        client_cm = httpx2.AsyncClient(base_url=f"http://{target}", timeout=args.timeout, headers=headers,
                                       limits=httpx2.Limits(max_connections=args.concurrency + 4))
    else:
        client_cm = AsyncInferenceClient(target, timeout=args.timeout, api_key=args.api_key)
    async with client_cm as client:
        start = time.perf_counter()
        tasks = []
        for _ in range(args.requests):
            words = rng.randint(args.min_words, args.max_words)
            # The front's name first: the second run of `--front both` finds none of the first's pages cached.
            prompt = " ".join([front, *(rng.choice(WORDS) for _ in range(words))])
            tasks.append(asyncio.create_task(gated(prompt)))
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return {
        "what": "loadgen", "front": front, "target": target, "requests": args.requests, "rate_per_s": args.rate,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "wall_s": round(wall, 2),
        "ok": record["ok"], "errors": record["errors"],
        "requests_per_s": round(record["ok"] / wall, 3), "output_tokens_per_s": round(record["tokens"] / wall, 1),
        "ttft_s": percentiles(record["ttft"]), "itl_s": percentiles(record["itl"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="host:port of a running server")
    where.add_argument("--serve", help="start `python -m serving --config SERVE` for the run")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--concurrency", type=int, default=32, help="most streams open at once")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--min-words", type=int, default=8)
    p.add_argument("--max-words", type=int, default=120)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--api-key", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--front", choices=("grpc", "http", "both"), default="grpc")
    p.add_argument("--http-target", help="host:port of a running server's HTTP API (with --target)")
    args = p.parse_args()
    served = None
    target, http_target = args.target, args.http_target or args.target
    if args.serve:
        served = start_server(args.serve)
        target, http_target = served.target, served.http_target
    try:
        fronts = ("grpc", "http") if args.front == "both" else (args.front,)
        results = [asyncio.run(run_load(args, http_target if front == "http" else target, front)) for front in fronts]
        for result in results:
            print(json.dumps(result), flush=True)
        if len(results) == 2:
            grpc_run, http_run = results
            print(json.dumps({"what": "http_over_grpc",
                              "requests_per_s": round(http_run["requests_per_s"] / grpc_run["requests_per_s"], 3),
                              "output_tokens_per_s": round(http_run["output_tokens_per_s"]
                                                           / grpc_run["output_tokens_per_s"], 3)}), flush=True)
    finally:
        if served is not None:
            served.stop()


if __name__ == "__main__":
    main()
