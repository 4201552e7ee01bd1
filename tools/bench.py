"""Benchmarks: jaxinfer on SmolLM2-135M, each with its transformers peer run in the same command.

    python tools/bench.py uniform --batch 1 8       # B prompts of one length; peer: ../shared/bench/hf_peer.py
    python tools/bench.py offline                   # 64 prompts of 16-256 tokens, 64 new; overlap on/off vs HF
    python tools/bench.py shared-prefix             # 32 requests after one 512-token system prompt: TTFT
    python tools/bench.py host                      # host share of the step wall time at batch 32
    python tools/bench.py all                       # offline, shared-prefix and host (what `make bench` runs)
    python tools/bench.py gemm                      # XLA's GEMM rate on SmolLM2's MLP shapes (the compute ceiling)
    python tools/bench.py penalties                 # batch 32 with no, half and all rows penalized
    python tools/bench.py guided                    # 32 JSON-schema requests vs the same unconstrained; schema compile
    python tools/bench.py guided-draft              # a draft's proposals accepted on JSON-schema chats, masked vs not
    python tools/bench.py guided-sizes              # the size check before a guided compile: states, pair bounds
    python tools/bench.py scoring                   # 64 prompts scored (prompt_logprobs) vs unscored, vs HF forward
    python tools/bench.py tiers                     # TTFT of a 2,048-token prefix: recomputed, L1, L2, L3 (file)
    python tools/bench.py disagg                    # prefill/decode hand-off through the file store vs one engine
    python tools/bench.py spec                      # speculative decoding vs none, batch 1 and 8, 128 new tokens
    python tools/bench.py processor                 # WebAssembly processor instructions/s vs wasmtime
    python tools/bench.py --no-peer shape           # llama3-8b shape, random weights: decode vs roofline, offline
    python tools/bench.py --no-peer start           # engine start on a warm compilation cache: load, lower, read
    python tools/bench.py --no-peer moe             # a Qwen3-30B-A3B sparse layer: grouped vs dense; EP bytes
    python tools/bench.py weights                   # packed weights: bytes, tok/s, perplexity per format vs HF

Prints one JSON line per measurement and the ratios to the peer. Prompts are random token ids
(seeded); throughput runs generate exactly the asked number of tokens (EOS ignored), as the peers
do. Each jaxinfer measurement is preceded by a short run that touches every bucket it will use.

This module is the command line and its dispatch; the benchmarks live by family in bench_throughput.py,
bench_kv.py, bench_features.py, bench_guided.py and bench_compute.py (the peers' runs in bench_peers.py).
"""

from __future__ import annotations

import argparse

import bench_moe
import bench_weights
import processor_bench
import shape_bench
from bench_common import load_llm
from bench_compute import bench_gemm, bench_sampler, bench_start
from bench_features import bench_exec, bench_lora, bench_spec
from bench_guided import bench_guided, bench_guided_draft, bench_guided_sizes
from bench_kv import bench_disagg, bench_shared_prefix, bench_tiers
from bench_peers import REPO
from bench_throughput import bench_host, bench_offline, bench_penalties, bench_scoring, bench_uniform


