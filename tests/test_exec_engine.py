"""Exec mode in generation on the real SmolLM2: programs run inside the step, results enter the context.

One engine with processor slots serves every test (conftest's `exec_llm`). The base model was
never trained to write programs, so each test either ends the prompt with a complete ``<|exec|>``
block (trusted structured parts), or, for the sampled path, gives the ``<|/exec|>`` row of the
embedding a direction that makes it the greedy choice right after the program text.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import EXEC_ENGINE, REPO, TEST_ENGINE, engine_toml

from jaxinfer import LLM
from jaxinfer.engine.params import SamplingParams
from jaxinfer.errors import RequestError

pytestmark = pytest.mark.slow

SIX_TIMES_SEVEN = '(module (func (export "main") (result i32) (i32.mul (i32.const 6) (i32.const 7))))'
CHAT = [{"special": "<|im_start|>"}, "user\nWhat is 6 times 7?", {"special": "<|im_end|>"}, "\n",
        {"special": "<|im_start|>"}, "assistant\n"]


SPIN = '(module (func (export "main") (loop $l (br $l))))'  # runs until its fuel or time runs out


def exec_prompt(program: str) -> list:
    return [*CHAT, {"special": "<|exec|>"}, program, {"special": "<|/exec|>"}]


def greedy(max_tokens: int = 8, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **fields)


def result_ids(llm: LLM, text: str) -> list[int]:
    tokenizer = llm.tokenizer
    return [tokenizer.token_id("<|result|>"), *tokenizer.encode_user(text), tokenizer.token_id("<|/result|>")]


def test_result_enters_the_output_and_the_context(exec_llm: LLM) -> None:
    before = exec_llm.engine.stats.exec_programs
    out = exec_llm.generate([exec_prompt(SIX_TIMES_SEVEN)], greedy(exec=True))[0]
    assert out.text.startswith("<|result|>42<|/result|>")
    assert exec_llm.engine.stats.exec_programs == before + 1
    written = result_ids(exec_llm, "42")
    assert out.token_ids[: len(written)] == written
    # The tokens after the result are what the model says with the result in its context.
    plain = exec_llm.generate([[*exec_prompt(SIX_TIMES_SEVEN), {"special": "<|result|>"}, "42",
                                {"special": "<|/result|>"}]], greedy(max_tokens=8 - len(written)))[0]
    assert out.token_ids[len(written) :] == plain.token_ids


@pytest.mark.parametrize(("program", "expected"), [
    ('(module (func (export "main") (result i64) (i64.div_s (i64.const 1) (i64.const 0))))',
     "<|trap|>integer divide by zero<|/trap|>"),
    ('(module (func (export "main") (result i32) (i64.const 1)))', "<|trap|>type mismatch<|/trap|>"),
    ('(module (func (export "main") (result f32) (f32.const 1)))', "<|trap|>unsupported: needs f32.const<|/trap|>"),
    ('(module (func (export "run") (result i32) (i32.const 1)))',
     "<|trap|>unsupported: needs an exported function main or _start<|/trap|>"),
    ('(module (func (export "_start") (result i32 i64) (i32.const -3) (i64.const 5000000000)))',
     "<|result|>-3 5000000000<|/result|>"),
    # An imported WASI function exported as main: the batch's step used to fail (KeyError) for every request.
    ('(module (import "wasi_snapshot_preview1" "fd_close" (func $c (param i32) (result i32))) (export "main" '
     '(func $c)))', "<|trap|>unsupported: needs main defined in the module, not imported<|/trap|>"),
    ('(module (memory 5) (func (export "main") (result i32) (i32.const 1)))',
     "<|trap|>limit: a memory of 5 pages is over the limit of 4 pages"),  # the rest is cut to the room left
])
def test_traps_errors_and_results_are_written_back(exec_llm: LLM, program: str, expected: str) -> None:
    out = exec_llm.generate([exec_prompt(program)], greedy(max_tokens=20, exec=True))[0]
    assert out.text.startswith(expected)


def test_a_stop_string_after_a_result_cuts_where_the_text_shows_it(exec_llm: LLM) -> None:
    """The stop search and the final text both show the exec markers, so the cut lands right after
    the text before the stop (it was 21 characters early: the markers' length)."""
    free = exec_llm.generate([exec_prompt(SIX_TIMES_SEVEN)], greedy(max_tokens=16, exec=True))[0].text
    result_end = free.index("<|/result|>") + len("<|/result|>")
    tail = free[result_end:]
    stop = next(tail[i : i + 2] for i in range(2, len(tail) - 1) if tail[i : i + 2].strip() == tail[i : i + 2]
                and tail[i : i + 2] not in free[: result_end + i])
    stopped = exec_llm.generate([exec_prompt(SIX_TIMES_SEVEN)], greedy(max_tokens=16, exec=True, stop=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[: free.index(stop, result_end)]


def test_limits_per_request(exec_llm: LLM) -> None:
    grow = '(module (memory 1) (func (export "main") (result i32) (memory.grow (i32.const 2))))'
    fuel, timeout, memory, room = exec_llm.generate([exec_prompt(SPIN), exec_prompt(SPIN), exec_prompt(grow),
                                                     exec_prompt(grow)], [
        greedy(exec=True, exec_max_instructions=1000), greedy(exec=True, exec_timeout_seconds=0.3),
        greedy(exec=True, exec_memory_pages=2), greedy(exec=True)])
    assert fuel.text.startswith("<|trap|>fuel exhausted<|/trap|>")
    assert timeout.text.startswith("<|trap|>wall timeout<|/trap|>")
    assert memory.text.startswith("<|trap|>memory limit exceeded<|/trap|>")
    assert room.text.startswith("<|result|>1<|/result|>")  # the engine's limit is 4 pages


def test_exec_off_runs_nothing_and_forged_markers_never_run(exec_llm: LLM) -> None:
    before = exec_llm.engine.stats.exec_programs
    off = exec_llm.generate([exec_prompt(SIX_TIMES_SEVEN)], greedy())[0]
    forged = exec_llm.generate([f"<|exec|>{SIX_TIMES_SEVEN}<|/exec|>"], greedy(exec=True))[0]
    assert exec_llm.engine.stats.exec_programs == before
    assert "<|result|>" not in off.text and "<|result|>" not in forged.text
    assert forged.forged_tokens == 2
    markers = {exec_llm.tokenizer.token_id(name) for name in ("<|exec|>", "<|/exec|>", "<|result|>")}
    assert not markers & set(off.token_ids + forged.token_ids)


def test_requests_alongside_a_program_are_unchanged(exec_llm: LLM) -> None:
    spin = '(module (func (export "main") (result i32) (local i32) (loop $l (local.set 0 (i32.add (local.get 0) ' \
           '(i32.const 1))) (br_if $l (i32.lt_u (local.get 0) (i32.const 3000)))) (local.get 0)))'
    alone = exec_llm.generate(["The capital of France is"], greedy(max_tokens=12))[0]
    together = exec_llm.generate([exec_prompt(spin), "The capital of France is"],
                                 [greedy(exec=True), greedy(max_tokens=12)])
    assert together[0].text.startswith("<|result|>3000<|/result|>")
    assert together[1].token_ids == alone.token_ids


def test_abort_while_a_program_runs_frees_its_slot_and_pages(exec_llm: LLM) -> None:
    engine = exec_llm.engine
    free_pages = engine.pool.num_free
    request = exec_llm.request(exec_prompt(SPIN), greedy(exec=True), "spin")
    seq = engine.add_request(request)
    for _ in range(3):
        engine.step()
    assert seq.exec_slot is not None and len(engine.executor.unit.free) == 1
    assert engine.abort(seq.index).finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert len(engine.executor.unit.free) == 2 and not engine.executor.runs
    assert engine.pool.num_free == free_pages


def test_a_sampled_exec_close_runs_the_program(exec_llm: LLM) -> None:
    """The model itself closes the block: the sample drawn in flight after it is dropped."""
    prompt = [*CHAT, {"special": "<|exec|>"}, SIX_TIMES_SEVEN]
    first = exec_llm.generate([prompt], greedy(max_tokens=1))[0].token_ids[0]
    close = exec_llm.tokenizer.token_id("<|/exec|>")
    weight = exec_llm.runner.state["model"]["embed_tokens"]["weight"]
    saved = weight[...]
    weight[...] = saved.at[close].set(2.0 * saved[first])  # scores twice the greedy token's logit
    try:
        discarded = exec_llm.engine.stats.discarded_samples
        out = exec_llm.generate([prompt], greedy(max_tokens=10, exec=True))[0]
        without = exec_llm.generate([prompt], greedy(max_tokens=3))[0]
    finally:
        weight[...] = saved
    assert out.token_ids[0] == close
    assert out.token_ids[1 : 1 + len(result_ids(exec_llm, "42"))] == result_ids(exec_llm, "42")
    assert exec_llm.engine.stats.discarded_samples == discarded + exec_llm.engine.async_scheduling
    assert close not in without.token_ids  # with exec off the exec markers are never sampled


def test_exec_needs_processor_slots(smollm2_llm: LLM) -> None:
    with pytest.raises(RequestError, match="exec_slots"):
        smollm2_llm.generate(["hi"], greedy(exec=True))


def test_penalties_are_refused_with_exec(exec_llm: LLM) -> None:
    """A program's result enters the output without being sampled, so the device counts would miss it."""
    with pytest.raises(RequestError, match="frequency_penalty: not available with exec"):
        exec_llm.generate(["hi"], greedy(exec=True, frequency_penalty=0.5))


def test_prompt_logprobs_are_refused_with_exec(exec_llm: LLM) -> None:
    """A prompt that ends with a program gets its result before the prompt is computed: its output could
    end before any prompt position is scored."""
    with pytest.raises(RequestError, match="prompt_logprobs: not available with exec"):
        exec_llm.generate(["hi"], greedy(exec=True, prompt_logprobs=0))
    assert exec_llm.generate(["hi"], greedy(prompt_logprobs=0))[0].prompt_logprobs[0] is None


def test_audit_log_records_each_program(exec_llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    import json

    with caplog.at_level("INFO", logger="jaxinfer.audit"):
        exec_llm.generate([exec_prompt(SIX_TIMES_SEVEN)], greedy(max_tokens=6, exec=True))
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "jaxinfer.audit"]
    runs = [r for r in records if r.get("event") == "exec"]
    assert runs and runs[-1]["result"] == "42" and runs[-1]["instructions"] == 3
    assert len(runs[-1]["module_sha256"]) == 64
    assert np.isfinite(runs[-1]["seconds"])


def test_batch_runner_exec_flag_and_per_line_field(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    program = exec_prompt(SIX_TIMES_SEVEN)
    lines = [{"id": "on", "prompt": program}, {"id": "off", "prompt": program, "exec": False},
             {"id": "spin", "prompt": exec_prompt(SPIN), "exec_max_instructions": 200_000}]  # outlasts the others
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "engine.toml").write_text(engine_toml(**EXEC_ENGINE))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxinfer.batch", "--input", str(tmp_path / "in.jsonl"), "--output",
         str(tmp_path / "out.jsonl"), "--config", str(tmp_path / "engine.toml"),
         "--exec",  # the config's exec_slots, not the runner's default of 4: exec_llm's compiled shapes
         "--max-tokens", "8", "--no-progress", "--stats-json", str(tmp_path / "stats.json")],
        cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    outputs = {record["id"]: record for record in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert outputs["on"]["text"].startswith("<|result|>42<|/result|>")
    assert "<|result|>" not in outputs["off"]["text"]
    assert outputs["spin"]["text"].startswith("<|trap|>fuel exhausted<|/trap|>")
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["exec_programs"] == 2 and stats["exec_traps"] == 1
    assert stats["exec_idle_steps"] > 0  # steps that ran the machine alone, with nothing else to compute
    assert stats["xla_compiles_after_warmup"] == 0


def test_grpc_exec_field_streams_the_result(exec_llm: LLM) -> None:
    from servers import RunningServer

    from serving.client import InferenceClient

    ids = exec_llm.encode(exec_prompt(SIX_TIMES_SEVEN))
    running = RunningServer(exec_llm)
    try:
        running.call(running.server.load())
        with InferenceClient(running.target, timeout=120) as client:
            deltas = list(client.stream(ids, max_tokens=8, temperature=0.0, exec=True))
            plain = list(client.stream(ids, max_tokens=8, temperature=0.0))
    finally:
        running.close()
    expected = exec_llm.generate([exec_prompt(SIX_TIMES_SEVEN)], greedy(exec=True))[0]
    assert "".join(d.text for d in deltas) == expected.text
    assert expected.text.startswith("<|result|>42<|/result|>")
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "<|result|>" not in "".join(d.text for d in plain)


COPY_AND_PRINT = """(module
 (import "wasi_snapshot_preview1" "fd_read" (func $read (param i32 i32 i32 i32) (result i32)))
 (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
 (memory 1)
 (func (export "main") (result i32)
   (i32.store (i32.const 0) (i32.const 100)) (i32.store (i32.const 4) (i32.const 64))
   (drop (call $read (i32.const 3) (i32.const 0) (i32.const 1) (i32.const 8)))
   (i32.store (i32.const 4) (i32.load (i32.const 8)))
   (drop (call $write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 12)))
   (drop (call $write (i32.const 4) (i32.const 0) (i32.const 1) (i32.const 12)))
   (i32.load (i32.const 12))))"""


def test_wasi_stdout_and_tenant_files_in_generation(exec_llm: LLM, files_root) -> None:
    params = greedy(max_tokens=16, exec=True, exec_files=("numbers.txt", "copy.txt"))
    request = exec_llm.request(exec_prompt(COPY_AND_PRINT), params)
    out = exec_llm.engine.generate([dataclasses.replace(request, tenant="acme")])[0]
    assert out.text.startswith("<|result|>4\n40 2<|/result|>")
    assert (files_root / "acme" / "copy.txt").read_bytes() == b"40 2"


def test_file_mapping_errors_name_the_field(exec_llm: LLM, smollm2_llm: LLM) -> None:
    with pytest.raises(RequestError, match="exec_files"):
        exec_llm.generate([exec_prompt(COPY_AND_PRINT)], greedy(exec=True, exec_files=("../x",)))
    with pytest.raises(RequestError, match="exec_files_root"):
        smollm2_llm.generate(["hi"], greedy(exec_files=("a.txt",)))


STORE_TURN = '(module (memory 1) (func (export "main") (result i32) (i32.store (i32.const 64) (i32.const 1234)) ' \
             '(i32.const 1)))'
LOAD_TURN = '(module (memory 1) (func (export "main") (result i32) (i32.load (i32.const 64))))'


def test_session_memory_carries_to_the_next_turn_for_the_same_tenant_only(exec_llm: LLM) -> None:
    def turn(program: str, tenant: str, session: str) -> str:
        request = exec_llm.request(exec_prompt(program), greedy(max_tokens=8, exec=True, exec_session=session))
        return exec_llm.engine.generate([dataclasses.replace(request, tenant=tenant)])[0].text

    assert turn(STORE_TURN, "acme", "chat-1").startswith("<|result|>1<|/result|>")
    assert turn(LOAD_TURN, "acme", "chat-1").startswith("<|result|>1234<|/result|>")
    assert turn(LOAD_TURN, "globex", "chat-1").startswith("<|result|>0<|/result|>")
    assert turn(LOAD_TURN, "acme", "chat-2").startswith("<|result|>0<|/result|>")
    # A turn whose program has no memory leaves the session's memory as it was (it used to store an
    # empty memory, and every later turn of the session failed for want of one).
    assert turn(SIX_TIMES_SEVEN, "acme", "chat-1").startswith("<|result|>42<|/result|>")
    assert turn(SIX_TIMES_SEVEN, "acme", "chat-1").startswith("<|result|>42<|/result|>")
    assert turn(LOAD_TURN, "acme", "chat-1").startswith("<|result|>1234<|/result|>")


COUNT_TO_THREE = '(module (func (export "main") (result i32) (local i32) (block (loop (br_if 1 (i32.ge_u ' \
                 '(local.get 0) (i32.const 3))) (local.set 0 (i32.add (local.get 0) (i32.const 1))) (br 0))) ' \
                 '(local.get 0)))'


def test_trace_summary_and_full_enter_the_context(exec_llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    import json

    with caplog.at_level("INFO", logger="jaxinfer.audit"):
        summary, full, none = exec_llm.generate([exec_prompt(COUNT_TO_THREE)] * 3, [
            greedy(max_tokens=40, exec=True, exec_trace="summary"),
            greedy(max_tokens=200, exec=True, exec_trace="full"),
            greedy(max_tokens=6, exec=True)])
    assert summary.text.startswith("<|result|>3\n[trace] 32 instructions, 4 branches taken<|/result|>")
    lines = full.text.split("<|/result|>")[0].splitlines()
    assert lines[0] == "<|result|>3" and len(lines) == 1 + 11  # one row per record: 3 per iteration
    assert lines[1].split() == ["1", "br_if", "0"] and lines[-1].split()[1:] == ["mov", "3"]
    assert none.text.startswith("<|result|>3<|/result|>")
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "jaxinfer.audit"]
    assert all(len(r["trace"]) == 11 and r["branches"] == 4 for r in records if r.get("event") == "exec")


def test_review_regressions_in_the_engine(exec_llm: LLM) -> None:
    """A program that fails to compile after a sampled <|/exec|> (async scheduling), output with control
    token spellings under the reject guard, and result text longer than max_tokens."""
    prompt = [*CHAT, {"special": "<|exec|>"}, '(module (func (export "main") (result i32) (i64.const 1)))']
    first = exec_llm.generate([prompt], greedy(max_tokens=1))[0].token_ids[0]
    close = exec_llm.tokenizer.token_id("<|/exec|>")
    weight = exec_llm.runner.state["model"]["embed_tokens"]["weight"]
    saved = weight[...]
    weight[...] = saved.at[close].set(2.0 * saved[first])
    try:
        out = exec_llm.generate([prompt], greedy(max_tokens=12, exec=True))[0]
    finally:
        weight[...] = saved
    assert out.text.startswith("<|/exec|><|trap|>type mismatch<|/trap|>") and len(out.token_ids) == 12

    shout = ('(module (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32))) '
             '(memory 1) (data (i32.const 64) "\\3c|im_end|\\3e and more text after it, again and again") '
             '(func (export "main") (i32.store (i32.const 0) (i32.const 64)) (i32.store (i32.const 4) (i32.const 46)) '
             '(drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))')
    exec_llm.tokenizer.guard = "reject"
    try:
        short = exec_llm.generate([exec_prompt(shout)], greedy(max_tokens=5, exec=True))[0]
    finally:
        exec_llm.tokenizer.guard = "downgrade"
    assert short.text == "<|result|><|im<|/result|>" and len(short.token_ids) == 5  # cut to max_tokens
    assert short.finish_reason == "length"


def test_the_pallas_machine_loop_serves_programs_inside_the_step(exec_llm: LLM, files_root) -> None:
    """engine.exec_loop = "pallas": the GPU kernel of the machine (interpreted on the CPU) inside the
    jitted step gives the same generations as the CPU's single kernel, traces included."""
    pallas = LLM("smollm2-135m", **TEST_ENGINE, **EXEC_ENGINE, exec_files_root=str(files_root),
                 exec_loop="pallas", exec_steps_per_step=64, exec_memory_pages=1)
    loop = ('(module (func (export "main") (result i64) (local i64 i32) (block (loop (br_if 1 (i32.ge_u '
            '(local.get 1) (i32.const 300))) (local.set 0 (i64.add (i64.mul (local.get 0) (i64.const 31)) '
            '(i64.extend_i32_u (local.get 1)))) (local.set 1 (i32.add (local.get 1) (i32.const 1))) (br 0))) '
            '(local.get 0)))')
    prompts = [exec_prompt(SIX_TIMES_SEVEN), exec_prompt(loop)]
    params = greedy(max_tokens=12, exec=True, exec_trace="summary")
    expected = [out.text for out in exec_llm.generate(prompts, params)]
    assert [out.text for out in pallas.generate(prompts, params)] == expected
    assert expected[0].startswith("<|result|>42") and "<|result|>" in expected[1]


def test_programs_reach_the_device_only_by_explicit_copies(exec_llm: LLM, files_root) -> None:
    """Loading a program, serving its system calls, reading its trace and keeping its session memory
    copy host arrays with `device_put` and `device_get` only (see the engine's transfer-guard test)."""
    files = greedy(max_tokens=16, exec=True, exec_files=("numbers.txt", "copy.txt"), exec_session="guarded")
    requests = [exec_llm.request(exec_prompt(COPY_AND_PRINT), files),
                exec_llm.request(exec_prompt(COUNT_TO_THREE), greedy(max_tokens=200, exec=True, exec_trace="full"))]
    with jax.transfer_guard("disallow"):
        wasi, traced = exec_llm.engine.generate([dataclasses.replace(r, tenant="acme") for r in requests])
        stored = exec_llm.generate([exec_prompt(STORE_TURN)], greedy(exec=True, exec_session="guarded"))[0]
        loaded = exec_llm.generate([exec_prompt(LOAD_TURN)], greedy(exec=True, exec_session="guarded"))[0]
    assert wasi.text.startswith("<|result|>4\n40 2<|/result|>")
    assert len(traced.text.split("<|/result|>")[0].splitlines()) == 1 + 11
    assert stored.text.startswith("<|result|>1<|/result|>") and loaded.text.startswith("<|result|>1234<|/result|>")


def test_stop_strings_match_what_the_model_writes_not_a_result_block(exec_llm: LLM) -> None:
    """A stop string inside a program's output, or starting in the result block and ending in the
    model's text, does not stop the request: the engine's result block is never cut. The same string
    written by the model later still stops it."""
    free = exec_llm.generate([exec_prompt(SIX_TIMES_SEVEN)], greedy(max_tokens=16, exec=True))[0]
    result_end = free.text.index("<|/result|>") + len("<|/result|>")
    spanning = "|>" + free.text[result_end]  # the marker's end and the model's first character
    for stop in ("42", spanning):
        out = exec_llm.generate([exec_prompt(SIX_TIMES_SEVEN)], greedy(max_tokens=16, exec=True, stop=[stop]))[0]
        assert out.text.startswith("<|result|>42<|/result|>"), stop
        if stop in free.text[result_end:]:
            assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop, result_end)]
        else:
            assert out.token_ids == free.token_ids and out.finish_reason == free.finish_reason
