"""KV tiers on the real SmolLM2: evicted prefix pages go to host memory (L2) and a tensorstore store (L3)
and come back on a hit with identical outputs; a second process reuses the L3 pages."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import engine_toml

from jaxinfer import SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.kv.prefix_cache import chain_keys
from jaxinfer.kv.store import ModelIdentity, PageStore
from jaxinfer.kv.tiers import HostPage, HostTier, TieredPages

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SYSTEM = "You are a terse assistant for a lighthouse keeper; answer in one line about tides and lamps. " * 2


def identity(llm) -> ModelIdentity:
    m = llm.model_config
    return ModelIdentity("smollm2-135m:test", np.dtype(llm.dtype).name, llm.config.page_size, m.num_layers,
                         m.num_kv_heads, m.head_dim)


def engine_on(llm, **flags) -> Engine:
    """Another engine on the shared test model's runner (its device pages), with its own flags or tiers."""
    return Engine(llm.runner, llm.tokenizer, llm.max_model_len, **flags)


def evict_everything(engine: Engine) -> None:
    with engine.pool.hold(keep_free=0):  # takes every free page: all cached pages are evicted
        pass
    engine.flush_tiers()


def test_evicted_pages_restore_from_l2_and_l3_with_identical_outputs(smollm2_llm, tmp_path):
    prompt = SYSTEM + "When is high tide?"
    request = smollm2_llm.request(prompt, GREEDY)
    reference = engine_on(smollm2_llm, prefix_caching=False).generate([request])[0]
    full_pages = (len(request.prompt_ids) - 1) // smollm2_llm.config.page_size
    assert full_pages >= 5
    tiers = TieredPages(HostTier(capacity=2), PageStore(str(tmp_path), identity(smollm2_llm)))
    engine = engine_on(smollm2_llm, tiers=tiers)
    assert engine.generate([request])[0].token_ids == reference.token_ids
    with jax.transfer_guard("disallow"):  # pages leave and come back by explicit copies (see test_engine.py)
        evict_everything(engine)
    assert len(tiers.host) == 2 and tiers.stats.demoted_l3 >= full_pages - 2
    keys = chain_keys(request.prompt_ids, smollm2_llm.config.page_size)
    in_host = [tiers.host.get(key) for key in keys[:2]]  # evicted from the chain's end: its head went last
    # L2 holds the copy program's own output, in pinned host memory (which the CPU platform has too).
    assert all(isinstance(page, HostPage) and page.group.sharding.memory_kind == "pinned_host" for page in in_host)
    computed_before = engine.stats.prompt_tokens_computed
    with jax.transfer_guard("disallow"):
        again = engine.generate([request])[0]
    assert again.token_ids == reference.token_ids
    page = smollm2_llm.config.page_size
    assert engine.stats.prefix_hit_tokens_l2 == 2 * page
    assert engine.stats.prefix_hit_tokens_l3 == (full_pages - 2) * page
    assert again.usage.cached_tokens == full_pages * page
    assert engine.stats.prompt_tokens_computed - computed_before == len(request.prompt_ids) - full_pages * page
    assert engine.pool.num_free == engine.pool.capacity


CHILD = """
import sys
sys.path.insert(0, {tests!r})
from conftest import TEST_ENGINE
from test_kv_tiers import SYSTEM, GREEDY, identity, evict_everything
from jaxinfer import LLM
from jaxinfer.engine.engine import Engine
from jaxinfer.kv.store import PageStore
from jaxinfer.kv.tiers import TieredPages
llm = LLM("smollm2-135m", **TEST_ENGINE)
engine = Engine(llm.runner, llm.tokenizer, llm.max_model_len,
                tiers=TieredPages(None, PageStore({store!r}, identity(llm))))
print(engine.generate([llm.request(SYSTEM + "Why do lamps flicker?", GREEDY)])[0].token_ids)
evict_everything(engine)
"""


