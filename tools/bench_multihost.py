"""Benchmarks for multi-process groups and data-parallel replicas.

    python tools/bench_multihost.py control      # the lockstep control channel: bytes and us per step
    python tools/bench_multihost.py replicas     # 1 replica on 1 device vs 2 replicas on 2 devices (CPU)

`control` sends real `HostBatch` frames over loopback TCP (encode, send, receive, decode) at the
shapes of the CPU, test and GPU configs, decode and prefill buckets. `replicas` runs the same
greedy workload (random prompts, exactly N new tokens) on one engine and on a ReplicaSet of two,
each in a fresh process with 2 CPU devices, and prints the ratio. Output: one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def bench_control(args: argparse.Namespace) -> None:
    from jaxinfer.config import load_engine_config
    from jaxinfer.engine.step import ModelRunner
    from jaxinfer.parallel.lockstep import encode, pack_step
    from jaxinfer.weights.gguf_file import GGUFCheckpoint
    from jaxinfer.weights.registry import resolve

    model_cfg = GGUFCheckpoint(resolve("smollm2-135m").path).config()
    for config in ("engine-test.toml", "engine-cpu.toml", "engine-gpu.toml"):
        cfg = load_engine_config(REPO / "configs" / config)
        runner = ModelRunner.__new__(ModelRunner)  # only empty_batch: no weights or device state needed
        runner.cfg, runner.max_pages_per_seq = cfg, cfg.max_pages_per_seq(model_cfg)
        for bucket in sorted({cfg.token_buckets[0], min(cfg.max_seqs, cfg.token_buckets[-1]), cfg.token_buckets[-1]}):
            batch = runner.empty_batch(bucket)
            context_pages = min(-(-args.context // cfg.page_size), runner.max_pages_per_seq)
            rng = np.random.default_rng(0)  # every row `--context` tokens long, on random pages
            batch.page_table[:, :context_pages] = rng.integers(1, cfg.num_pages, (len(batch.page_table), context_pages))
            arrays = batch.arrays()
            emit(dict(what="lockstep_frame", config=config, bucket=bucket, rows=runner.rows_for(bucket),
                      context=args.context, pages_per_row=runner.max_pages_per_seq,
                      bytes=len(pack_step(1, 0, arrays)), full_table_bytes=len(encode({}, arrays)),
                      us_per_step=round(_round_trip_us(arrays, args.steps), 1)))


def _round_trip_us(arrays: dict[str, np.ndarray], steps: int) -> float:
    """Leader packs and sends; a follower thread receives and unpacks: mean time per frame."""
    from jaxinfer.parallel.lockstep import pack_step, receive, unpack_step

    left, right = socket.socketpair()
    done = threading.Event()

    def follower() -> None:
        for _ in range(steps):
            unpack_step(*receive(right))
        done.set()

    threading.Thread(target=follower, daemon=True).start()
    start = time.perf_counter()
    for number in range(steps):
        left.sendall(pack_step(number, number - 1, arrays))
    done.wait()
    seconds = time.perf_counter() - start
    left.close()
    right.close()
    return 1e6 * seconds / steps


REPLICA_CHILD = r"""
import json, sys, time
import numpy as np
from jaxinfer import LLM, SamplingParams
replicas, requests, in_len, out_len = map(int, sys.argv[1:5])
llm = LLM("smollm2-135m", sys.argv[5], mesh_data=replicas, mesh_model=1)
rng = np.random.default_rng(0)
params = SamplingParams(max_tokens=out_len, min_tokens=out_len, ignore_eos=True, temperature=0.0)
prompts = [rng.integers(3, llm.model_config.vocab_size - 1, in_len).tolist() for _ in range(requests)]
llm.generate(prompts[:2], params)  # every bucket the run uses has run once
engine = llm.new_engine()
start = time.perf_counter()
outputs = engine.generate([llm.request(p, params) for p in prompts])
seconds = time.perf_counter() - start
tokens = sum(len(o.token_ids) for o in outputs)
print(json.dumps(dict(replicas=replicas, tokens=tokens, seconds=round(seconds, 3), tok_s=round(tokens / seconds, 1),
                      ids=[o.token_ids for o in outputs])))
"""


def bench_replicas(args: argparse.Namespace) -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    results = {}
    for replicas in (1, 2):
        proc = subprocess.run([sys.executable, "-c", REPLICA_CHILD, str(replicas), str(args.requests),
                               str(args.in_len), str(args.out_len), args.config], env=env, capture_output=True,
                              text=True, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        results[replicas] = json.loads(proc.stdout.strip().splitlines()[-1])
        emit(dict(what="jaxinfer_replicas", **{k: v for k, v in results[replicas].items() if k != "ids"}))
    emit(dict(what="replicas_ratio", requests=args.requests, in_len=args.in_len, out_len=args.out_len,
              cpus=os.cpu_count(), two_over_one=round(results[2]["tok_s"] / results[1]["tok_s"], 3),
              identical_output=results[1]["ids"] == results[2]["ids"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="workload", required=True)
    control = sub.add_parser("control")
    control.add_argument("--steps", type=int, default=2000)
    control.add_argument("--context", type=int, default=2048, help="tokens per row (the page table's used width)")
    replicas = sub.add_parser("replicas")
    replicas.add_argument("--requests", type=int, default=16)
    replicas.add_argument("--in-len", type=int, default=64)
    replicas.add_argument("--out-len", type=int, default=64)
    replicas.add_argument("--config", default=str(REPO / "configs" / "engine-cpu.toml"))
    args = p.parse_args()
    {"control": bench_control, "replicas": bench_replicas}[args.workload](args)


if __name__ == "__main__":
    main()
