"""What optional engine features cost or gain in decoding: speculative decoding with a draft, processor slots
(idle, and next to a running program), and resident LoRA adapters.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_common import emit, exact, load_llm, random_prompts

# -- spec: speculative decoding against plain decoding on chat prompts ---------------------------------
SPEC_QUESTIONS = ["What is the capital of France?", "Explain what a lighthouse does.", "Write a short poem about rain.",
                  "List five fruits and their colours.", "How do I boil an egg?", "Why is the sky blue?",
                  "Describe a cat in three sentences.", "What are the planets of the solar system?"]


def bench_spec(args: argparse.Namespace, llm=None) -> None:
    """tokens/s with and without a draft, same prompts and settings (greedy, exactly --out-len tokens)."""
    from flax import nnx

    from jaxinfer import LLM
    from jaxinfer.weights.draft import save_draft, truncated_weights

    llm = llm or load_llm(args)
    with tempfile.TemporaryDirectory() as folder:
        draft = args.draft_model
        if not draft:
            model = nnx.merge(llm.runner.graphdef, llm.runner.state)
            cfg, weights = truncated_weights(model, llm.model_config, args.draft_layers)
            save_draft(Path(folder), cfg, weights, source=f"first {args.draft_layers} layers")
            draft = folder
        spec = LLM(args.model, args.config, draft_model=draft, num_draft_tokens=args.num_draft_tokens,
                   draft_confidence=args.draft_confidence)
    params = exact(args.out_len)
    for batch in args.batch:
        chats = [[{"role": "user", "content": q}] for q in (SPEC_QUESTIONS * batch)[:batch]]
        results = {}
        for name, engine_llm in (("plain", llm), ("speculative", spec)):
            engine_llm.generate_chat(chats, exact(8))  # touches the buckets this batch uses
            before = dataclasses.replace(engine_llm.engine.stats)
            start = time.perf_counter()
            outputs = engine_llm.generate_chat(chats, params)
            seconds = time.perf_counter() - start
            stats = engine_llm.engine.stats
            results[name] = (sum(len(o.token_ids) for o in outputs) / seconds, outputs)
            if name == "speculative":
                proposed = stats.spec_proposed - before.spec_proposed
                accepted = stats.spec_accepted - before.spec_accepted
                rounds = stats.spec_rounds - before.spec_rounds
                draft_s = stats.spec_draft_seconds - before.spec_draft_seconds
        same = [o.token_ids for o in results["plain"][1]] == [o.token_ids for o in results["speculative"][1]]
        emit(dict(what="jaxinfer_spec", batch=batch, new_tokens=args.out_len, draft=str(args.draft_model or
                  f"smollm2-135m first {args.draft_layers} layers"), num_draft_tokens=args.num_draft_tokens,
                  draft_confidence=args.draft_confidence, plain_tok_s=round(results["plain"][0], 2),
                  spec_tok_s=round(results["speculative"][0], 2),
                  speedup=round(results["speculative"][0] / results["plain"][0], 3),
                  acceptance=round(accepted / max(proposed, 1), 3),
                  tokens_per_round=round((accepted + rounds) / max(rounds, 1), 2),
                  draft_time_share=round(draft_s / (args.out_len * batch / results["speculative"][0]), 3),
                  identical_greedy_output=same))


SPIN = '(module (func (export "main") (loop $l (br $l))))'


def _decode_with(llm, requests, extra=None) -> dict:
    """Runs `requests` to the end on llm's engine (with `extra` added and aborted after); tokens/s of `requests`."""
    from jaxinfer.processor.machine_state import SCALAR

    engine = llm.engine
    before = dataclasses.replace(engine.stats)
    extra_seq = engine.add_request(extra) if extra is not None else None
    sequences = [engine.add_request(r) for r in requests]
    start = time.perf_counter()
    while any(seq.finish_reason is None for seq in sequences):
        engine.step()
    seconds = time.perf_counter() - start
    executed = 0
    if extra_seq is not None:
        if extra_seq.exec_slot is not None:
            executed = int(engine.runner.exec_unit.scalars(extra_seq.exec_slot)[SCALAR["executed"]])
        engine.abort(extra_seq.index)
    while engine.has_unfinished():
        engine.step()
    steps = engine.stats.steps - before.steps
    tokens = sum(len(seq.output_ids) for seq in sequences)
    return dict(tok_s=round(tokens / seconds, 1), step_ms=round(1000 * (engine.stats.step_seconds -
                before.step_seconds) / max(steps, 1), 2), machine_instructions=executed,
                machine_instructions_per_s=round(executed / seconds))