def test_a_new_process_reuses_l3_pages_written_by_an_earlier_one(smollm2_llm, tmp_path):
    tests = str(Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", CHILD.format(tests=tests, store=str(tmp_path))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    request = smollm2_llm.request(SYSTEM + "Why do lamps flicker?", GREEDY)
    engine = engine_on(smollm2_llm, tiers=TieredPages(None, PageStore(str(tmp_path), identity(smollm2_llm))))
    with engine.pool.hold(keep_free=0):  # nothing of this prompt may come from this process's device pages
        pass
    out = engine.generate([request])[0]
    assert str(out.token_ids) == proc.stdout.strip().splitlines()[-1]
    assert engine.stats.prefix_hit_tokens_l3 >= 5 * smollm2_llm.config.page_size


def test_batch_runs_share_prefix_pages_through_the_store(tmp_path):
    import json

    from conftest import XLA_CACHE  # noqa: F401  (conftest set the persistent XLA cache for child processes)

    lines = [{"id": i, "prompt": SYSTEM + question, "max_tokens": 6}
             for i, question in enumerate(["When is low tide?", "Why is the lamp red?"])]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = tmp_path / "engine.toml"
    config.write_text(engine_toml())

    def run(name: str) -> tuple[list[dict], dict]:
        out, stats = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.stats.json"
        proc = subprocess.run([sys.executable, "-m", "jaxinfer.batch", "--input", str(tmp_path / "in.jsonl"),
                               "--output", str(out), "--config", str(config), "--kv-store",
                               str(tmp_path / "kv"), "--stats-json", str(stats), "--no-progress"],
                              cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in out.read_text().splitlines()], json.loads(stats.read_text())

    first, first_stats = run("first")
    second, second_stats = run("second")
    assert [r["token_ids"] for r in second] == [r["token_ids"] for r in first]
    assert first_stats["cached_tokens_l3"] == 0
    assert first_stats["xla_compiles_after_warmup"] == second_stats["xla_compiles_after_warmup"] == 0
    # The first prompt restores the system prompt's pages from the store; the second finds them on the device.
    assert second_stats["cached_tokens_l3"] >= 5 * 8 and second_stats["cached_prompt_tokens"] >= 2 * 5 * 8
    assert second_stats["cached_prompt_tokens"] == (second_stats["cached_tokens_l1"] + second_stats["cached_tokens_l2"]
                                                    + second_stats["cached_tokens_l3"])


def test_a_store_read_holds_only_its_own_request(smollm2_llm, tmp_path):
    """While a request's pages are read from L3 it waits in the queue; a running request keeps decoding."""
    store = PageStore(str(tmp_path), identity(smollm2_llm))
    engine = engine_on(smollm2_llm, tiers=TieredPages(None, store))
    restored = smollm2_llm.request(SYSTEM + "Which lamp is brightest?", GREEDY)
    reference = engine.generate([restored])[0]
    evict_everything(engine)
    assert store.num_pages >= 5
    busy = engine.add_request(smollm2_llm.request("Count to twenty.", SamplingParams(max_tokens=12, temperature=0)))
    engine.step()
    waiting = engine.add_request(restored)
    engine.step()  # starts the read; the waiting request is not admitted in the step that started it
    assert waiting.store_read is not None and waiting in engine.scheduler.waiting
    assert busy in engine.scheduler.running and busy.num_generated >= 2
    outputs = {}
    while engine.has_unfinished():
        outputs.update({out.index: out for out in engine.step()})
    assert outputs[waiting.index].token_ids == reference.token_ids
    assert engine.stats.store_reads == 1 and engine.stats.store_read_seconds > 0
    assert engine.stats.prefix_hit_tokens_l3 == store.num_pages * smollm2_llm.config.page_size
    metrics = engine.metrics()
    assert metrics["kv_l3_pages"] == store.num_pages and metrics["kv_l3_bytes"] == store.num_bytes > 0
    assert metrics["kv_l3_hits"] == store.num_pages


@pytest.mark.parametrize("prompt_logprobs", [None, 2])
def test_prefill_and_decode_engines_hand_off_through_the_store(smollm2_llm, tmp_path, prompt_logprobs):
    """A prefill engine computes the prompt and the first id and stores the pages; a decode engine that
    starts with an empty device pool maps them and continues: the same greedy output as one engine.
    A scored prompt (prompt_logprobs) is handed off scored, so the decode engine maps its pages too."""
    from jaxinfer.engine.disagg import decode_request, handoff, prefill_request, with_seed

    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=7, prompt_logprobs=prompt_logprobs)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How far does the beam reach?"}]
    request = smollm2_llm.chat_request(chat, params)
    single = engine_on(smollm2_llm, prefix_caching=False).generate([request])[0]
    store = PageStore(str(tmp_path), identity(smollm2_llm))
    prefill = engine_on(smollm2_llm, tiers=TieredPages(None, store))
    request = with_seed(request)
    first = prefill.generate([prefill_request(request)])[0]
    page = smollm2_llm.config.page_size
    assert first.token_ids == single.token_ids[:1]
    assert first.stored_pages == len(request.prompt_ids) // page == store.num_pages
    passed = handoff(request, first, prefill.max_model_len)
    assert passed.finish_reason is None
    with smollm2_llm.runner.pool.hold(keep_free=0):  # drops the prefill engine's device pages
        pass
    smollm2_llm.runner.pool.take_evicted()  # as if on another machine: they are not demoted here
    decode = engine_on(smollm2_llm, tiers=TieredPages(None, PageStore(str(tmp_path), identity(smollm2_llm))))
    out = decode.generate([decode_request(passed)])[0]
    assert out.token_ids == single.token_ids and out.text == single.text
    assert out.usage.cached_tokens == decode.stats.prefix_hit_tokens_l3 == first.stored_pages * page
    assert decode.stats.prompt_tokens_computed == len(request.prompt_ids) - first.stored_pages * page
    assert decode.pool.num_free == decode.pool.capacity
    if prompt_logprobs is not None:
        assert out.prompt_logprobs == first.prompt_logprobs and out.prompt_top_logprobs == first.prompt_top_logprobs
        np.testing.assert_allclose(out.prompt_logprobs[1:], single.prompt_logprobs[1:], atol=1e-5)