def bench_all(args: argparse.Namespace) -> None:
    llm = load_llm(args)
    bench_offline(args, llm)
    bench_shared_prefix(args, llm)
    bench_host(args, llm)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--config", default=str(REPO / "configs" / "engine-cpu.toml"), help="engine TOML")
    p.add_argument("--no-peer", action="store_true")
    sub = p.add_subparsers(dest="workload", required=True)
    uniform = sub.add_parser("uniform")
    uniform.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    uniform.add_argument("--in-len", type=int, default=64)
    uniform.add_argument("--out-len", type=int, default=32)
    spec = sub.add_parser("spec")
    spec.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    spec.add_argument("--out-len", type=int, default=128)
    spec.add_argument("--draft-model", default="", help="default: the target's first --draft-layers layers")
    spec.add_argument("--draft-layers", type=int, default=2)
    spec.add_argument("--num-draft-tokens", type=int, default=4)
    spec.add_argument("--draft-confidence", type=float, default=0.0)
    exec_ = sub.add_parser("exec", description=bench_exec.__doc__.splitlines()[0])
    exec_.add_argument("--batch-size", type=int, default=8)
    exec_.add_argument("--in-len", type=int, default=32)
    exec_.add_argument("--out-len", type=int, default=64)
    exec_.add_argument("--steps-per-step", type=int, default=0, help="engine.exec_steps_per_step (0: by platform)")
    lora = sub.add_parser("lora", description=bench_lora.__doc__.splitlines()[0])
    lora.add_argument("--batch-size", type=int, default=8)
    lora.add_argument("--in-len", type=int, default=32)
    lora.add_argument("--out-len", type=int, default=64)
    lora.add_argument("--adapters", type=int, default=4, choices=range(1, 65), metavar="1..64")
    lora.add_argument("--rank", type=int, default=16)
    guided_draft = sub.add_parser("guided-draft", description=bench_guided_draft.__doc__.splitlines()[0])
    guided_draft.add_argument("--draft-model", default="smollm2-135m-draft")
    guided_draft.add_argument("--num-draft-tokens", type=int, default=2)
    sub.add_parser("guided-sizes", description=bench_guided_sizes.__doc__.splitlines()[0])
    gemm = sub.add_parser("gemm")
    gemm.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64, 256])
    sampler = sub.add_parser("sampler", description=bench_sampler.__doc__.splitlines()[0])
    sampler.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    sampler.add_argument("--vocab", type=int, default=128256)
    sampler.add_argument("--repeats", type=int, default=5)
    bench_moe.add_arguments(sub.add_parser("moe", description=bench_moe.__doc__.splitlines()[0]))
    bench_weights.add_arguments(sub.add_parser("weights", description=bench_weights.__doc__.splitlines()[0]))
    shape_bench.add_arguments(sub.add_parser("shape", description=shape_bench.__doc__.splitlines()[0]))
    start = sub.add_parser("start", description=bench_start.__doc__.splitlines()[0])
    start.add_argument("--repeats", type=int, default=3)
    processor_bench.add_arguments(sub.add_parser("processor", description=processor_bench.__doc__.splitlines()[0],
                                                 epilog=processor_bench.ISSUE_SCALE))
    workloads = {"offline": bench_offline, "shared-prefix": bench_shared_prefix, "host": bench_host,
                 "tiers": bench_tiers, "disagg": bench_disagg, "penalties": bench_penalties, "scoring": bench_scoring,
                 "guided": bench_guided,
                 "all": bench_all}
    for name in workloads:
        w = sub.add_parser(name)
        w.add_argument("--requests", type=int, default=64)
        w.add_argument("--prefix-requests", type=int, default=32)
        w.add_argument("--min-len", type=int, default=16)
        w.add_argument("--max-len", type=int, default=256)
        w.add_argument("--out-len", type=int, default=64)
        w.add_argument("--hf-batch", type=int, nargs="+", default=[64])
        w.add_argument("--prefix-len", type=int, default=512)
        w.add_argument("--batch-size", type=int, default=32)
        w.add_argument("--in-len", type=int, default=128)
        w.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.workload == "uniform":
        bench_uniform(args)
    elif args.workload == "gemm":
        bench_gemm(args)
    elif args.workload == "sampler":
        bench_sampler(args)
    elif args.workload == "spec":
        bench_spec(args)
    elif args.workload == "processor":
        processor_bench.bench(args)
    elif args.workload == "shape":
        shape_bench.bench(args)
    elif args.workload == "moe":
        bench_moe.bench(args)
    elif args.workload == "weights":
        bench_weights.bench(args)
    elif args.workload == "exec":
        bench_exec(args)
    elif args.workload == "guided-sizes":
        bench_guided_sizes(args)
    elif args.workload == "guided-draft":
        bench_guided_draft(args)
    elif args.workload == "lora":
        bench_lora(args)
    elif args.workload == "start":
        bench_start(args)
    else:
        workloads[args.workload](args)


if __name__ == "__main__":
    main()
