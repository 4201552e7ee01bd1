"""Mixture-of-experts benchmark: the engine's sparse layer (models/experts.SparseMoE) on a
Qwen3-30B-A3B-shaped layer with random weights, grouped matmul against the dense einsum over every
expert, and the collective bytes per token of its expert-parallel step against the minimum.

    python tools/bench.py moe                                   # tokens/s and EP bytes, one JSON line each
    python tools/bench.py moe --tokens 1 64 256 --matmul tiled dense ragged_dot

The throughput rows time one layer (router, grouping, the experts' MLPs, the weighted sum) jitted
on this machine's default device. The bytes row compiles the same layer in a child process with
`--ep` virtual CPU devices on the expert axis and sums the operands of every collective in its HLO.
The minimum is an all-reduce's: every device must end with each token's [hidden] output, whose
parts live on `ep` devices, so a ring moves 2 (ep - 1) / ep x hidden x bytes per token and device.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench_common import emit

SHAPE = dict(hidden=2048, experts=128, top_k=8, width=768)  # Qwen3-30B-A3B's sparse layer
HLO_DTYPES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}
COLLECTIVE = re.compile(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^=]*? (all-reduce|all-to-all|all-gather|reduce-scatter|"
                        r"collective-permute)(?:-start)?\(")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--matmul", nargs="+", default=["tiled", "ragged_dot", "dense"],
                        choices=["tiled", "ragged_dot", "dense"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ep", type=int, default=4, help="expert-axis devices for the bytes row (0: skip)")
    parser.add_argument("--ep-tokens", type=int, default=64)


def _layer(placement, dtype):
    """The engine's sparse block at the Qwen3-30B-A3B shape, random weights, and its jitted call."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxinfer.models.experts import ExpertsSpec, SparseMoE

    spec = ExpertsSpec(module="mlp", projections=("gate_proj", "up_proj", "down_proj"),
                       num_experts=SHAPE["experts"], top_k=SHAPE["top_k"], width=SHAPE["width"], renormalize=True)
    block = SparseMoE(SHAPE["hidden"], spec, placement, jnp.dtype(dtype), nnx.Rngs(0))
    return block


def _calls(block, matmul: str):
    """The layer as a jitted function of (its state, x, real): with the grouped matmul, or dense."""
    import dataclasses

    import jax
    from flax import nnx

    from jaxinfer.layers.moe import dense_experts, route

    block.placement = dataclasses.replace(block.placement, matmul="auto" if matmul == "dense" else matmul)
    graphdef, state = nnx.split(block)

    def grouped(state, x, real):
        return nnx.merge(graphdef, state)(x, real)

    def dense(state, x, real):
        layer = nnx.merge(graphdef, state)
        weights, ids = route(layer.gate(x), layer.top_k, layer.renormalize)
        return dense_experts(x, weights, ids, *layer.experts.weights()).astype(x.dtype)

    return jax.jit(dense if matmul == "dense" else grouped), state


def _time(call, args: tuple, repeats: int) -> float:
    call(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        call(*args).block_until_ready()
    return (time.perf_counter() - start) / repeats


def bench_throughput(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp

    from jaxinfer.models.experts import ExpertPlacement

    block = _layer(ExpertPlacement(), args.dtype)
    seconds_by: dict[tuple[int, str], float] = {}
    for tokens in args.tokens:
        x = jax.random.normal(jax.random.key(tokens), (tokens, SHAPE["hidden"])).astype(args.dtype)
        real = jnp.ones(tokens, bool)
        for matmul in args.matmul:
            call, state = _calls(block, matmul)
            seconds = seconds_by[(tokens, matmul)] = _time(call, (state, x, real), args.repeats)
            emit(dict(what="moe_layer", backend=jax.default_backend(), dtype=args.dtype, tokens=tokens,
                      matmul=matmul, ms=round(1000 * seconds, 2), tokens_per_s=round(tokens / seconds, 1), **SHAPE))
        for matmul in args.matmul:
            if matmul != "dense" and (tokens, "dense") in seconds_by:
                emit(dict(what="moe_layer_ratio", tokens=tokens, matmul=matmul,
                          speedup_vs_dense=round(seconds_by[(tokens, "dense")] / seconds_by[(tokens, matmul)], 2)))


def collective_bytes(hlo: str) -> list[dict]:
    """Every collective of a compiled module's text: its kind and its result's bytes."""
    found = []
    for dtype, dims, kind in COLLECTIVE.findall(hlo):
        size = HLO_DTYPES.get(dtype, 4)
        for dim in filter(None, dims.split(",")):
            size *= int(dim)
        found.append(dict(kind=kind, bytes=size, shape=f"{dtype}[{dims}]"))
    return found


def ep_child(ep: int, tokens: int, dtype: str) -> dict:
    """(In the child with `ep` devices.) The expert-parallel layer's collectives at `tokens` tokens."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxinfer.models.experts import ExpertPlacement
    from jaxinfer.parallel import make_mesh, named_sharding

    mesh = make_mesh(1, 1, expert=ep)
    block = nnx.eval_shape(lambda: _layer(ExpertPlacement(expert=ep), dtype))
    graphdef, state = nnx.split(block)
    shardings = jax.tree.map(lambda p: named_sharding(p.value.shape, p.logical_axes, mesh), state,
                             is_leaf=lambda p: isinstance(p, nnx.Param))
    abstract = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.value.shape, p.value.dtype, sharding=s), state,
                            shardings, is_leaf=lambda p: isinstance(p, nnx.Param))
    replicated = named_sharding((tokens, SHAPE["hidden"]), (None, None), mesh)
    x = jax.ShapeDtypeStruct((tokens, SHAPE["hidden"]), jnp.dtype(dtype), sharding=replicated)
    real = jax.ShapeDtypeStruct((tokens,), jnp.bool_, sharding=named_sharding((tokens,), (None,), mesh))

    def call(state, x, real):
        return nnx.merge(graphdef, state)(x, real)

    hlo = jax.jit(call).lower(abstract, x, real).compile().as_text()
    return dict(collectives=collective_bytes(hlo))


def bench_ep_bytes(args: argparse.Namespace) -> None:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.ep}", JAX_PLATFORMS="cpu")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import json, bench_moe; "
            f"print('EP ' + json.dumps(bench_moe.ep_child({args.ep}, {args.ep_tokens}, {args.dtype!r})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("EP "))[3:])
    width = HLO_DTYPES["bf16" if args.dtype == "bfloat16" else "f32"]
    hidden_bytes = SHAPE["hidden"] * width
    operand = sum(c["bytes"] for c in found["collectives"]) / args.ep_tokens
    ring = 2 * (args.ep - 1) / args.ep
    emit(dict(what="moe_ep_bytes", ep=args.ep, tokens=args.ep_tokens, dtype=args.dtype,
              collectives=found["collectives"], operand_bytes_per_token=operand,
              ring_bytes_per_token_per_device=round(ring * operand),
              minimum_bytes_per_token_per_device=round(ring * hidden_bytes),
              all_to_all_bytes_per_token=round(2 * SHAPE["top_k"] * (args.ep - 1) / args.ep * hidden_bytes)))


def bench(args: argparse.Namespace) -> None:
    bench_throughput(args)
    if args.ep:
        bench_ep_bytes(args)
