"""Soak: many concurrent gRPC streams for a given time against a real server, then the invariants.

    python tools/soak.py --serve configs/serve-soak.toml --streams 64 --seconds 3600
    python tools/soak.py --target 127.0.0.1:50051 --metrics 127.0.0.1:9090 --seconds 120

The work is a fixed set of requests ("keys"): text prompts of random lengths, half of them sharing a
long preamble (prefix-cache hits), greedy and seeded sampling, penalties, a guided choice and grammar,
chats with the exec adapter, and programs run by the processor (`exec`). Each key runs alone first:
its output is the reference. Then `--streams` workers send random keys until the time is up; each call either
reads to the end, cancels after a random number of tokens, or carries a random deadline.

Checks at the end (the exit status is 1 when one fails; the JSON line says which):
- every completed call's tokens equal its reference, and every cut-off call's tokens are a prefix of it;
- nothing is held once the calls are over (`jaxinfer_held` all 0: sequences, pages, slots, streams);
- no XLA program compiled after the references (warm-up covered every shape);
- health answered SERVING at every sample;
- resident memory grew by at most `--rss-growth-mb` from the first quarter of the run to its end.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_probe import health, rss_mb, run_checked, scrape, wait_released

from serving.client import AsyncInferenceClient, InferenceClient

WORDS = ("river mountain light story quiet engine paper window garden winter signal market silver forest "
         "letter bridge morning harbor candle music lantern meadow stone ocean").split()
QUESTIONS = ("What is 4821 * 9981?", "Compute gcd(7200, 9324).", "What is 2 to the power 40?",
             "What is 123456789 + 987654321?")
EXEC_ADAPTER = "smollm2-135m-exec"
COMPILES = "jaxinfer_xla_compiles_while_serving_total"


@dataclass(frozen=True)
class Key:
    """One request of the work set: what is sent, and under which name its reference is kept."""

    name: str
    prompt: str | list[dict[str, str]]
    sampling: dict
    adapter: str = ""


@dataclass
class Tally:
    outcomes: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    mismatches: list[dict] = field(default_factory=list)
    unexpected: dict[str, int] = field(default_factory=dict)

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def work_set(rng: random.Random, prompts: int, exec_on: bool) -> list[Key]:
    preamble = " ".join(rng.choice(WORDS) for _ in range(96))
    keys = []
    for i in range(prompts):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 160)))
        text = f"{preamble} {words}" if i % 2 else words
        kind = ("greedy", "seeded", "penalty", "choice", "grammar")[i % 5]
        sampling = {"max_tokens": rng.choice((4, 16, 32)), "temperature": 0.0}
        if kind == "seeded":
            sampling.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        elif kind == "penalty":
            sampling.update(repetition_penalty=1.3, presence_penalty=0.5)
        elif kind == "choice":
            sampling["guided"] = {"choice": {"values": ["yes", "no", "a river", "a forest"]}}
        elif kind == "grammar":  # matched on the host: holds a mask row
            sampling["guided"] = {"grammar": 'start: ("stone" | "ocean") " " ("light" | "music")'}
        keys.append(Key(f"{kind}-{i}", text, sampling))
    for i, question in enumerate(QUESTIONS if exec_on else ()):
        chat = [{"role": "user", "content": question}]
        keys.append(Key(f"adapter-{i}", chat, {"max_tokens": 24, "temperature": 0.0}, EXEC_ADAPTER))
        keys.append(Key(f"exec-{i}", chat, {"max_tokens": 400, "temperature": 0.0, "exec": True}, EXEC_ADAPTER))
    return keys


async def call(client: AsyncInferenceClient, key: Key, cancel_after: int | None = None,
               timeout: float | None = None) -> tuple[list[int], int, str]:
    """The ids streamed, the finish reason (0: none) and the outcome: ok, cancelled or an RPC code's name."""
    ids, finish = [], 0
    request = InferenceClient.request(key.prompt, adapter=key.adapter, **key.sampling)
    responses = client.stub.Generate(request, timeout=timeout)
    try:
        async for response in responses:
            ids.extend(response.token_ids)
            finish = response.finish_reason or finish
            if cancel_after is not None and len(ids) >= cancel_after and not finish:
                responses.cancel()
                return ids, 0, "cancelled"
    except grpc.aio.AioRpcError as exc:
        return ids, 0, exc.code().name
    return ids, finish, "ok"


async def references(target: str, keys: list[Key]) -> dict[str, tuple[list[int], int]]:
    async with AsyncInferenceClient(target) as client:
        found = {}
        for key in keys:
            ids, finish, outcome = await call(client, key)
            if outcome != "ok":
                raise SystemExit(f"reference {key.name}: {outcome}")
            found[key.name] = (ids, finish)
        return found