def bench_exec(args: argparse.Namespace) -> None:
    """The processor's cost to co-batched sequences: decode tok/s without slots, with idle slots, and
    next to a program that runs the whole time (exec_steps_per_step machine iterations per step)."""
    from jaxinfer import LLM, SamplingParams

    plain = load_llm(args)
    start = time.perf_counter()
    with_slots = LLM(args.model, args.config, exec_slots=2, exec_steps_per_step=args.steps_per_step)
    emit(dict(what="jaxinfer_exec_env", exec_slots=2, exec_steps_per_step=args.steps_per_step,
              warmup_s=round(with_slots.warmup_seconds, 1), plain_warmup_s=round(plain.warmup_seconds, 1),
              startup_s=round(time.perf_counter() - start, 1)))
    prompts = random_prompts(plain, [args.in_len] * args.batch_size, seed=0)
    requests = [plain.request(p, exact(args.out_len)) for p in prompts]
    spinner = with_slots.request([{"special": "<|exec|>"}, SPIN, {"special": "<|/exec|>"}],
                                 SamplingParams(max_tokens=4, exec=True, exec_max_instructions=2**31 - 1))
    for llm in (plain, with_slots):  # touch every bucket the workload uses
        _decode_with(llm, requests[:2])
    results = {"no_slots": _decode_with(plain, requests), "idle_slots": _decode_with(with_slots, requests),
               "program_running": _decode_with(with_slots, requests, spinner)}
    emit(dict(what="jaxinfer_exec_overhead", batch=args.batch_size, in_len=args.in_len, out_len=args.out_len,
              **{f"{name}_{key}": value for name, result in results.items() for key, value in result.items()},
              idle_ratio=round(results["idle_slots"]["tok_s"] / results["no_slots"]["tok_s"], 3),
              running_ratio=round(results["program_running"]["tok_s"] / results["no_slots"]["tok_s"], 3)))


def _random_adapter(folder: Path, llm, rank: int, seed: int) -> None:
    """A rank-`rank` PEFT-layout adapter (random, small) on every projection `llm` adapts."""
    from jaxinfer.weights.adapter_file import lora_name, save_adapter

    rng, tensors = np.random.default_rng(seed), {}
    for module, linear in llm.runner.adapters.linears.items():
        fan_in, fan_out = linear.shape
        tensors[lora_name(module, "A")] = rng.normal(0, 0.02, (rank, fan_in)).astype(np.float32)
        tensors[lora_name(module, "B")] = rng.normal(0, 0.02, (fan_out, rank)).astype(np.float32)
    save_adapter(folder, {"r": rank, "lora_alpha": rank}, tensors, layout="peft")


def bench_lora(args: argparse.Namespace) -> None:
    """Resident LoRA adapters' cost to decoding: tok/s without adapter slots, with `--adapters` slots
    and every request on the base model, and with the requests spread over all the adapters."""
    import tempfile

    from jaxinfer import LLM

    plain = load_llm(args)
    lora = LLM(args.model, args.config, max_adapters=args.adapters, max_lora_rank=args.rank)
    emit(dict(what="jaxinfer_lora_env", adapters=args.adapters, rank=args.rank,
              warmup_s=round(lora.warmup_seconds, 1), plain_warmup_s=round(plain.warmup_seconds, 1)))
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.adapters):
            _random_adapter(Path(tmp) / str(i), lora, args.rank, seed=i)
            lora.load_adapter(f"a{i}", str(Path(tmp) / str(i)))
    prompts = random_prompts(plain, [args.in_len] * args.batch_size, seed=0)
    base = [plain.request(p, exact(args.out_len)) for p in prompts]
    mixed = [dataclasses.replace(r, adapter=f"a{i % args.adapters}") for i, r in enumerate(base)]
    for llm in (plain, lora):  # one untimed pass of the whole workload: every executable has run once
        _decode_with(llm, base)
    results = {"no_slots": _decode_with(plain, base), "slots_base": _decode_with(lora, base),
               "mixed_adapters": _decode_with(lora, mixed)}
    emit(dict(what="jaxinfer_lora_overhead", batch=args.batch_size, in_len=args.in_len, out_len=args.out_len,
              **{f"{name}_{key}": value for name, result in results.items() for key, value in result.items()
                 if key in ("tok_s", "step_ms")},
              slots_ratio=round(results["slots_base"]["tok_s"] / results["no_slots"]["tok_s"], 3),
              mixed_ratio=round(results["mixed_adapters"]["tok_s"] / results["no_slots"]["tok_s"], 3)))