def stored_prompt(llm, store: PageStore, question: str):
    """An engine on `store` that answered `question` and pushed its prompt's pages down to the store:
    (engine, request, its output, page size, prefix keys, the file of the third page)."""
    engine = engine_on(llm, tiers=TieredPages(None, store))
    request = llm.request(SYSTEM + question, GREEDY)
    reference = engine.generate([request])[0]
    evict_everything(engine)
    keys = chain_keys(request.prompt_ids, llm.config.page_size)
    third = Path(store.location.removeprefix("file://")) / store.identity.digest() / keys[2].hex()
    return engine, request, reference, llm.config.page_size, keys, third


def test_a_damaged_stored_page_is_recomputed_not_used(smollm2_llm, tmp_path):
    store = PageStore(str(tmp_path), identity(smollm2_llm))
    engine, request, reference, page, keys, damaged = stored_prompt(smollm2_llm, store, "Where is the fog horn?")
    raw = bytearray(damaged.read_bytes())
    raw[-7] ^= 0xFF  # one flipped byte in the page's data
    damaged.write_bytes(bytes(raw))
    computed_before = engine.stats.prompt_tokens_computed
    with jax.transfer_guard("disallow"):
        again = engine.generate([request])[0]
    assert again.token_ids == reference.token_ids
    assert store.stats.corrupt == 1 and engine.stats.prefix_hit_tokens_l3 == 2 * page  # the chain stops there
    assert engine.stats.prompt_tokens_computed - computed_before == len(request.prompt_ids) - 2 * page
    evict_everything(engine)
    assert keys[2] in store and store.get(keys[2]) is not None  # recomputed, evicted again, stored intact


def test_pages_evicted_by_a_restore_are_copied_out_before_it_overwrites_them(smollm2_llm):
    """A restore allocates device pages, which can evict other cached pages: their content must go down
    to L2 before the restored content is written over it."""
    tiers = TieredPages(HostTier(capacity=256), None)
    engine = engine_on(smollm2_llm, tiers=tiers)
    first = smollm2_llm.request(SYSTEM + "When is high tide?", GREEDY)
    second = smollm2_llm.request("Lamps and tides: " * 12 + "Which comes first?", GREEDY)
    references = [engine.generate([r])[0].token_ids for r in (first, second)]
    evict_everything(engine)  # both prompts' pages are in L2 now
    engine.generate([second])  # the second prompt's pages are back on the device, cached
    page = smollm2_llm.config.page_size
    needed = len(first.prompt_ids) // page + 2
    with engine.pool.hold(keep_free=needed):  # what is left free are mostly the second prompt's cached pages
        assert engine.generate([first])[0].token_ids == references[0]  # restored over them
    evict_everything(engine)
    hits = engine.stats.prefix_hit_tokens_l2
    assert engine.generate([second])[0].token_ids == references[1]  # its pages came back from L2 intact
    assert engine.stats.prefix_hit_tokens_l2 > hits


