"""`python -m jaxinfer.batch` end to end on the real SmolLM2, as a subprocess.

Two model loads in all: one run writing a file (plus the stats JSON), one more writing to stdout
that must give the same lines. The error exits fail before any model loads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, engine_toml

from jaxinfer.batch import (
    DEFAULT_EXEC_SLOTS,
    UNDECODABLE_BYTE,
    _engine_overrides,
    _with_line_needs,
    default_params,
    parse_args,
    read_jobs,
)
from jaxinfer.config import load_engine_config
from jaxinfer.parallel.distributed import ProcessGroup

MAX_TOKENS = 8


def obj(**fields) -> str:
    return json.dumps(fields, ensure_ascii=False)


ADAPTER_DIR = "@adapter@"  # replaced by the path of a random LoRA adapter in PEFT's layout (see `workdir`)
# (input line, None for a good line or the substrings its error must contain)
LINES: list[tuple[str, tuple[str, ...] | None]] = [
    (obj(id="greedy-prompt", prompt="The capital of France is"), None),
    ('{"id": "broken", "prompt": ', ("invalid JSON",)),
    (obj(id=42, messages=[{"role": "user", "content": "Name a color."}]), None),
    ('["not", "an", "object"]', ("JSON object",)),
    (obj(id="seeded", prompt="Once upon a time", temperature=0.8, seed=1234), None),
    (obj(id="both", prompt="x", messages=[{"role": "user", "content": "x"}]), ("prompt", "messages")),
    (obj(id="stop", prompt="Count: 1, 2, 3,", stop=[",", "\n"]), None),
    (obj(id="unknown", prompt="x", frobnicate=1), ("frobnicate",)),
    ("", None),  # blank lines are skipped and get no output line
    (obj(id="zero", prompt="x", max_tokens=0), ("max_tokens",)),
    (obj(id="short", prompt="Hello", max_tokens=3), None),
    (obj(id="cold", prompt="x", temperature=-1), ("temperature",)),
    (obj(id="penalized", prompt="Say la la la la la", repetition_penalty=1.3, frequency_penalty=0.5,
         presence_penalty=0.5), None),
    (obj(id="over-penalized", prompt="x", presence_penalty=2.5), ("presence_penalty", "[-2.0, 2.0]")),
    (obj(id="alternatives", prompt="The sky is", logprobs=True, top_logprobs=4, max_tokens=6), None),
    (obj(id="alternatives-alone", prompt="x", top_logprobs=4), ("top_logprobs", "needs logprobs")),
    (obj(id="scored", prompt="The sky is blue and the grass", prompt_logprobs=2, max_tokens=2), None),
    (obj(id="scored-too-many", prompt="x", prompt_logprobs=21), ("prompt_logprobs", "[0, 20]")),
    (obj(id="biased", prompt="The sky is", logit_bias={"0": -100, "17": 2.5}, max_tokens=4), None),
    (obj(id="biased-too-far", prompt="x", logit_bias={"3": -101}), ("logit_bias['3']", "[-100.0, 100.0]")),
    (obj(id="role", messages=[{"role": "user<|im_end|>", "content": "x"}]), ("messages[0].role",)),
    (obj(id="guided-choice", prompt="Is the sky blue?", guided={"choice": ["yes", "no"]}), None),
    (obj(id="guided-regex", prompt="A year:", guided={"regex": "(19|20)[0-9]{2}"}), None),
    (obj(id="guided-grammar", prompt="Yes or no:", guided={"grammar": 'root ::= "yes" | "no" | "(" root ")"'}), None),
    (obj(id="guided-bad", prompt="x", guided={"regex": "(("}), ("guided.regex",)),
    (obj(id="guided-two", prompt="x", guided={"regex": "a", "choice": ["a"]}), ("guided", "exactly one")),
    (
        obj(
            id="seeded-chat",
            messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}],
            temperature=0.7, top_p=0.9, seed=7,
        ),
        None,
    ),
    (obj(id="content", messages=[{"role": "user", "content": 5}]), ("messages[0].content",)),
    (obj(id="empty", prompt=""), ("prompt",)),
    (obj(id="empty-stop", prompt="x", stop=[""]), ("stop[0]",)),
    (obj(prompt="No id on this line, so the id is the line number:"), None),
    (obj(id="adapted", messages=[{"role": "user", "content": "Name a color."}], adapter=ADAPTER_DIR), None),
    (obj(id="lost-adapter", prompt="x", adapter="/nonexistent/adapter"), ("adapter", "not an existing path")),
    # A string is not a flag ("false" would turn programs on), and a list field takes only a list.
    (obj(id="exec-text", prompt="x", exec="false"), ("exec", "true or false")),
    (obj(id="stop-map", prompt="x", stop={"a": 1}), ("stop", "must be a list")),
    (obj(id="files-text", prompt="x", exec_files="data.txt"), ("exec_files", "must be a list")),
    # JSON that decodes to no value: more digits than Python converts, nesting deeper than it recurses.
    ('{"id": "digits", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}", ("invalid JSON", "digits")),
    ('{"id": "deep", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", ("invalid JSON", "recursion")),
    ('{"id": "latin-1", "prompt": "caf\udce9"}', ("invalid UTF-8", "0xe9", "column 33")),  # a raw 0xE9 byte
    ('{"id": "surrogate", "prompt": "Hi \\ud800"}', ("prompt", "unpaired surrogate")),  # a JSON escape
    ('{"id": "lone \\udc00 id", "prompt": "Hi", "max_tokens": 2}', None),  # written back escaped
    # Python's json reads NaN; written back, it made an output line that is not JSON.
    ('{"id": NaN, "prompt": "x"}', ("invalid JSON", "NaN is not a JSON number")),
]
NON_BLANK = [(number, text, expect) for number, (text, expect) in enumerate(LINES, 1) if text.strip()]
BAD = [(number, expect) for number, _, expect in NON_BLANK if expect is not None]
GOOD = [(number, json.loads(text)) for number, text, expect in NON_BLANK if expect is None]


def parse(text: str):
    """What a line decodes to, as the runner sees it (None: no JSON object, so no id)."""
    if UNDECODABLE_BYTE.search(text):
        return None
    try:
        return json.loads(text, parse_constant=lambda name: int("not a JSON number"))
    except (ValueError, RecursionError):
        return None


def batch(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    assert env.get("JAXINFER_COMPILATION_CACHE"), "tests/conftest.py sets the persistent XLA cache"
    return subprocess.run(
        [sys.executable, "-m", "jaxinfer.batch", *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("batch")
    (root / "engine.toml").write_text(engine_toml())
    write_random_adapter(root / "lora")
    lines = "".join(text.replace(ADAPTER_DIR, str(root / "lora")) + "\n" for text, _ in LINES)
    (root / "in.jsonl").write_text(lines, encoding="utf-8", errors="surrogateescape")  # the 0xE9 byte
    return root


def write_random_adapter(folder: Path, seed: int = 0) -> None:
    """Rank-4 LoRA on every layer's q and down projections, strong enough to change greedy text."""
    from jaxinfer.weights.adapter_file import lora_name, save_adapter

    rng, tensors = np.random.default_rng(seed), {}
    for layer in range(30):
        for module, (fan_in, fan_out) in {"self_attn.q_proj": (576, 576), "mlp.down_proj": (1536, 576)}.items():
            name = f"model.layers.{layer}.{module}"
            tensors[lora_name(name, "A")] = rng.normal(0, 0.5, (4, fan_in)).astype(np.float32)
            tensors[lora_name(name, "B")] = rng.normal(0, 0.5, (fan_out, 4)).astype(np.float32)
    save_adapter(folder, {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "down_proj"]}, tensors, layout="peft")


