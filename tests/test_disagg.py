"""The KV channel in one process, on real servers on loopback: what a prefill worker answers and
refuses, and how the decode front's router passes over a peer that is busy, wedged, dead, of another
KV layout, or behind TLS (and then prefills the request itself)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import TEST_ENGINE
from servers import RunningServer, self_signed

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.disagg import Handoff, decode_request, settled, with_seed
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.params import Request
from serving.convert import sampling_proto
from serving.disagg import DeadlinePassed, PrefillRouter, finished_output
from serving.proto.jaxinfer.v1 import inference_pb2 as pb
from serving.proto.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from serving.tenants import Tenant
from serving.worker import QueueFull

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 96
TEXT = "The harbour master logs every ship, tide and storm in the great ledger. " * 4


@pytest.fixture(scope="module")
def kv_llm(tmp_path_factory):
    store = tmp_path_factory.mktemp("kv")
    return LLM("smollm2-135m", **TEST_ENGINE, kv_store=str(store), max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def prefill(kv_llm):
    running = RunningServer(kv_llm, role="prefill")
    running.call(running.server.load())
    yield running
    running.close()


def route(target: str, request: Request, *, timeout: float | None = 60, identity: str = "", metadata: tuple = (),
          **router) -> tuple:
    """(hand-off or None, remote, local) of one request through a fresh router to `target`."""
    async def go():
        peers = PrefillRouter((target,), **router)
        try:
            return await peers.prefill(request, metadata, timeout, identity), peers.remote, peers.local
        finally:
            await peers.close()
    return asyncio.run(go())


def prefill_call(target: str, request: Request, kv_identity: str = "", key: str = "",
                 tls_ca: bytes | None = None) -> pb.PrefillResponse:
    """One KVChannel.Prefill call, as a decode front makes it (`tls_ca`: over TLS)."""
    message = pb.PrefillRequest(prompt_token_ids=request.prompt_ids, sampling=sampling_proto(request.params),
                                kv_identity=kv_identity)
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=tls_ca)) if tls_ca
               else grpc.insecure_channel(target))
    with channel:
        return pb_grpc.KVChannelStub(channel).Prefill(message, metadata=metadata, timeout=120)


class Wedged:
    """Holds a server's engine thread between two steps (a hung device or a stuck step) until released."""

    def __init__(self, running: RunningServer):
        self.running, self.release, started = running, threading.Event(), threading.Event()
        self.done = running.server.worker.call(lambda _: (started.set(), self.release.wait(120)))
        assert started.wait(30)

    def __enter__(self) -> Wedged:
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.done.result(timeout=30)


def test_a_prompt_that_reaches_the_context_end_ends_on_the_prefill_worker(kv_llm, prefill):
    """One engine ends such a request after one id ('length'); so must the hand-off, or the decode
    worker refuses it (its prompt plus the id fill the context)."""
    params = SamplingParams(max_tokens=10, temperature=0.0)
    prompt = kv_llm.request(TEXT * 2, params).prompt_ids[: MAX_MODEL_LEN - 1]
    assert len(prompt) == MAX_MODEL_LEN - 1
    passed, remote, _ = route(prefill.target, Request(prompt, params))
    assert remote == 1 and passed.finish_reason == "length" and len(passed.generated_ids) == 1
    shorter, _, _ = route(prefill.target, Request(prompt[:-1], params))
    assert shorter.finish_reason is None  # one more id fits: the decode worker goes on


def test_the_front_settles_a_hand_off_against_its_own_context_length():
    """A peer with another max_model_len: the front ends what reaches its own context's end and goes
    on with what the peer ended only at the peer's (max_tokens not reached)."""
    request = Request(list(range(1, 100)), SamplingParams(max_tokens=10, seed=1))
    from_peer = Handoff(request, [5], [0.0], 12, None, "x")
    assert settled(from_peer, 100).finish_reason == "length"  # 99 + 1 ids fill this context
    assert settled(from_peer, 101).finish_reason is None
    ended_there = dataclasses.replace(from_peer, finish_reason="length")  # the peer's context was 100
    assert settled(ended_there, 4096).finish_reason is None
    stopped = dataclasses.replace(from_peer, finish_reason="stop")
    assert settled(stopped, 4096) is stopped


