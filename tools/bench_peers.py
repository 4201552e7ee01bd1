"""The transformers peers the benchmarks run beside jaxinfer: where their scripts are, run, records echoed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import emit

REPO = Path(__file__).resolve().parents[1]
SHARED_PEER = REPO.parent / "shared" / "bench" / "hf_peer.py"
OFFLINE_PEER = REPO / "tools" / "hf_offline_peer.py"


def run_peer(command: list[str]) -> list[dict]:
    proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, TQDM_DISABLE="1"))
    if proc.returncode != 0:
        emit(dict(what="peer_error", stderr=proc.stderr[-2000:]))
        return []
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for record in records:
        emit(record)
    return records


def run_offline_peer(prompts: list[list[int]], hf_batches: list[int], *flags: str) -> list[tuple[int, dict]]:
    """tools/hf_offline_peer.py on `prompts` with `flags`, once per batch size: (batch size, record) pairs."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    try:
        return [(hf_batch, record) for hf_batch in hf_batches
                for record in run_peer([sys.executable, str(OFFLINE_PEER), f.name, *flags, "--batch", str(hf_batch)])]
    finally:
        os.unlink(f.name)
