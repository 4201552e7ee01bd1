"""tools/convert.py turns the real SmolLM2 GGUF into an orbax checkpoint the engine serves unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import TEST_ENGINE

from jaxinfer import LLM, SamplingParams
from jaxinfer.weights.registry import resolve

REPO = Path(__file__).resolve().parents[1]


def test_convert_gguf_to_orbax_and_serve(tmp_path, smollm2_llm):
    out = tmp_path / "smollm2-orbax"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert.py"), "--model", "smollm2-135m",
                           "--output", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert resolve(out).kind == "orbax"
    restored = LLM(out, **TEST_ENGINE)
    chat = [[{"role": "user", "content": "Name two planets."}], [{"role": "user", "content": "What is 3+4?"}]]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    assert [o.token_ids for o in restored.generate_chat(chat, greedy)] == [
        o.token_ids for o in smollm2_llm.generate_chat(chat, greedy)
    ]
    assert restored.tokenizer.eos_ids == smollm2_llm.tokenizer.eos_ids
    assert restored.tokenizer.encode_chat(chat[0]) == smollm2_llm.tokenizer.encode_chat(chat[0])


def test_convert_reports_a_bad_model_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert.py"), "--model", "nope-1b",
                           "--output", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown model 'nope-1b'" in proc.stderr and "smollm2-135m" in proc.stderr
    assert "Traceback" not in proc.stderr
