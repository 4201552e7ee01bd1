"""Benchmark: jaxinfer on SmolLM2-135M (CPU), with transformers' generate() on the same work.

    python tools/bench.py                     # batch 1 and 8, 64 prompt tokens, 32 new tokens
    python tools/bench.py --batch 1 8 32 --in-len 128 --out-len 64 --no-peer

Prints one JSON line per measurement: jaxinfer's, the peer's (../shared/bench/hf_peer.py, run in
the same command so both share the machine and the moment), and their ratio. Prompts are random
token ids; every request generates exactly --out-len tokens (EOS ignored), as the peer does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PEER = REPO.parent / "shared" / "bench" / "hf_peer.py"


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def bench_jaxinfer(args: argparse.Namespace) -> dict[int, float]:
    import jax

    from jaxinfer import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(args.model, args.config)
    emit(dict(what="jaxinfer_env", jax=jax.__version__, backend=jax.default_backend(), devices=len(jax.devices()),
              model=args.model, dtype=np.dtype(llm.dtype).name,
              load_s=round(llm.load_seconds, 1), warmup_s=round(llm.warmup_seconds, 1),
              compiles=llm.runner.num_compiles, buckets=list(llm.config.token_buckets),
              startup_s=round(time.perf_counter() - start, 1)))
    vocab = llm.model_config.vocab_size
    params = SamplingParams(max_tokens=args.out_len, min_tokens=args.out_len, ignore_eos=True, temperature=0.0)
    rng = np.random.default_rng(0)
    results = {}
    for batch in args.batch:
        prompts = [rng.integers(3, vocab - 1, args.in_len).tolist() for _ in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=2, min_tokens=2, ignore_eos=True, temperature=0.0))
        steps_before = llm.engine.stats.steps
        t = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t
        new = sum(len(o.token_ids) for o in outputs)
        results[batch] = new / seconds
        emit(dict(what="jaxinfer_generate", batch=batch, in_len=args.in_len, new_tokens=new // batch,
                  s=round(seconds, 3), tok_per_s=round(new / seconds, 1),
                  steps=llm.engine.stats.steps - steps_before,
                  compiles_after_warmup=llm.runner.compiles_after_warmup))
    return results


def bench_peer(args: argparse.Namespace) -> dict[int, float]:
    runner = REPO / "tools" / "run_peer.py"
    command = [sys.executable, str(runner), str(args.peer), "--shape", "smollm2-135m", "--device", "cpu",
               "--batch", *map(str, args.batch), "--in-len", str(args.in_len), "--out-len", str(args.out_len)]
    proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, TQDM_DISABLE="1"))
    if proc.returncode != 0:
        emit(dict(what="peer_error", stderr=proc.stderr[-2000:]))
        return {}
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            print(line, flush=True)
            if record.get("what") == "hf_generate":
                results[record["batch"]] = record["tok_per_s"]
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--config", default=None, help="engine TOML")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--in-len", type=int, default=64)
    p.add_argument("--out-len", type=int, default=32)
    p.add_argument("--peer", type=Path, default=DEFAULT_PEER)
    p.add_argument("--no-peer", action="store_true")
    args = p.parse_args()
    ours = bench_jaxinfer(args)
    if args.no_peer or not args.peer.exists():
        return
    theirs = bench_peer(args)
    for batch in args.batch:
        if batch in theirs:
            emit(dict(what="ratio", batch=batch, jaxinfer_over_hf=round(ours[batch] / theirs[batch], 2)))


if __name__ == "__main__":
    main()