def test_a_peer_that_refuses_what_the_front_accepts_is_passed_over(kv_llm, prefill):
    """A prompt past the peer's max_model_len (a peer configured differently from the front) is its
    INVALID_ARGUMENT, not the request's: the front prefills it itself."""
    prompt = kv_llm.request(TEXT * 3, SamplingParams()).prompt_ids[: MAX_MODEL_LEN + 4]
    assert route(prefill.target, Request(prompt, SamplingParams(max_tokens=4))) == (None, 0, 1)


def test_the_first_token_s_top_logprobs_come_with_the_hand_off(kv_llm, prefill):
    """The prefill worker samples the first id: its alternatives travel in the reply, and the decode
    worker's output has them for every id, as one engine running the whole request would."""
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=4)
    request = kv_llm.request("Tides and alternatives: " + TEXT, params)
    whole = kv_llm.generate([request.prompt_ids], params)[0]
    passed, remote, _ = route(prefill.target, request)
    assert remote == 1 and len(passed.generated_top_logprobs) == 1
    (out,) = kv_llm.engine.generate([decode_request(passed)])
    assert out.token_ids == whole.token_ids and len(out.top_logprobs) == 5
    for ours, theirs in zip(out.top_logprobs, whole.top_logprobs, strict=True):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        # The ids after the first attend over KV the peer wrote from its own batch shape: float32 sums
        # in another order (CI saw 1.1e-5 at a logprob of -3.69).
        np.testing.assert_allclose([v for _, v in ours], [v for _, v in theirs], atol=1e-4)
    one = dataclasses.replace(request, params=dataclasses.replace(params, max_tokens=1))
    ended, _, _ = route(prefill.target, one)
    assert ended.finish_reason == "length" and finished_output(ended).top_logprobs == ended.generated_top_logprobs