async def stream_worker(target: str, keys: list[Key], refs: dict, until: float, rng: random.Random,
                        tally: Tally) -> None:
    async with AsyncInferenceClient(target) as client:
        while time.time() < until:
            key = rng.choice(keys)
            ref_ids, ref_finish = refs[key.name]
            action = rng.random()
            cancel_after = rng.randint(1, max(1, len(ref_ids))) if action < 0.15 else None
            timeout = rng.uniform(0.2, 3.0) if 0.15 <= action < 0.3 else None
            ids, finish, outcome = await call(client, key, cancel_after, timeout)
            tally.count(outcome)
            tally.tokens += len(ids)
            if outcome not in ("ok", "cancelled", "DEADLINE_EXCEEDED"):
                tally.unexpected[outcome] = tally.unexpected.get(outcome, 0) + 1
            complete = outcome == "ok"
            if (complete and (ids, finish) != (ref_ids, ref_finish)) or ids != ref_ids[:len(ids)]:
                if len(tally.mismatches) < 20:
                    tally.mismatches.append({"key": key.name, "outcome": outcome, "got": ids, "want": ref_ids})
                else:
                    tally.mismatches.append({"key": key.name})


async def sampler(target: str, pid: int | None, until: float, every: float, samples: list) -> None:
    while time.time() < until:
        status = await asyncio.to_thread(health, target)
        samples.append((time.time(), status, rss_mb(pid) if pid else 0.0))
        await asyncio.sleep(every)


def rss_growth(samples: list, start: float, until: float) -> float:
    """The largest resident size in the last tenth of the run less the one at the end of its first quarter."""
    quarter, tail = start + (until - start) / 4, until - (until - start) / 10
    early = [rss for t, _, rss in samples if t <= quarter]
    late = [rss for t, _, rss in samples if t >= tail]
    return round(max(late) - early[-1], 1) if early and late else 0.0


async def soak(args: argparse.Namespace, target: str, metrics: str, pid: int | None) -> dict:
    rng = random.Random(args.seed)
    keys = work_set(rng, args.prompts, not args.no_exec)
    started = time.time()
    refs = await references(target, keys)
    compiles_before = scrape(metrics).get(COMPILES, 0.0)
    start = time.time()
    until = start + args.seconds
    tally, samples = Tally(), []
    workers = [stream_worker(target, keys, refs, until, random.Random(args.seed * 1000 + i), tally)
               for i in range(args.streams)]
    await asyncio.gather(sampler(target, pid, until, args.sample_every, samples), *workers)
    wall = time.time() - start
    left = wait_released(metrics)
    compiles = scrape(metrics).get(COMPILES, 0.0) - compiles_before
    unhealthy = [status for _, status, _ in samples if status != "SERVING"]
    growth = rss_growth(samples, start, until)
    failed = {
        "mismatches": len(tally.mismatches), "held_after": left, "compiles_after_warmup": compiles,
        "unhealthy_samples": len(unhealthy), "unexpected_statuses": tally.unexpected,
        "rss_growth_over_bound": growth > args.rss_growth_mb,
    }
    return {
        "what": "soak", "streams": args.streams, "seconds": round(wall, 1), "keys": len(keys),
        "reference_s": round(start - started, 1), "calls": sum(tally.outcomes.values()),
        "outcomes": tally.outcomes, "tokens": tally.tokens, "tokens_per_s": round(tally.tokens / wall, 1),
        "rss_mb_first": samples[0][2] if samples else 0.0, "rss_mb_last": samples[-1][2] if samples else 0.0,
        "rss_growth_mb": growth, "rss_growth_bound_mb": args.rss_growth_mb, "health_samples": len(samples),
        "first_mismatches": tally.mismatches[:3], "checks_failed": [name for name, bad in failed.items() if bad],
        **{key: value for key, value in failed.items() if key != "rss_growth_over_bound"},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--serve", help="start `python -m serving --config SERVE` for the run")
    where.add_argument("--target", help="host:port of a running server (with --metrics)")
    p.add_argument("--metrics", help="host:port of the running server's /metrics")
    p.add_argument("--pid", type=int, help="the running server's process id (its memory is sampled)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--prompts", type=int, default=16, help="text prompts in the work set")
    p.add_argument("--no-exec", action="store_true", help="leave out the exec adapter's chats and programs")
    p.add_argument("--rss-growth-mb", type=float, default=256.0)
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between health and memory samples")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    def work(served, metrics: str) -> dict:
        target, pid = (served.target, served.proc.pid) if served else (args.target, args.pid)
        return asyncio.run(soak(args, target, metrics, pid))

    return run_checked(args.serve, args.metrics, work)


if __name__ == "__main__":
    sys.exit(main())