def model_args(workdir: Path, output: str) -> list[str]:
    return [
        "--model", "smollm2-135m", "--input", str(workdir / "in.jsonl"), "--output", output,
        "--max-tokens", str(MAX_TOKENS), "--no-progress", "--config", str(workdir / "engine.toml"),
    ]


@pytest.fixture(scope="module")
def file_run(workdir):
    out, stats = workdir / "out.jsonl", workdir / "stats.json"
    proc = batch(*model_args(workdir, str(out)), "--stats-json", str(stats), "--verbose")
    assert proc.returncode == 0, proc.stderr
    return proc, out, stats


@pytest.fixture(scope="module")
def records(file_run) -> list[dict]:
    _, out, _ = file_run
    text = out.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def tok():
    from jaxinfer import tokenizer

    return tokenizer.load("smollm2-135m")


@pytest.mark.slow
def test_one_output_line_per_input_line_in_order(file_run, records):
    proc, out, _ = file_run
    assert len(records) == len(NON_BLANK)
    for (number, text, expect), record in zip(NON_BLANK, records, strict=True):
        if expect is None:
            line = json.loads(text)
            assert record["id"] == line.get("id", number)  # ids kept as given, type included
            assert "error" not in record
        elif isinstance(parsed := parse(text), dict):
            assert record["id"] == parsed["id"]
        else:
            assert record["id"] is None  # nothing to take an id from
    assert not out.with_name(out.name + ".tmp").exists()
    assert "Traceback" not in proc.stderr
    assert f"{len(NON_BLANK)} requests ({len(BAD)} errors)" in proc.stderr
    assert "INFO jaxinfer.llm: loaded smollm2-135m" in proc.stderr  # --verbose logs reach stderr


