"""A model shape with random weights (no download): decode steps next to the roofline, and offline throughput.

    python tools/bench.py --no-peer shape --shape llama3-8b            # an accelerator (issue 8's workload)
    python tools/bench.py --no-peer shape --shape tiny-llama3 --batch 1 4 --decode-tokens 8 \\
        --offline 8:16:8                                                # a CPU smoke run

The shape becomes a checkpoint folder of kind ``random`` (``config.json`` and the ``RANDOM_WEIGHTS``
marker, with the real Llama-3 ``tokenizer.json`` that ``make setup`` extracts); the engine draws
N(0, 0.02) weights on device at load, in the platform's dtype (bfloat16 on accelerators).

Printed, one JSON line each:

* ``ceilings``: the measured matmul rate (a square matmul in the model's dtype) and copy bandwidth
  (reads plus writes of one large array), the two rooflines.
* ``jaxinfer_decode_step`` per batch: B prompts of ``--in-len`` tokens are prefilled, then
  ``--decode-tokens`` more are decoded. ms per decode step is the difference between the run with
  the decode tokens and the run with one token, divided by their number, so prefill cancels out;
  each run is the fastest of ``--repeats`` (a CI machine's noise made a single pair's difference
  negative once).
  Next to it, the floor: weight bytes (all but the embedding table, whose B rows are read) plus the
  KV bytes of the mean context, over the copy bandwidth; and the step's FLOPs over the matmul rate.
  ``fraction_of_roofline`` is the floor over the measured time; ``host_ms_per_step`` is the host's
  share of each step (scheduling, building and dispatching the batch, applying the results).
* ``step_profile`` per batch with ``--profile-steps N``: where N decode steps' time goes, per kernel
  and per category, and the share of the step the device is busy (``tools/step_profile.py``).
* ``jaxinfer_offline`` per ``--offline N:IN:OUT``: N requests submitted at once, exactly OUT new
  tokens each; output tokens/s and the compiles after warm-up (which must be 0).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LLAMA3_TOKENIZER = REPO / ".cache" / "llama3" / "tokenizer.json"  # extracted by `make setup`

_LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_act="silu",
               max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
               bos_token_id=128000, eos_token_id=128001)
SHAPES = {
    # the shape of ../shared/bench/hf_peer.py --shape llama3-8b and plain_jax_decode.py
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "tiny-llama3": dict(_LLAMA3, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


def shape_folder(shape: str, directory: Path, tokenizer: Path = LLAMA3_TOKENIZER) -> Path:
    """A checkpoint folder of kind ``random`` for ``shape``."""
    if not tokenizer.exists():
        raise SystemExit(f"{tokenizer} is missing: run `make setup` (it extracts the Llama-3 tokenizer)")
    folder = directory / shape
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))
    (folder / "RANDOM_WEIGHTS").write_text("weights are drawn at load: a model shape for benchmarks\n")
    shutil.copyfile(tokenizer, folder / "tokenizer.json")
    return folder


def _timed(fn, value, repeats: int) -> float:
    """Seconds per call of ``value = fn(value)`` (donated, so no call waits for a fresh buffer)."""
    value = fn(value)
    value.block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        value = fn(value)
    value.block_until_ready()
    return (time.perf_counter() - start) / repeats


def ceilings(dtype, on_cpu: bool) -> dict:
    """Matmul FLOP/s and copy bytes/s (read + write) measured on this device in the model's dtype."""
    import jax
    import jax.numpy as jnp

    n = 2048 if on_cpu else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), dtype) / n**0.5
    matmul_s = _timed(jax.jit(lambda x: x @ a, donate_argnums=0), jnp.eye(n, dtype=dtype), 3 if on_cpu else 10)
    elements = (256 if on_cpu else 1024) * 1024 * 1024 // jnp.dtype(dtype).itemsize
    copy_s = _timed(jax.jit(lambda y: y + 1, donate_argnums=0), jnp.ones((elements,), dtype), 5 if on_cpu else 10)
    return dict(matmul_flops=2 * n**3 / matmul_s, copy_bytes_per_s=2 * elements * jnp.dtype(dtype).itemsize / copy_s)


