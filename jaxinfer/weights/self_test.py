"""The warm-up self-test: a fixed greedy prompt whose output a converted checkpoint stores beside its
weights (`self_test.json`, written by tools/convert.py), run again by the server before it reports
SERVING. Weights restored wrongly (a bad shard, a layout change, a broken kernel) change the tokens;
a server that finds a mismatch stays NOT_SERVING and logs which token differs.

Each step stores its two most likely tokens: a step whose two are closer than `TIE_MARGIN` may flip
under other rounding (another platform or kernel), so a divergence there ends the comparison
instead of failing it. The fingerprint belongs to one dtype; a model served in another is not
compared (its tokens may differ legitimately) and the log says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxinfer.engine.params import SamplingParams

FILE = "self_test.json"
PROMPT = "The capital of France is"
MAX_TOKENS = 8
TIE_MARGIN = 0.05  # nats between a step's two most likely tokens


def run_prompt(llm: Any) -> dict[str, Any]:
    """The fingerprint of `llm`: the fixed prompt's greedy tokens and each step's two best (id, logprob)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    out = llm.generate([PROMPT], params)[0]
    return {"prompt": PROMPT, "dtype": jnp.dtype(llm.dtype).name, "token_ids": out.token_ids,
            "top2": [[[int(i), float(lp)] for i, lp in top] for top in out.top_logprobs]}


def write(folder: Path, fingerprint: dict[str, Any]) -> None:
    """Stores the fingerprint in a checkpoint folder (through a temporary file: never half-written)."""
    tmp = folder / f".{FILE}.tmp"
    tmp.write_text(json.dumps(fingerprint, indent=1) + "\n")
    os.replace(tmp, folder / FILE)


def stored(model_path: Path) -> dict[str, Any] | None:
    path = model_path / FILE
    return json.loads(path.read_text()) if model_path.is_dir() and path.exists() else None


def mismatch(expected: dict[str, Any], got: dict[str, Any]) -> str | None:
    """Where `got`'s tokens leave `expected`'s outside a near tie, or None when they agree."""
    for step, (want, have) in enumerate(zip(expected["token_ids"], got["token_ids"], strict=False)):
        if want == have:
            continue
        top = expected["top2"][step]
        if len(top) == 2 and top[0][1] - top[1][1] < TIE_MARGIN and have == top[1][0]:
            return None  # a near tie flipped: later tokens follow another text, nothing more to compare
        return (f"token {step} of the greedy output of {expected['prompt']!r} is {have}, the checkpoint's "
                f"fingerprint ({FILE}) says {want}")
    if len(got["token_ids"]) != len(expected["token_ids"]):
        return f"{len(got['token_ids'])} tokens, the fingerprint has {len(expected['token_ids'])}"
    return None


def check(llm: Any, model_path: Path) -> tuple[bool, str]:
    """Runs the self-test when the checkpoint has a fingerprint: (passed, what to log)."""
    expected = stored(model_path)
    if expected is None:
        return True, f"self-test: no {FILE} in the checkpoint, skipped"
    got = run_prompt(llm)
    if got["dtype"] != expected["dtype"]:
        return True, f"self-test: the fingerprint is for {expected['dtype']}, the model runs in {got['dtype']}; skipped"
    problem = mismatch(expected, got)
    if problem is not None:
        return False, f"self-test failed: {problem}; health stays NOT_SERVING"
    return True, f"self-test passed: {len(got['token_ids'])} greedy tokens equal the checkpoint's fingerprint"