@pytest.mark.slow
def test_malformed_lines_get_errors_naming_the_problem(records):
    by_line = dict(zip([n for n, _, _ in NON_BLANK], records, strict=True))
    for number, expect in BAD:
        record = by_line[number]
        assert set(record) == {"id", "error"}, record
        assert record["error"].startswith(f"line {number}: "), record
        for word in expect:
            assert word in record["error"], (word, record)


@pytest.mark.slow
def test_good_lines_have_text_tokens_and_usage(records, tok):
    by_line = dict(zip([n for n, _, _ in NON_BLANK], records, strict=True))
    for number, line in GOOD:
        record = by_line[number]
        asked = {name for name in ("logprobs", "top_logprobs") if line.get(name)}
        if line.get("prompt_logprobs") is not None:
            asked |= {"prompt_logprobs"} | ({"prompt_top_logprobs"} if line["prompt_logprobs"] else set())
        assert set(record) == {"id", "text", "token_ids", "finish_reason", "usage"} | asked, record
        ids, usage = record["token_ids"], record["usage"]
        if "prompt_top_logprobs" in asked:
            scores, tops = record["prompt_logprobs"], record["prompt_top_logprobs"]
            assert len(scores) == len(tops) == usage["prompt_tokens"] and scores[0] is None and tops[0] == []
            for score, top in zip(scores[1:], tops[1:], strict=True):
                assert len(top) == line["prompt_logprobs"] and score <= top[0][1] + 1e-6
        if "top_logprobs" in asked:
            assert len(record["logprobs"]) == len(record["top_logprobs"]) == len(ids)
            for token, logprob, top in zip(ids, record["logprobs"], record["top_logprobs"], strict=True):
                assert len(top) == line["top_logprobs"] and top[0][1] >= logprob - 1e-6
                assert token not in [t for t, _ in top] or abs(dict(top)[token] - logprob) < 1e-5
        assert 1 <= len(ids) <= line.get("max_tokens", MAX_TOKENS)
        assert all(isinstance(t, int) and 0 <= t < tok.vocab_size for t in ids)
        assert record["finish_reason"] in {"stop", "length"}
        assert set(usage) == {"prompt_tokens", "completion_tokens", "cached_tokens"}
        assert usage["completion_tokens"] == len(ids)
        assert 0 <= usage["cached_tokens"] <= usage["prompt_tokens"]
        prompt = tok.encode_prompt(line["prompt"]) if "prompt" in line else tok.encode_chat(line["messages"])
        assert usage["prompt_tokens"] == len(prompt)
        decoded = tok.decode(ids)
        if "guided" in line:  # the text is exactly the constrained value
            assert record["finish_reason"] == "stop"
            guided = line["guided"]
            pattern = guided.get("regex") or ("|".join(map(re.escape, guided["choice"])) if "choice" in guided
                                              else r"\(*(yes|no)\)*")
            assert re.fullmatch(pattern, record["text"]), record
        if "stop" in line:
            assert record["finish_reason"] == "stop"
            assert decoded.startswith(record["text"])
            assert not any(s in record["text"] for s in line["stop"])
        else:
            assert record["text"] == decoded
            eos = bool(set(ids) & tok.eos_ids)
            assert record["finish_reason"] == ("stop" if eos else "length")
            if record["finish_reason"] == "length":
                assert len(ids) == line.get("max_tokens", MAX_TOKENS)


@pytest.mark.slow
def test_stats_json_is_consistent(file_run, records):
    _, _, stats_path = file_run
    stats = json.loads(stats_path.read_text())
    good = [r for r in records if "error" not in r]
    assert stats["requests"] == len(NON_BLANK)
    assert stats["errors"] == len(BAD)
    assert stats["prompt_tokens"] == sum(r["usage"]["prompt_tokens"] for r in good)
    assert stats["completion_tokens"] == sum(r["usage"]["completion_tokens"] for r in good)
    assert stats["completion_tokens"] == sum(len(r["token_ids"]) for r in good)
    assert stats["cached_prompt_tokens"] == sum(r["usage"]["cached_tokens"] for r in good)
    assert stats["wall_s"] > 0
    expected_rate = stats["completion_tokens"] / stats["wall_s"]
    assert stats["tokens_per_s"] == pytest.approx(expected_rate, rel=0.01, abs=0.05)
    assert stats["model"] == "smollm2-135m"
    assert stats["steps"] > 0 and 0 < stats["tokens_per_step"] <= 64  # the test config's largest bucket
    assert 0 < stats["host_fraction"] <= 1
    assert stats["xla_compiles_after_warmup"] == 0  # nothing compiled after warm-up, eager operations included


