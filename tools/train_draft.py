"""Distills a draft model for speculative decoding from its target (SmolLM2-135M by default).

    python tools/train_draft.py --output checkpoints/drafts/smollm2-135m-draft --layers 2

1. Data: the target answers chat questions built from templates (the engine, sampled at
   temperature 0.7); each prompt plus answer is one training sequence of `--seq-len` tokens.
2. Teacher: the target's top-`--top-k` next-token probabilities at every position, computed once
   (dense causal attention, `layers.attention.DenseAttention`), renormalized over those k ids.
3. Student: the target's first `--layers` layers with its embedding, final norm and head (a
   layer-skip draft, `weights/draft.py`). The layers and the final norm are trained with optax
   (AdamW) on the KL divergence to the teacher over the top-k ids; the embedding, which is also
   the head, stays frozen, so the draft keeps the target's vocabulary space.
4. The draft is saved as an orbax checkpoint (`draft_model = <output>`) in `--dtype`, without the
   frozen embedding (taken from the target at load time), with `train_log.json` (command, times,
   loss per step, top-1 agreement with the target on held-out sequences).
"""

from __future__ import annotations

import argparse
import json
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

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.layers.attention import AttentionMetadata, DenseAttention  # noqa: E402
from jaxinfer.models import KVCache  # noqa: E402
from jaxinfer.weights.draft import save_draft, truncated_weights  # noqa: E402
from jaxinfer.weights.loader import abstract_model, fill, load_model, parameters  # noqa: E402

TOPICS = ["the ocean", "a lighthouse", "rainy weather", "the moon", "coffee", "bicycles", "gardening", "volcanoes",
          "the history of maps", "trains", "honey bees", "winter", "chess", "bread baking", "rivers", "the internet",
          "mountains", "music", "libraries", "clouds", "deserts", "owls", "sailing", "tea", "electricity", "bridges"]
FORMS = ["Tell me about {}.", "Write a short poem about {}.", "Explain {} to a child.", "List three facts about {}.",
         "Why do people like {}?", "Describe {} in two sentences.", "What is surprising about {}?",
         "Give me a tip related to {}."]


def dense_inputs(num_sequences: int, seq_len: int, num_layers: int) -> tuple[AttentionMetadata, tuple]:
    positions = jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), num_sequences)
    zeros = jnp.zeros(num_sequences * seq_len, jnp.int32)
    meta = AttentionMetadata(positions, zeros, jnp.zeros((1, 1), jnp.int32), zeros)
    dummy = jnp.zeros((1,), jnp.float32)
    return meta, tuple(KVCache(dummy, dummy) for _ in range(num_layers))


# -- 1. data --------------------------------------------------------------------------------------
def generate_data(llm: LLM, count: int, answer_tokens: int, seq_len: int, seed: int) -> np.ndarray:
    rng = random.Random(seed)
    questions = [rng.choice(FORMS).format(rng.choice(TOPICS)) for _ in range(count)]
    chats = [[{"role": "user", "content": q}] for q in questions]
    params = [SamplingParams(max_tokens=answer_tokens, temperature=0.7, top_p=0.95, seed=i) for i in range(count)]
    outputs = llm.generate_chat(chats, params)
    pad = min(llm.tokenizer.eos_ids, default=0)
    rows = []
    for out in outputs:
        ids = (out.prompt_token_ids + out.token_ids)[:seq_len]
        rows.append(ids + [pad] * (seq_len - len(ids)))
    return np.asarray(rows, np.int32)


# -- 2. teacher ---------------------------------------------------------------------------------
def teacher_top_k(checkpoint: str, data: np.ndarray, top_k: int, batch: int, mesh) -> tuple[np.ndarray, np.ndarray]:
    seq_len = data.shape[1]
    assert len(data) % batch == 0, "sequences + held-out must be a multiple of the batch"
    teacher = load_model(checkpoint, mesh, jnp.float32, DenseAttention(seq_len)).model
    graphdef, state = nnx.split(teacher)
    meta, caches = dense_inputs(batch, seq_len, teacher.config.num_layers)

    @jax.jit
    def top(state, tokens):
        model = nnx.merge(graphdef, state)
        hidden, _ = model(tokens.reshape(-1), caches, meta)
        values, ids = jax.lax.top_k(jax.nn.log_softmax(model.logits(hidden), axis=-1), top_k)
        return jax.nn.log_softmax(values, axis=-1), ids  # renormalized over the k ids

    logps, ids = [], []
    for start in range(0, len(data), batch):
        lp, i = top(state, jnp.asarray(data[start : start + batch]))
        logps.append(np.asarray(lp))
        ids.append(np.asarray(i))
    return np.concatenate(logps), np.concatenate(ids)


# -- 3. student -----------------------------------------------------------------------------------
def make_student(llm: LLM, layers: int, seq_len: int, mesh):
    target = nnx.merge(llm.runner.graphdef, llm.runner.state)
    cfg, weights = truncated_weights(target, llm.model_config, layers)
    model = fill(abstract_model(cfg, jnp.float32, DenseAttention(seq_len)),
                 ((name, name, array) for name, array in weights.items()), mesh, "truncated target")
    return cfg, model


