"""Mixture-of-experts benchmark: the engine's sparse layer (models/experts.SparseMoE) on a
Qwen3-30B-A3B-shaped layer with random weights, grouped matmul against the dense einsum over every
expert, and the collective bytes per token of its expert-parallel step against the minimum.

    python tools/bench.py moe                                   # tokens/s and EP bytes, one JSON line each
    python tools/bench.py moe --tokens 1 64 256 --matmul tiled dense ragged_dot
    python tools/bench.py moe --weights-dtype float int8 int4 --matmul tiled --ep 0   # packed experts

The throughput rows time one layer (router, grouping, the experts' MLPs, the weighted sum) jitted
on this machine's default device. The bytes row compiles, in a child process with `--ep` virtual
CPU devices on the expert axis, the same layer and the whole model's forward pass (the
Qwen3-30B-A3B shape cut to `--ep-layers` layers: embedding, attention over the paged cache, the
sparse layers, the final norm and logits), and sums the result bytes of every collective in their HLO.
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
    parser.add_argument("--weights-dtype", nargs="+", default=["float"], choices=["float", "int8", "int4"],
                        help="the experts' storage for the throughput rows: float, or packed (group 32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ep", type=int, default=4, help="expert-axis devices for the bytes row (0: skip)")
    parser.add_argument("--ep-tokens", type=int, default=64)
    parser.add_argument("--ep-layers", type=int, default=2, help="sparse layers of the forward pass compiled")


def _layer(placement, dtype, weights_dtype: str = "float"):
    """The engine's sparse block at the Qwen3-30B-A3B shape with random weights; `weights_dtype`
    int8 / int4: the experts packed (random values, scales of about N(0, 0.02)'s size)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxinfer.layers.quant import load_format
    from jaxinfer.models.experts import ExpertsSpec, SparseMoE

    projections = ("gate_proj", "up_proj", "down_proj")
    spec = ExpertsSpec(module="mlp", projections=projections,
                       num_experts=SHAPE["experts"], top_k=SHAPE["top_k"], width=SHAPE["width"], renormalize=True)
    packed = {} if weights_dtype == "float" else {
        f"experts.{name}": load_format(8 if weights_dtype == "int8" else 4, 32) for name in projections}
    block = SparseMoE(SHAPE["hidden"], spec, placement, jnp.dtype(dtype), nnx.Rngs(0), packed)
    for index, (path, param) in enumerate(nnx.iter_graph(block.experts)):
        if isinstance(param, nnx.Param) and str(path[-1]).endswith(("_q", "_scale")):
            value = param.get_value()
            if str(path[-1]).endswith("_q"):
                bits = jax.random.bits(jax.random.key(index), value.shape, jnp.uint8)
                param.set_value(jax.lax.bitcast_convert_type(bits, value.dtype))
            else:
                param.set_value(jnp.full(value.shape, 0.005, value.dtype))
    return block


def expert_bytes(block) -> int:
    """Bytes of the block's expert stacks as stored."""
    from flax import nnx

    return sum(param.get_value().nbytes for _, param in nnx.iter_graph(block.experts) if isinstance(param, nnx.Param))


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

    for weights_dtype in args.weights_dtype:
        block = _layer(ExpertPlacement(), args.dtype, weights_dtype)
        stored = expert_bytes(block)
        seconds_by: dict[tuple[int, str], float] = {}
        for tokens in args.tokens:
            x = jax.random.normal(jax.random.key(tokens), (tokens, SHAPE["hidden"])).astype(args.dtype)
            real = jnp.ones(tokens, bool)
            for matmul in args.matmul:
                call, state = _calls(block, matmul)
                seconds = seconds_by[(tokens, matmul)] = _time(call, (state, x, real), args.repeats)
                emit(dict(what="moe_layer", backend=jax.default_backend(), dtype=args.dtype, weights=weights_dtype,
                          expert_bytes=stored, tokens=tokens, matmul=matmul, ms=round(1000 * seconds, 2),
                          tokens_per_s=round(tokens / seconds, 1), **SHAPE))
            for matmul in args.matmul:
                if matmul != "dense" and (tokens, "dense") in seconds_by:
                    emit(dict(what="moe_layer_ratio", weights=weights_dtype, tokens=tokens, matmul=matmul,
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

    lowered = jax.jit(call).lower(abstract, x, real)
    # the program's own all-reduce element type: XLA's CPU compiler promotes a bf16 all-reduce to f32
    program = re.findall(r"stablehlo\.all_reduce.*?\^bb0\(%\w+: tensor<(\w+)>", lowered.as_text(), re.S)
    return dict(collectives=collective_bytes(lowered.compile().as_text()), program_all_reduce_dtypes=program)


QWEN3_30B_A3B = dict(architecture="qwen3_moe", vocab_size=151_936, hidden_size=2048, intermediate_size=6144,
                     num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True, rope_theta=1e6)


def forward_collectives(ep: int, tokens: int, dtype: str, layers: int) -> list[dict]:
    """(In the child.) The collectives of the model's forward pass at `tokens` tokens, compiled from
    abstract arrays with the serving shardings (no weights are made)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxinfer.config import ModelConfig
    from jaxinfer.layers.attention import AttentionMetadata
    from jaxinfer.moe_config import MoEConfig
    from jaxinfer.parallel import make_mesh, named_sharding
    from jaxinfer.weights.loader import abstract_model

    moe = MoEConfig(num_experts=SHAPE["experts"], top_k=SHAPE["top_k"], intermediate_size=SHAPE["width"],
                    sparse_layers=tuple(range(layers)))
    cfg = ModelConfig(**QWEN3_30B_A3B, num_layers=layers, moe=moe)
    mesh = make_mesh(1, 1, expert=ep)
    model = abstract_model(cfg, jnp.dtype(dtype), None, mesh)
    graphdef, state = nnx.split(model)
    is_param = lambda p: isinstance(p, nnx.Param)  # noqa: E731
    abstract_state = jax.tree.map(lambda p: jax.ShapeDtypeStruct(
        p.value.shape, p.value.dtype, sharding=named_sharding(p.value.shape, p.logical_axes, mesh)), state,
        is_leaf=is_param)
    every = named_sharding((1,), (None,), mesh)

    def replicated(shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=every)

    pages = 64
    caches = jax.tree.map(lambda a: replicated(a.shape, a.dtype), jax.eval_shape(lambda: model.empty_caches(pages, 16)))
    meta = AttentionMetadata(positions=replicated((tokens,)), seq_rows=replicated((tokens,)),
                             page_table=replicated((4, pages // 4)), write_slots=replicated((tokens,)))

    def forward(state, caches, token_ids, meta):
        merged = nnx.merge(graphdef, state)
        hidden, caches = merged(token_ids, caches, meta)
        return merged.logits(hidden), caches

    hlo = jax.jit(forward).lower(abstract_state, caches, replicated((tokens,)), meta).compile().as_text()
    return collective_bytes(hlo)


def bench_ep_bytes(args: argparse.Namespace) -> None:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.ep}", JAX_PLATFORMS="cpu")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import json, bench_moe; "
            f"layer = bench_moe.ep_child({args.ep}, {args.ep_tokens}, {args.dtype!r}); "
            f"layer['forward'] = bench_moe.forward_collectives({args.ep}, {args.ep_tokens}, {args.dtype!r}, "
            f"{args.ep_layers}); print('EP ' + json.dumps(layer))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("EP "))[3:])
    width = HLO_DTYPES["bf16" if args.dtype == "bfloat16" else "f32"]
    hidden_bytes = SHAPE["hidden"] * width
    operand = sum(c["bytes"] for c in found["collectives"]) / args.ep_tokens
    ring = 2 * (args.ep - 1) / args.ep
    forward = sum(c["bytes"] for c in found["forward"]) / args.ep_tokens
    emit(dict(what="moe_ep_bytes", ep=args.ep, tokens=args.ep_tokens, dtype=args.dtype,
              layer_collectives=found["collectives"], layer_bytes_per_token=operand,
              program_all_reduce_dtypes=found["program_all_reduce_dtypes"],
              layer_ring_bytes_per_token_per_device=round(ring * operand),
              minimum_bytes_per_token_per_device=round(ring * hidden_bytes),
              all_to_all_bytes_per_token=round(2 * SHAPE["top_k"] * (args.ep - 1) / args.ep * hidden_bytes),
              forward_layers=args.ep_layers, forward_collectives=found["forward"],
              forward_bytes_per_token_per_sparse_layer=forward / args.ep_layers))


def bench(args: argparse.Namespace) -> None:
    bench_throughput(args)
    if args.ep:
        bench_ep_bytes(args)