def test_the_prompt_scored_by_the_prefill_worker_comes_with_the_hand_off(kv_llm, prefill):
    """The prefill worker scores the prompt (prompt_logprobs): the scores travel in the reply and come out
    of the decode worker (which then need not compute the prompt again: test_kv_tiers.py)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    request = kv_llm.request("Tides, scored: " + TEXT, params)
    whole = Engine(kv_llm.runner, kv_llm.tokenizer, kv_llm.max_model_len, prefix_caching=False).generate(
        [kv_llm.request("Tides, scored: " + TEXT, params)])[0]
    passed, remote, _ = route(prefill.target, request)
    assert remote == 1 and len(passed.prompt_logprobs) == len(request.prompt_ids) and passed.stored_pages > 0
    (out,) = kv_llm.engine.generate([decode_request(passed)])
    assert out.token_ids == whole.token_ids
    assert out.prompt_logprobs[0] is None
    np.testing.assert_allclose(out.prompt_logprobs[1:], whole.prompt_logprobs[1:], atol=1e-5)
    assert [[t for t, _ in top] for top in out.prompt_top_logprobs] == \
        [[t for t, _ in top] for top in whole.prompt_top_logprobs]
    one = dataclasses.replace(request, params=dataclasses.replace(params, max_tokens=1))
    ended, _, _ = route(prefill.target, one)
    assert ended.finish_reason == "length"
    np.testing.assert_allclose(finished_output(ended).prompt_logprobs[1:], whole.prompt_logprobs[1:], atol=1e-5)


def test_a_finished_hand_off_reports_the_prompt_tokens_found_cached(kv_llm, prefill):
    request = kv_llm.request("Tides and ships: " + TEXT, SamplingParams(max_tokens=1, temperature=0.0))
    route(prefill.target, request)
    again, _, _ = route(prefill.target, request)
    assert again.finish_reason == "length" and again.cached_tokens >= 5 * TEST_ENGINE["page_size"]
    assert finished_output(again).usage.cached_tokens == again.cached_tokens


def test_a_busy_or_wedged_peer_is_passed_over_and_the_front_prefills_itself(kv_llm):
    running = RunningServer(kv_llm, role="prefill", max_queued=1)
    try:
        running.call(running.server.load())
        worker, request = running.server.worker, with_seed(kv_llm.request(TEXT, SamplingParams(max_tokens=4)))
        with Wedged(running):
            started = time.perf_counter()
            assert route(running.target, request, timeout=None, timeout_seconds=1.0) == (None, 0, 1)
            assert time.perf_counter() - started < 10  # the peer's own deadline, not the client's (none)
            started = time.perf_counter()
            with pytest.raises(DeadlinePassed, match="the client's deadline passed"):  # the client has gone:
                route(running.target, request, timeout=1.0)  # no local prefill, cancelled at once
            assert time.perf_counter() - started < 10
            backlog = []  # max_seqs to run and one waiting (the timed-out call's request may be one)
            with pytest.raises(QueueFull):
                for _ in range(worker.engine.cfg.max_seqs + 2):
                    backlog.append(worker.submit(request, lambda _: None))
            with pytest.raises(grpc.RpcError) as busy:
                prefill_call(running.target, request)
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, busy.value.details()
            assert route(running.target, request) == (None, 0, 1)
            for stream in backlog:
                worker.cancel(stream)
        deadline = time.monotonic() + 30  # the engine thread, released, drops the cancelled requests
        while worker.waiting >= worker.max_queued:
            assert time.monotonic() < deadline, worker.waiting
            time.sleep(0.01)
        passed, remote, local = route(running.target, request)
        assert (remote, local) == (1, 0) and passed.generated_ids
    finally:
        running.close()
    assert kv_llm.runner.pool.num_free == kv_llm.runner.pool.capacity


def test_a_dead_peer_answers_unavailable_and_the_front_prefills_itself(kv_llm, monkeypatch):
    running = RunningServer(kv_llm, role="prefill")
    try:
        running.call(running.server.load())
        engine = running.server.worker.engine

        def broken() -> bool:
            raise RuntimeError("device lost")

        monkeypatch.setattr(engine, "has_unfinished", broken)
        running.server.worker.call(lambda _: None)  # wakes the thread, which then dies
        deadline = time.time() + 30
        while running.server.worker.dead is None:
            assert time.time() < deadline
            time.sleep(0.01)
        request = with_seed(kv_llm.request(TEXT, SamplingParams(max_tokens=4)))
        with pytest.raises(grpc.RpcError) as dead:
            prefill_call(running.target, request)
        assert dead.value.code() == grpc.StatusCode.UNAVAILABLE and "device lost" in dead.value.details()
        assert route(running.target, request) == (None, 0, 1)
    finally:
        monkeypatch.undo()
        running.close()


def test_a_peer_with_another_kv_layout_refuses_and_the_front_prefills_itself(kv_llm, prefill):
    request = with_seed(kv_llm.request(TEXT, SamplingParams(max_tokens=4)))
    other = "0" * 24
    with pytest.raises(grpc.RpcError) as refused:
        prefill_call(prefill.target, request, kv_identity=other)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"kv_identity: the caller's KV store identity {other}" in refused.value.details()
    assert route(prefill.target, request, identity=other) == (None, 0, 1)
    passed, remote, _ = route(prefill.target, request, identity=kv_llm.engine.kv_identity)
    assert remote == 1 and passed.generated_ids


def test_prefill_calls_keep_tenant_limits_go_over_tls_and_finish_in_a_drain(kv_llm, tmp_path):
    cert, key, cert_pem = self_signed(tmp_path)
    tenants = (Tenant("tiny", api_key="key-tiny", max_queued_tokens=20), Tenant("acme", api_key="key-acme"))
    running = RunningServer(kv_llm, role="prefill", auth=True, tenants=tenants, tls_cert=cert, tls_key=key,
                            grace_seconds=60)
    try:
        running.call(running.server.load())
        request = with_seed(kv_llm.request(TEXT, SamplingParams(max_tokens=4)))

        def call(api_key: str) -> pb.PrefillResponse:
            return prefill_call(running.target, request, key=api_key, tls_ca=cert_pem)

        with pytest.raises(grpc.RpcError) as limited:
            call("key-tiny")  # a prompt of 60-odd tokens, over tiny's 20 queued tokens
        assert limited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queued_tokens" in limited.value.details()

        acme = (("authorization", "Bearer key-acme"),)
        assert route(running.target, request, metadata=acme, tls_ca=cert_pem)[1:] == (1, 0)
        assert route(running.target, request, metadata=acme)[1:] == (0, 1)  # plaintext to a TLS port: passed over

        with ThreadPoolExecutor(1) as pool, Wedged(running) as wedged:
            in_flight = pool.submit(call, "key-acme")
            deadline = time.time() + 30
            while running.server.service.active == 0:
                assert time.time() < deadline
                time.sleep(0.01)
            stopping = asyncio.run_coroutine_threadsafe(running.server.stop(), running.loop)
            time.sleep(2.0)
            assert not stopping.done() and not in_flight.done()  # the drain waits for the Prefill call
            wedged.release.set()
            assert in_flight.result(timeout=60).token_ids
            stopping.result(timeout=60)
    finally:
        running.close()  # a second stop after the drain's is harmless
    assert kv_llm.runner.pool.num_free == kv_llm.runner.pool.capacity

