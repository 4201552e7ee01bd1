"""Benchmarks for multi-process groups and data-parallel replicas.

    python tools/bench_multihost.py control      # the lockstep control channel: bytes and us per step
    python tools/bench_multihost.py replicas     # 1 replica on 1 device vs 2 replicas on 2 devices (CPU)
    python tools/bench_multihost.py put          # host arrays onto a two-process mesh: device_put vs to_devices

`control` sends real `HostBatch` frames over loopback TCP (encode, send, receive, decode) at the
shapes of the CPU, test and GPU configs, decode and prefill buckets. `replicas` runs the same
greedy workload (random prompts, exactly N new tokens) on one engine and on a ReplicaSet of two,
each in a fresh process with 2 CPU devices, and prints the ratio. `put` starts a real group of two
processes (gloo over loopback) and times placing the same host arrays with `jax.device_put`, which
first checks across processes that every process sends the same value, and with
`jaxinfer.parallel.transfer.to_devices`, which does not: a step's packed inputs at the decode and
prefill buckets of the CPU and GPU configs, and every SmolLM2-135M tensor with its sharding.
Output: one JSON line each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
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


PUT_CHILD = r"""
import json, sys, time
import jax, numpy as np
from jaxinfer.config import load_engine_config
from jaxinfer.engine.step import ModelRunner
from jaxinfer.parallel import make_mesh, named_sharding
from jaxinfer.parallel.distributed import ProcessGroup, initialize
from jaxinfer.parallel.transfer import to_devices
from jaxinfer.weights.gguf_file import GGUFCheckpoint
from jaxinfer.weights.loader import abstract_model, parameters
from jaxinfer.weights.registry import resolve
port, process_id, repeats, repo = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
initialize(ProcessGroup(f"127.0.0.1:{port}", 2, process_id))
mesh = make_mesh()
ways = {"device_put": jax.device_put, "to_devices": to_devices}
def emit(record):
    if process_id == 0:
        print(json.dumps(record), flush=True)
def put_us(way, host, sharding):
    for _ in range(3):
        jax.block_until_ready(way(host, sharding))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(way(host, sharding))
    return round(1e6 * (time.perf_counter() - start) / repeats, 1)
gguf = GGUFCheckpoint(resolve("smollm2-135m").path)
model_cfg = gguf.config()
replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
for config in ("engine-cpu.toml", "engine-gpu.toml"):
    cfg = load_engine_config(f"{repo}/configs/{config}")
    runner = ModelRunner.__new__(ModelRunner)  # only empty_batch: no weights or device state needed
    runner.cfg, runner.max_pages_per_seq = cfg, cfg.max_pages_per_seq(model_cfg)
    for bucket in sorted({min(cfg.max_seqs, cfg.token_buckets[-1]), cfg.token_buckets[-1]}):
        packed = runner.empty_batch(bucket).packed()
        emit(dict(what="put_step_inputs", config=config, bucket=bucket, bytes=packed.words.nbytes,
                  **{f"{name}_us": put_us(way, packed, replicated) for name, way in ways.items()}))
params = parameters(abstract_model(model_cfg, np.float32, None))
tensors = [(np.asarray(array, np.float32), named_sharding(array.shape, params[name].logical_axes, mesh))
           for name, _, array in gguf.iter_tensors(model_cfg) if name in params]
seconds = {}
for name, way in [*ways.items(), *ways.items()]:  # each way twice, alternated
    start = time.perf_counter()
    placed = jax.block_until_ready([way(array, sharding) for array, sharding in tensors])
    seconds.setdefault(name, []).append(round(time.perf_counter() - start, 2))
    del placed
emit(dict(what="put_weights", model="smollm2-135m", tensors=len(tensors),
          bytes=sum(array.nbytes for array, _ in tensors), **{f"{name}_s": s for name, s in seconds.items()}))
"""


def bench_put(args: argparse.Namespace) -> None:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}", JAX_PLATFORMS="cpu")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as logs:
        # Files, not pipes: a child blocked on a full pipe would leave the other waiting in a collective.
        paths = [Path(logs, f"{process_id}.{stream}") for process_id in (0, 1) for stream in ("out", "err")]
        with contextlib.ExitStack() as files:
            streams = [files.enter_context(open(path, "w")) for path in paths]
            children = [subprocess.Popen([sys.executable, "-c", PUT_CHILD, str(port), str(process_id),
                                          str(args.repeats), str(REPO)], env=env, cwd=REPO,
                                         stdout=streams[2 * process_id], stderr=streams[2 * process_id + 1])
                        for process_id in (0, 1)]
            try:
                deadline = time.monotonic() + 1800
                for child in children:
                    child.wait(timeout=max(1.0, deadline - time.monotonic()))
            finally:
                for child in children:
                    if child.poll() is None:
                        child.kill()
                        child.wait()
        outputs = [(paths[2 * i].read_text(), paths[2 * i + 1].read_text()) for i in (0, 1)]
    for child, (_, stderr) in zip(children, outputs, strict=True):
        if child.returncode != 0:
            raise SystemExit(stderr[-3000:])
    emit(dict(what="put_group", processes=2, devices_per_process=args.devices, repeats=args.repeats,
              cpus=os.cpu_count()))
    for line in outputs[0][0].splitlines():
        if line.startswith("{"):  # gloo prints its connections to stdout too
            print(line, flush=True)


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
    put = sub.add_parser("put")
    put.add_argument("--devices", type=int, default=2, help="CPU devices in each of the two processes")
    put.add_argument("--repeats", type=int, default=200, help="timed placements of each step's inputs")
    args = p.parse_args()
    {"control": bench_control, "replicas": bench_replicas, "put": bench_put}[args.workload](args)


if __name__ == "__main__":
    main()