def model_bytes_and_flops(llm) -> tuple[int, int]:
    """Bytes a decode step reads from the weights (not the embedding table) and matmul FLOPs per token."""
    from jaxinfer.weights.loader import parameters

    weight_bytes, matmul_params = 0, 0
    for name, param in parameters(llm.runner.model).items():
        array = param.get_value()
        if "embed_tokens" in name and not llm.model_config.tie_word_embeddings:
            continue
        weight_bytes += array.nbytes
        if name.endswith(("kernel_q", "weight_q")):  # a packed weight: 4-bit values are two to a byte
            matmul_params += array.size * (2 if array.dtype == np.uint8 else 1)
        elif (array.ndim == 2 and name.endswith("kernel")) or name.endswith("embed_tokens.weight"):
            matmul_params += array.size
    return weight_bytes, 2 * matmul_params


def decode_floor(llm, batch: int, context: float, ceiling: dict, weights: tuple[int, int]) -> dict:
    """The roofline floor of one decode step; ``weights``: ``model_bytes_and_flops(llm)``."""
    m = llm.model_config
    weight_bytes, flops_per_token = weights
    itemsize = np.dtype(llm.dtype).itemsize
    kv_bytes = batch * context * m.num_layers * m.num_kv_heads * m.head_dim * 2 * itemsize
    attention_flops = 4 * batch * context * m.num_layers * m.num_heads * m.head_dim
    memory_ms = (weight_bytes + kv_bytes) / ceiling["copy_bytes_per_s"] * 1e3
    compute_ms = (flops_per_token * batch + attention_flops) / ceiling["matmul_flops"] * 1e3
    return dict(floor_ms=round(max(memory_ms, compute_ms), 3), memory_floor_ms=round(memory_ms, 3),
                compute_floor_ms=round(compute_ms, 3), weight_bytes=weight_bytes, kv_bytes=int(kv_bytes))


def bench_decode(llm, batch: int, args: argparse.Namespace, ceiling: dict, weights: tuple[int, int]) -> None:
    from bench_common import emit, exact, fresh_engine, random_prompts

    prompts = random_prompts(llm, [args.in_len] * batch, seed=batch)
    fresh_engine(llm, prefix_caching=False).generate([llm.request(p, exact(2)) for p in prompts])  # warm buckets
    prefill_s = fastest_run(llm, prompts, 1, args.repeats)[0]
    total_s, engine = fastest_run(llm, prompts, 1 + args.decode_tokens, args.repeats)
    if total_s <= prefill_s:
        raise SystemExit(f"decode timing: {args.decode_tokens} decode tokens took no measurable time over the "
                         f"prefill ({total_s:.4f} s <= {prefill_s:.4f} s); raise --decode-tokens or --repeats")
    step_ms = (total_s - prefill_s) / args.decode_tokens * 1e3
    floor = decode_floor(llm, batch, args.in_len + args.decode_tokens / 2, ceiling, weights)
    emit(dict(what="jaxinfer_decode_step", shape=args.shape, batch=batch, in_len=args.in_len,
              decode_tokens=args.decode_tokens, ms_per_step=round(step_ms, 3),
              tok_per_s=round(batch / step_ms * 1e3, 1),
              **floor, fraction_of_roofline=round(floor["floor_ms"] / step_ms, 3), **host_share(engine)))


def fastest_run(llm, prompts: list, new_tokens: int, repeats: int) -> tuple[float, object]:
    """The shortest of ``repeats`` timed runs of ``prompts`` (noise only adds time), and that run's engine."""
    from bench_common import exact, fresh_engine, timed_generate

    best: tuple[float, object] = (float("inf"), None)
    for _ in range(max(1, repeats)):  # the engine is built outside the timed call, unlike bench_tokenize's best_of
        engine = fresh_engine(llm, prefix_caching=False)
        seconds, _ = timed_generate(engine, [llm.request(p, exact(new_tokens)) for p in prompts])
        best = min(best, (seconds, engine), key=lambda run: run[0])
    return best


def bench_offline(llm, requests: int, in_len: int, out_len: int, args: argparse.Namespace) -> None:
    from bench_common import emit, exact, fresh_engine, random_prompts, timed_generate

    prompts = random_prompts(llm, [in_len] * requests, seed=in_len)
    fresh_engine(llm, prefix_caching=False).generate([llm.request(p, exact(2)) for p in prompts[: llm.config.max_seqs]])
    engine = fresh_engine(llm, prefix_caching=False)
    seconds, outputs = timed_generate(engine, [llm.request(p, exact(out_len)) for p in prompts])
    new = sum(len(o.token_ids) for o in outputs)
    emit(dict(what="jaxinfer_offline", shape=args.shape, requests=requests, in_len=in_len, out_len=out_len,
              new_tokens=new, s=round(seconds, 2), output_tok_per_s=round(new / seconds, 1), **host_share(engine)))


