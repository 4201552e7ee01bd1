"""Every module in `jaxinfer/` and `serving/` stays a room a newcomer reads in a minute: at most
`MAX_LINES` lines, and a docstring that states its concern (generated gRPC code and empty package
markers aside). A module that grows past the limit is split by its concerns, not given an exception."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 420


def modules() -> list[Path]:
    found = [*ROOT.glob("jaxinfer/**/*.py"), *ROOT.glob("serving/**/*.py")]
    return sorted(p for p in found if "_pb2" not in p.name)


def test_the_modules_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in modules()}
    assert {"jaxinfer/engine/engine.py", "jaxinfer/engine/step.py", "serving/service.py"} <= names


def test_no_module_passes_the_line_limit():
    long = {p.relative_to(ROOT).as_posix(): n for p in modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by their concerns (limit {MAX_LINES} lines)"


def test_every_module_states_its_concern():
    silent = [p.relative_to(ROOT).as_posix() for p in modules()
              if p.read_text().strip() and not ast.get_docstring(ast.parse(p.read_text()))]
    assert silent == []