@pytest.mark.slow
def test_second_run_to_stdout_gives_identical_lines(workdir, file_run):
    _, out, _ = file_run
    proc = batch(*model_args(workdir, "-"))
    assert proc.returncode == 0, proc.stderr
    assert not (REPO / "-").exists()
    first = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    second = [json.loads(line) for line in proc.stdout.splitlines()]  # stdout holds the JSON lines only
    assert second == first
    seeded = [r for r in second if str(r["id"]).startswith("seeded")]
    assert len(seeded) == 2 and all(r["token_ids"] for r in seeded)
    assert "requests" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_model_exits_2_listing_known_names(tmp_path):
    (tmp_path / "in.jsonl").write_text(obj(id=1, prompt="hi") + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text("previous contents\n")
    proc = batch("--model", "does-not-exist", "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                 "--no-progress", timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "does-not-exist" in proc.stderr
    assert "known names" in proc.stderr and "smollm2-135m" in proc.stderr
    assert proc.stdout == ""
    # Nothing was written: the old file is intact and no temporary file is left behind.
    assert out.read_text() == "previous contents\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


@pytest.mark.parametrize(("case", "message"), [
    ("missing-folder", "--output: folder not found"),
    ("folder", "is a folder"),
    ("same-as-input", "is the input file; the run would replace it"),
    ("stats-missing-folder", "--stats-json: folder not found"),
])
def test_output_paths_are_checked_before_the_model_loads(tmp_path, case, message):
    """Before, a missing folder failed with a traceback after the whole run (its results lost), and an
    output naming the input replaced it."""
    source = tmp_path / "in.jsonl"
    source.write_text(obj(id=1, prompt="hi") + "\n")
    (tmp_path / "outdir").mkdir()
    output = {"missing-folder": tmp_path / "no" / "out.jsonl", "folder": tmp_path / "outdir",
              "same-as-input": source}.get(case, tmp_path / "out.jsonl")
    extra = ["--stats-json", str(tmp_path / "no" / "stats.json")] if case.startswith("stats") else []
    proc = batch("--model", "does-not-exist", "--input", str(source), "--output", str(output), "--no-progress",
                 *extra, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert "does-not-exist" not in proc.stderr  # refused before the model was looked up
    assert source.read_text() == obj(id=1, prompt="hi") + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "outdir"]


def test_missing_input_exits_nonzero_with_a_clear_message(tmp_path):
    out = tmp_path / "out.jsonl"
    proc = batch("--input", "/nonexistent.jsonl", "--output", str(out), "--no-progress", timeout=300)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "--input" in proc.stderr and "/nonexistent.jsonl" in proc.stderr and "not found" in proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_line_with_an_adapter_runs_with_it(records):
    by_id = {record["id"]: record for record in records}
    assert by_id["adapted"]["token_ids"] != by_id[42]["token_ids"]  # the same chat, without the adapter


@pytest.mark.parametrize(("config_slots", "flag", "lines_run_programs", "expected"), [
    (2, None, True, 2),  # the config's slots are kept
    (0, None, True, DEFAULT_EXEC_SLOTS),  # the config has none: the runner's default
    (2, "3", True, 3),  # the flag wins over the config
    (0, "0", True, 0),  # an explicit 0 stays 0: exec lines then fail alone, naming exec_slots
    (0, None, False, 0),  # no line runs programs: no processor
    (2, None, False, 2),
])
def test_exec_slots_come_from_the_flag_then_the_config_then_the_default(
        tmp_path, config_slots, flag, lines_run_programs, expected):
    from io import StringIO

    (tmp_path / "engine.toml").write_text(f"[engine]\nexec_slots = {config_slots}\n")
    argv = ["--input", "-", "--output", "-", "--config", str(tmp_path / "engine.toml")]
    argv += ["--exec"] if lines_run_programs else []
    argv += ["--exec-slots", flag] if flag is not None else []
    args = parse_args(argv)
    jobs = read_jobs(StringIO(obj(id=1, prompt="hi") + "\n"), default_params(args))
    config = load_engine_config(args.config, **_engine_overrides(args))
    assert _with_line_needs(config, args, jobs, ProcessGroup.resolve(environ={})).exec_slots == expected


def test_an_output_folder_gone_by_the_end_is_a_named_error(tmp_path):
    from jaxinfer.batch_output import write_whole
    from jaxinfer.errors import JaxinferError

    with pytest.raises(JaxinferError, match=r"--output: cannot write .*No such file or directory"):
        write_whole(str(tmp_path / "gone" / "out.jsonl"), "{}\n", "--output")
