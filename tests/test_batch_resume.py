"""`python -m jaxinfer.batch --resume` after a kill -9 at a random point: the output written before the
crash is a prefix of the uninterrupted run's (at most one cut line), and the resumed run completes it
to the same lines, with none lost and none written twice. A file that is not the input's output is
refused before the model loads and left as it was."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, engine_toml

LINES = 32
WORDS = "river mountain light story quiet engine paper window garden winter signal market".split()


def input_lines(rng: random.Random) -> str:
    """Plain prompts that share no page of tokens (each starts with its own number), so a line's
    usage does not depend on which lines ran before it; one malformed line and one seeded line."""
    lines = []
    for n in range(LINES):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
        record = {"id": f"line-{n}", "prompt": f"{n * 7919} {words}", "max_tokens": rng.choice((8, 16, 24))}
        if n == 5:
            record.update(temperature=0.9, seed=77)
        lines.append(json.dumps(record))
    lines.insert(9, '{"id": "broken", "prompt": ')
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    (root / "engine.toml").write_text(engine_toml(max_seqs=2))  # a long enough run to be killed in
    (root / "in.jsonl").write_text(input_lines(random.Random(0)))
    return root


def command(workdir: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxinfer.batch", "--input", str(workdir / "in.jsonl"), "--output", str(output),
            "--config", str(workdir / "engine.toml"), "--no-progress", *extra]


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference(workdir) -> list[str]:
    out = workdir / "whole.jsonl"
    proc = run(command(workdir, out))
    assert proc.returncode == 0, proc.stderr
    return out.read_text().splitlines(keepends=True)


def kill_after_lines(args: list[str], output: Path, lines: int, delay: float) -> int:
    """Starts a run, waits until `output` has `lines` whole lines, then waits `delay` s and kills it (-9)."""
    proc = subprocess.Popen(args, cwd=REPO, env=dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            if output.exists() and output.read_bytes().count(b"\n") >= lines:
                time.sleep(delay)
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    return proc.returncode


@pytest.mark.slow
def test_a_run_killed_at_a_random_point_resumes_to_the_same_output(workdir, reference):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    out = workdir / "crashed.jsonl"
    returncode = kill_after_lines(command(workdir, out), out, rng.randint(1, LINES // 2), rng.uniform(0, 0.5))
    assert returncode == -signal.SIGKILL, f"seed {seed}: the run ended before the kill"
    left = out.read_text()
    whole = left[: left.rfind("\n") + 1].splitlines(keepends=True)
    assert 0 < len(whole) < len(reference), f"seed {seed}"
    assert whole == reference[: len(whole)], f"seed {seed}: the crash left lines the whole run does not have"
    assert reference[len(whole)].startswith(left[len("".join(whole)):]), f"seed {seed}: a cut line is not a prefix"

    proc = run(command(workdir, out, "--resume", "--stats-json", str(workdir / "stats.json")))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().splitlines(keepends=True) == reference, f"seed {seed}"
    stats = json.loads((workdir / "stats.json").read_text())
    assert stats["resumed_lines"] == len(whole)
    assert stats["requests"] == len(reference) - len(whole)


def test_resuming_a_finished_output_runs_nothing(workdir, reference):
    out = workdir / "done.jsonl"
    out.write_text("".join(reference))
    proc = run(command(workdir, out, "--resume", "--stats-json", str(workdir / "done-stats.json")))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "".join(reference)
    stats = json.loads((workdir / "done-stats.json").read_text())
    assert (stats["requests"], stats["resumed_lines"], stats["completion_tokens"]) == (0, len(reference), 0)


@pytest.mark.parametrize("content, message", [
    ('{"id": "line-0", "text": "x"}\n{"id": "line-7", "text": "y"}\n',
     "line 2 of .* is not the output of input line 2"),
    ("not json\n", "line 1 of .* is not the output"),
])
def test_an_output_of_another_input_is_refused_and_kept(workdir, content, message):
    import re

    out = workdir / "other.jsonl"
    out.write_text(content + '{"id": "cut')
    proc = run(command(workdir, out, "--resume", "--model", "no-such-model"))  # refused before any load
    assert proc.returncode == 2
    assert re.search(f"--resume: {message}", proc.stderr), proc.stderr
    assert out.read_text() == content + '{"id": "cut'


def test_resume_to_stdout_is_refused(workdir):
    proc = run([*command(workdir, Path("-"), "--resume")])
    assert proc.returncode == 2 and "--resume: needs an --output file" in proc.stderr, proc.stderr