def host_share(engine) -> dict:
    """The run's steps, host milliseconds per step (scheduling, building and dispatching, reading back)
    and compiles after warm-up: the step programs the runner compiled, and every XLA compile since the
    engine was made."""
    from bench_common import step_summary

    summary = step_summary(engine)
    keys = ("steps", "host_ms_per_step", "host_fraction", "compiles_after_warmup", "xla_compiles")
    return {key: summary[key] for key in keys}


def offline_spec(text: str) -> tuple[int, int, int]:
    requests, in_len, out_len = (int(part) for part in text.split(":"))
    return requests, in_len, out_len


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from jaxinfer.config import ATTENTION_BACKENDS

    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--engine-config", default="", help="engine TOML (default: configs/engine-cpu.toml on the "
                   "CPU, configs/engine-gpu.toml elsewhere); batch, lengths and pages are set to fit the runs")
    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default=None,
                   help="engine.attention_backend (default: the engine config's, auto)")
    p.add_argument("--weights-dtype", default="auto", help="engine.weights_dtype: int8 / int4 pack the random "
                   "projections (docs/models.md, \"Packed weights\"); the roofline counts their packed bytes")
    p.add_argument("--packed-matmul", choices=("auto", "xla", "chunked", "pallas"), default="auto",
                   help="engine.packed_matmul: the packed projections' matmul (layers/pallas_matmul.py)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--in-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--offline", type=offline_spec, nargs="*", default=[(1024, 128, 128), (256, 1024, 1024)],
                   metavar="N:IN:OUT", help="offline runs: N requests of IN prompt and OUT new tokens")
    p.add_argument("--repeats", type=int, default=3,
                   help="decode timing: the fastest of this many runs each of the prefill and the whole request")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after each batch's decode timing, trace this many decode steps (tools/step_profile.py)")
    return p


def bench(args: argparse.Namespace) -> None:
    import jax
    from bench_common import emit
    from step_profile import profile_decode

    from jaxinfer import LLM
    from jaxinfer.layers.backends import backend_name

    on_cpu = jax.default_backend() == "cpu"
    config = args.engine_config or str(REPO / "configs" / ("engine-cpu.toml" if on_cpu else "engine-gpu.toml"))
    longest = max([args.in_len + args.decode_tokens] + [i + o for _, i, o in args.offline])
    max_seqs = max([*args.batch] + [min(n, 256) for n, _, _ in args.offline])
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        overrides = {} if args.attention is None else {"attention_backend": args.attention}
        overrides.update(weights_dtype=args.weights_dtype, packed_matmul=args.packed_matmul)
        llm = LLM(str(shape_folder(args.shape, Path(directory))), config, max_seqs=max_seqs,
                  max_model_len=longest, num_pages=max_seqs * (-(-longest // 16) + 1) + 1, page_size=16, **overrides)
        emit(dict(what="jaxinfer_shape_env", shape=args.shape, jax=jax.__version__, backend=jax.default_backend(),
                  device=str(jax.devices()[0].device_kind), dtype=np.dtype(llm.dtype).name,
                  attention=backend_name(llm.config.attention_backend), weights_dtype=args.weights_dtype,
                  packed_matmul=args.packed_matmul,
                  load_s=round(llm.load_seconds, 1), warmup_s=round(llm.warmup_seconds, 1),
                  startup_s=round(time.perf_counter() - start, 1)))
        ceiling = ceilings(llm.dtype, on_cpu)
        emit(dict(what="ceilings", matmul_tflops=round(ceiling["matmul_flops"] / 1e12, 3),
                  copy_tb_per_s_rw=round(ceiling["copy_bytes_per_s"] / 1e12, 3)))
        weights = model_bytes_and_flops(llm)
        for batch in args.batch:
            bench_decode(llm, batch, args, ceiling, weights)
            if args.profile_steps:
                emit(dict(what="step_profile", shape=args.shape, batch=batch, in_len=args.in_len,
                          steps=args.profile_steps, **profile_decode(llm, batch, args.in_len, args.profile_steps)))
        for requests, in_len, out_len in args.offline:
            bench_offline(llm, requests, in_len, out_len, args)