def test_a_hand_off_with_min_tokens_ignores_stop_strings_in_the_first_token(smollm2_llm, tmp_path):
    from jaxinfer.engine.disagg import decode_request, handoff, prefill_request

    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a lamp."}]
    probe = smollm2_llm.chat_request(chat, SamplingParams(max_tokens=6, temperature=0.0))
    single = engine_on(smollm2_llm, prefix_caching=False)
    first_text = smollm2_llm.tokenizer.decode(single.generate([probe])[0].token_ids[:1]).strip()
    assert first_text
    params = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=3, stop=[first_text], seed=1)
    request = smollm2_llm.chat_request(chat, params)
    expected = single.generate([request])[0]
    store = PageStore(str(tmp_path), identity(smollm2_llm))
    engine = engine_on(smollm2_llm, tiers=TieredPages(None, store))
    passed = handoff(request, engine.generate([prefill_request(request)])[0], engine.max_model_len)
    assert passed.finish_reason is None  # the first token cannot stop a request with min_tokens 3
    assert engine.generate([decode_request(passed)])[0].token_ids == expected.token_ids


def test_a_prefill_worker_on_a_hung_store_waits_once_and_hands_off_only_stored_pages(smollm2_llm, tmp_path):
    """The file driver's write of one prompt page blocks for good (a FIFO where it writes the value
    before renaming it), as on a hung store. The first hand-off waits the deadline once and reports
    only the two pages before the hung one as stored; its decode computes the rest, with the same
    output. Writes then rest: the next hand-off, whose third page is the same, does not wait again."""
    from jaxinfer.engine.disagg import decode_request, handoff, prefill_request, with_seed

    store = PageStore(f"file://{tmp_path}/", identity(smollm2_llm), timeout_seconds=1.0)
    prefill = engine_on(smollm2_llm, tiers=TieredPages(None, store))
    requests = [with_seed(smollm2_llm.chat_request([{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": question}], GREEDY))
                for question in ("When is high tide?", "How far does the beam reach?")]
    page = smollm2_llm.config.page_size
    keys = chain_keys(requests[0].prompt_ids, page)
    assert keys[:3] == chain_keys(requests[1].prompt_ids, page)[:3]  # the shared SYSTEM prefix
    lock = tmp_path / store.identity_digest / (keys[2].hex() + ".__lock")
    lock.parent.mkdir(exist_ok=True)
    os.mkfifo(lock)
    try:
        firsts = [prefill.generate([prefill_request(requests[0])])[0]]
        timeouts = store.stats.timeouts  # the hung write, and any queued behind it in tensorstore's pool
        firsts.append(prefill.generate([prefill_request(requests[1])])[0])
    finally:
        os.close(os.open(lock, os.O_RDWR))  # the blocked open finds a reader; tensorstore refuses the FIFO
    assert [first.stored_pages for first in firsts] == [2, 2]
    assert timeouts >= 1 and store.stats.timeouts == timeouts and store.stats.writes_skipped > 0  # no wait again
    passed = handoff(requests[0], firsts[0], prefill.max_model_len)
    assert passed.finish_reason is None
    expected = engine_on(smollm2_llm, prefix_caching=False).generate([requests[0]])[0]
    assert prefill.generate([decode_request(passed)])[0].token_ids == expected.token_ids
    assert prefill.pool.num_free == prefill.pool.capacity


def test_a_stored_page_that_never_arrives_is_recomputed_after_the_deadline(smollm2_llm, tmp_path):
    """A FIFO at a stored page's path blocks its read forever, as a hung network filesystem would:
    the request waits no longer than `kv_store_timeout_seconds`, then computes that page and the rest
    itself, with the same output."""
    store = PageStore(f"file://{tmp_path}/", identity(smollm2_llm), timeout_seconds=1.0)  # URL: no path checks
    engine, request, reference, page, keys, fifo = stored_prompt(smollm2_llm, store, "When is high tide?")
    fifo.unlink()
    os.mkfifo(fifo)
    try:
        started = time.perf_counter()
        again = engine.generate([request])[0]
        assert time.perf_counter() - started < 30
    finally:
        os.close(os.open(fifo, os.O_RDWR))  # ends the read still blocked in open()
    assert again.token_ids == reference.token_ids
    # Pages after the hung one may be queued behind it in tensorstore's pool and time out too.
    timeouts = store.stats.timeouts
    assert timeouts >= 1 and engine.stats.prefix_hit_tokens_l3 == 2 * page
    assert keys[2] not in store and engine.metrics()["kv_l3_timeouts"] == timeouts
    assert engine.pool.num_free == engine.pool.capacity
