"""Trains `smollm2-135m-exec`: a LoRA adapter with which SmolLM2-135M answers exact arithmetic with programs.

    python tools/train_exec_adapter.py --output checkpoints/adapters/smollm2-135m-exec

1. Data: `tools/exec_tasks.py` questions (sums, products, powers, modular powers, gcd, digit sums,
   base conversion, Fibonacci, Collatz, differences). Each training sequence is the chat prompt
   (the engine's chat template with its generation prompt), then the answer the engine would see:
   ``<|exec|>`` program ``<|/exec|>`` ``<|result|>`` value ``<|/result|>`` "The answer is N." and
   the end-of-turn token. The loss covers the answer tokens the model writes; the result span is
   written by the engine and is masked.
2. Model: the same Flax model the engine serves (dense causal attention for training), with the
   processor's control tokens added and one adapter slot on every projection (rank `--rank`), plus
   that slot's rows for the control tokens (PEFT's trainable tokens). Only those are trained
   (optax AdamW, warm-up then cosine decay); sequences are grouped by padded length.
3. Output: an orbax adapter folder (adapter_config.json + state/, float16), `train_log.json`
   (command, machine, times, loss per step) and, with `--plot`, the loss curve as a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from exec_tasks import Task, answer_sentence, make_tasks  # noqa: E402

from jaxinfer import tokenizer as tokenizers_  # noqa: E402
from jaxinfer.layers.attention import AttentionMetadata, DenseAttention  # noqa: E402
from jaxinfer.layers.lora import LORA_TARGETS, LoraParam  # noqa: E402
from jaxinfer.models import KVCache  # noqa: E402
from jaxinfer.parallel import make_mesh  # noqa: E402
from jaxinfer.processor.protocol import CONTROL_TOKENS, EXEC_CLOSE, EXEC_OPEN, RESULT_CLOSE, RESULT_OPEN  # noqa: E402
from jaxinfer.tokenizer import Tokenizer  # noqa: E402
from jaxinfer.weights.adapter_file import TOKENS_NAME, lora_name, save_adapter  # noqa: E402
from jaxinfer.weights.gguf_file import GGUFCheckpoint  # noqa: E402
from jaxinfer.weights.loader import load_model  # noqa: E402
from jaxinfer.weights.registry import resolve  # noqa: E402

LENGTH_STEP = 64  # sequences are padded to a multiple of this: one compile per padded length
ADAPTER_SLOT = 1


# -- 1. data ------------------------------------------------------------------------------------
def encode_example(tokenizer: Tokenizer, task: Task) -> tuple[list[int], list[bool]]:
    """(token ids, whether each id is a training target) for one task, as the engine would see it."""
    ids = {name: tokenizer.token_id(name) for name in CONTROL_TOKENS}
    prompt = tokenizer.encode_chat([{"role": "user", "content": task.question}])
    program = [ids[EXEC_OPEN], *tokenizer.encode_plain(task.program), ids[EXEC_CLOSE]]
    result = [ids[RESULT_OPEN], *tokenizer.encode_plain(str(task.answer)), ids[RESULT_CLOSE]]
    closing = [*tokenizer.encode_plain(answer_sentence(task)), min(tokenizer.eos_ids)]
    tokens = prompt + program + result + closing
    targets = [False] * len(prompt) + [True] * len(program) + [False] * len(result) + [True] * len(closing)
    return tokens, targets


def batches(examples: list[tuple[list[int], list[bool]]], tokens_per_batch: int, rng: random.Random
            ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Examples grouped by padded length into (ids [B, L], target mask [B, L]) batches, shuffled."""
    by_length: dict[int, list[tuple[list[int], list[bool]]]] = {}
    for example in examples:
        length = math.ceil(len(example[0]) / LENGTH_STEP) * LENGTH_STEP
        by_length.setdefault(length, []).append(example)
    out = []
    for length, group in by_length.items():
        rng.shuffle(group)
        size = max(1, tokens_per_batch // length)
        for start in range(0, len(group) - size + 1, size):
            ids = np.zeros((size, length), np.int32)
            mask = np.zeros((size, length), bool)
            for row, (tokens, targets) in enumerate(group[start : start + size]):
                ids[row, : len(tokens)], mask[row, : len(targets)] = tokens, targets
            out.append((ids, mask))
    rng.shuffle(out)
    return out


# -- 2. model -------------------------------------------------------------------------------------
def build_model(checkpoint: str, rank: int, seed: int):
    """The served model with control tokens added and one trainable adapter slot (slot 1)."""
    mesh = make_mesh(1, 1, jax.devices()[:1])
    resolved = resolve(checkpoint)
    gguf = GGUFCheckpoint(resolved.path) if resolved.kind == "gguf" else None
    tokenizer = tokenizers_.from_gguf(gguf) if gguf is not None else tokenizers_.load(resolved.path)
    model = load_model(resolved, mesh, jnp.float32, DenseAttention(LENGTH_STEP), gguf_file=gguf).model
    control = tokenizer.add_control_tokens(CONTROL_TOKENS)
    model.extend_vocabulary(max(control.values()) + 1)
    key = jax.random.key(seed)

    def init(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> jax.Array:
        return jnp.zeros(shape, jnp.float32)

    model.add_lora_slots(2, rank, LORA_TARGETS, init)
    for linear in model.adaptable_linears(LORA_TARGETS).values():  # A random, B zero: the adapter starts as a no-op
        key, sub = jax.random.split(key)
        a = linear.lora_a[...]  # [in, slots, rank]
        fan_in, _, rank = a.shape
        linear.lora_a.set_value(a.at[:, ADAPTER_SLOT].set(jax.random.normal(sub, (fan_in, rank)) / math.sqrt(fan_in)))
    embed = model.model.embed_tokens
    rows = embed.added_rows[...]
    scale = float(jnp.std(embed.weight[...][: embed.added_start]))
    key, sub = jax.random.split(key)
    embed.added_rows.set_value(rows.at[ADAPTER_SLOT].set(jax.random.normal(sub, rows.shape[1:]) * scale))
    return model, tokenizer


def set_length(model, length: int) -> None:
    model.set_attention(DenseAttention(length))


def make_step(graphdef, optimizer):
    def loss_fn(lora, rest, ids, mask):
        model = nnx.merge(graphdef, lora, rest)
        batch, length = ids.shape
        set_length(model, length)
        positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)
        zeros = jnp.zeros(batch * length, jnp.int32)
        meta = AttentionMetadata(positions, zeros, jnp.zeros((1, 1), jnp.int32), zeros)
        dummy = jnp.zeros((1,), jnp.float32)
        caches = tuple(KVCache(dummy, dummy) for _ in model.model.layers)
        slots = jnp.full(batch * length, ADAPTER_SLOT, jnp.int32)
        hidden, _ = model(ids.reshape(-1), caches, meta, slots)
        hidden = hidden.reshape(batch, length, -1)[:, :-1].reshape(-1, hidden.shape[-1])
        logits = model.logits(hidden, slots[: hidden.shape[0]])
        labels = ids[:, 1:].reshape(-1)
        weights = mask[:, 1:].reshape(-1).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    @jax.jit
    def step(lora, opt_state, rest, ids, mask):
        loss, grads = jax.value_and_grad(loss_fn)(lora, rest, ids, mask)
        updates, opt_state = optimizer.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    return step


# -- 3. output -------------------------------------------------------------------------------------
def adapter_tensors(model, rank: int) -> tuple[dict, dict[str, np.ndarray]]:
    """Slot 1 under PEFT's names (float16) and its adapter_config.json fields."""
    tensors = {}
    for module, linear in model.adaptable_linears(LORA_TARGETS).items():
        tensors[lora_name(module, "A")] = np.asarray(linear.lora_a[...][:, ADAPTER_SLOT]).T.astype(np.float16)
        tensors[lora_name(module, "B")] = np.asarray(linear.lora_b[...][ADAPTER_SLOT]).T.astype(np.float16)
    embed = model.model.embed_tokens
    rows = np.asarray(embed.added_rows[...][ADAPTER_SLOT])
    tensors[TOKENS_NAME] = rows.astype(np.float16)
    token_ids = list(range(embed.added_start, embed.added_start + rows.shape[0]))
    config = {"r": rank, "lora_alpha": rank, "target_modules": list(LORA_TARGETS),
              "trainable_token_indices": {"embed_tokens": token_ids}, "bias": "none",
              "base_model_name_or_path": "smollm2-135m", "task_type": "CAUSAL_LM"}
    return config, tensors


def plot(losses: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 10
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid") if len(losses) >= window else losses
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, alpha=0.35, label="loss per step")
    ax.plot(np.arange(len(smooth)) + (len(losses) - len(smooth)), smooth, label=f"mean of {window}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on answer tokens (nats)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--examples", type=int, default=3000)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--tokens-per-batch", type=int, default=2048)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=None, help="write the loss curve here (needs matplotlib)")
    p.add_argument("--save-every", type=int, default=50, help="also save the adapter every N steps (0: at the end)")
    args = p.parse_args()
    started = time.perf_counter()
    model, tokenizer = build_model(args.model, args.rank, args.seed)
    tasks = make_tasks(args.examples, args.seed)
    examples = [encode_example(tokenizer, task) for task in tasks]
    rng = random.Random(args.seed)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 20), args.steps, args.lr / 20)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
    graphdef, lora, rest = nnx.split(model, LoraParam, ...)
    opt_state = optimizer.init(lora)
    step_fn = make_step(graphdef, optimizer)
    losses: list[float] = []
    pending: list[tuple[np.ndarray, np.ndarray]] = []
    train_started = time.perf_counter()
    while len(losses) < args.steps:
        if not pending:
            pending = batches(examples, args.tokens_per_batch, rng)
        ids, mask = pending.pop()
        lora, opt_state, loss = step_fn(lora, opt_state, rest, jnp.asarray(ids), jnp.asarray(mask))
        losses.append(float(loss))
        if args.save_every and len(losses) % args.save_every == 0 and len(losses) < args.steps:
            save(nnx.merge(graphdef, lora, rest), args, losses, time.perf_counter() - train_started, started)
        if len(losses) % 10 == 0:
            print(json.dumps({"step": len(losses), "loss": round(float(np.mean(losses[-10:])), 4),
                              "elapsed_s": round(time.perf_counter() - train_started, 1)}), flush=True)
    train_seconds = time.perf_counter() - train_started
    report = save(nnx.merge(graphdef, lora, rest), args, losses, train_seconds, started)
    if args.plot is not None:
        plot(losses, args.plot, f"smollm2-135m-exec: rank {args.rank}, {args.steps} steps, "
                                f"{train_seconds / 60:.0f} min on {os.cpu_count()} CPU cores")
    print(json.dumps({k: v for k, v in report.items() if k != "losses"}))


def save(model, args: argparse.Namespace, losses: list[float], train_seconds: float, started: float) -> dict:
    """Writes the adapter and train_log.json (after `len(losses)` steps) into args.output."""
    config, tensors = adapter_tensors(model, args.rank)
    save_adapter(args.output, config, tensors, layout="orbax")
    report = {"command": " ".join(["python", *sys.argv]), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPU cores, jax {jax.__version__} ({jax.default_backend()})",
              "examples": args.examples, "steps": args.steps, "tokens_per_batch": args.tokens_per_batch,
              "rank": args.rank, "lr": args.lr, "seed": args.seed, "train_s": round(train_seconds, 1),
              "total_s": round(time.perf_counter() - started, 1),
              "adapter_bytes": sum(t.nbytes for t in tensors.values()),
              "steps_done": len(losses), "losses": [round(x, 5) for x in losses]}
    (args.output / "train_log.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