def train(model, cfg, data, teacher, args) -> tuple[list[float], object]:
    graphdef, state = nnx.split(model)
    labels = jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if "embed_tokens" in jax.tree_util.keystr(path) else "train", state)
    optimizer = optax.multi_transform({"train": optax.adamw(args.lr, weight_decay=0.0),
                                       "frozen": optax.set_to_zero()}, labels)
    opt_state = optimizer.init(state)
    meta, caches = dense_inputs(args.batch, args.seq_len, cfg.num_layers)
    teacher_logp, teacher_ids = teacher

    def loss_fn(state, tokens, t_logp, t_ids):
        student = nnx.merge(graphdef, state)
        hidden, _ = student(tokens.reshape(-1), caches, meta)
        logq = jax.nn.log_softmax(student.logits(hidden), axis=-1)
        logq_k = jnp.take_along_axis(logq, t_ids, axis=-1)
        kl = jnp.sum(jnp.exp(t_logp) * (t_logp - logq_k), axis=-1)  # KL over the teacher's top-k ids
        return jnp.mean(kl)

    @jax.jit
    def step(state, opt_state, tokens, t_logp, t_ids):
        loss, grads = jax.value_and_grad(loss_fn)(state, tokens, t_logp, t_ids)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    losses, order = [], np.arange(len(data))
    rng = np.random.default_rng(args.seed)
    for epoch in range(args.epochs):
        rng.shuffle(order)
        for start in range(0, len(order) - args.batch + 1, args.batch):
            rows = order[start : start + args.batch]
            flat = (rows[:, None] * args.seq_len + np.arange(args.seq_len)[None]).reshape(-1)
            state, opt_state, loss = step(state, opt_state, jnp.asarray(data[rows]),
                                          jnp.asarray(teacher_logp[flat]), jnp.asarray(teacher_ids[flat]))
            losses.append(float(loss))
        print(json.dumps({"epoch": epoch + 1, "loss": round(float(np.mean(losses[-10:])), 4)}), flush=True)
    return losses, nnx.merge(graphdef, state)


def agreement(model, cfg, data, teacher_ids, batch, seq_len) -> float:
    """Share of held-out positions where the draft's argmax is the target's."""
    graphdef, state = nnx.split(model)
    meta, caches = dense_inputs(batch, seq_len, cfg.num_layers)

    @jax.jit
    def argmax(state, tokens):
        student = nnx.merge(graphdef, state)
        hidden, _ = student(tokens.reshape(-1), caches, meta)
        return jnp.argmax(student.logits(hidden), axis=-1)

    hits = total = 0
    for start in range(0, len(data) - batch + 1, batch):
        predicted = np.asarray(argmax(state, jnp.asarray(data[start : start + batch])))
        target = teacher_ids[start * seq_len : (start + batch) * seq_len, 0]
        hits += int(np.sum(predicted == target))
        total += predicted.size
    return hits / max(total, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--held-out", type=int, default=32)
    p.add_argument("--answer-tokens", type=int, default=96)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="saved weights (the engine casts them to its dtype at load)")
    args = p.parse_args()
    times, started = {}, time.perf_counter()
    llm = LLM(args.model, str(REPO / "configs" / "engine-cpu.toml"))
    data = generate_data(llm, args.sequences + args.held_out, args.answer_tokens, args.seq_len, args.seed)
    times["generate_s"] = round(time.perf_counter() - started, 1)
    mark = time.perf_counter()
    teacher = teacher_top_k(args.model, data, args.top_k, args.batch, llm.mesh)
    times["teacher_s"] = round(time.perf_counter() - mark, 1)
    cfg, student = make_student(llm, args.layers, args.seq_len, llm.mesh)
    held = slice(args.sequences, None)
    held_ids = teacher[1][args.sequences * args.seq_len :]
    before = agreement(student, cfg, data[held], held_ids, args.batch, args.seq_len)
    mark = time.perf_counter()
    train_rows = slice(0, args.sequences)
    train_teacher = (teacher[0][: args.sequences * args.seq_len], teacher[1][: args.sequences * args.seq_len])
    losses, student = train(student, cfg, data[train_rows], train_teacher, args)
    times["train_s"] = round(time.perf_counter() - mark, 1)
    after = agreement(student, cfg, data[held], held_ids, args.batch, args.seq_len)
    weights = {name: np.asarray(param.get_value()) for name, param in parameters(student).items()}
    save_draft(args.output, cfg, weights, source=f"{args.model}: first {args.layers} layers, distilled",
               dtype=args.dtype)
    report = {"command": " ".join(sys.argv), "layers": args.layers, "sequences": args.sequences,
              "seq_len": args.seq_len, "epochs": args.epochs, "top1_agreement_before": round(before, 4),
              "top1_agreement_after": round(after, 4), **times, "total_s": round(time.perf_counter() - started, 1),
              "losses": [round(x, 4) for x in losses]}
    (args.output / "train_log.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "losses"}))


if __name__ == "__main__":
    main()
