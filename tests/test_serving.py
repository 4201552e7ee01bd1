"""The gRPC server on 127.0.0.1: streaming equals LLM.generate, bad input, cancellation, health, reflection, stubs."""

from __future__ import annotations

import asyncio
import filecmp
import json
import random
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from servers import RunningServer, self_signed

from jaxinfer import SamplingParams
from serving import stubs
from serving.client import AsyncInferenceClient, InferenceClient
from serving.metrics import REQUEST_STATUSES
from serving.proto.jaxinfer.v1 import inference_pb2 as pb
from serving.proto.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from serving.server import SERVICE_NAME
from serving.tenants import Tenant

pytestmark = pytest.mark.slow


def health_status(target: str, service: str = "", timeout: float | None = None) -> int:
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout).status


@pytest.fixture(scope="module")
def server(smollm2_llm):
    running = RunningServer(smollm2_llm)
    assert health_status(running.target) == health_pb2.HealthCheckResponse.NOT_SERVING
    with InferenceClient(running.target) as client, pytest.raises(grpc.RpcError) as loading:
        client.generate("hi", max_tokens=2)
    assert loading.value.code() == grpc.StatusCode.UNAVAILABLE
    running.call(running.server.load())
    assert health_status(running.target, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    yield running
    running.close()


@pytest.fixture()
def client(server):
    with InferenceClient(server.target, timeout=120) as c:
        yield c


def test_streamed_text_equals_generate(smollm2_llm, server, client):
    prompts = ["The capital of France is", "List three colors:"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = smollm2_llm.generate(prompts, params)
    for prompt, want in zip(prompts, expected, strict=True):
        deltas = list(client.stream(prompt, max_tokens=12, temperature=0.0))
        assert len(deltas) > 1  # streamed, not one message
        assert "".join(d.text for d in deltas) == want.text
        assert [t for d in deltas for t in d.token_ids] == want.token_ids
        last = deltas[-1]
        assert last.finish_reason == {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}[
            want.finish_reason]
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
            want.usage.prompt_tokens, want.usage.completion_tokens)
        assert all(d.finish_reason == pb.FINISH_REASON_UNSPECIFIED for d in deltas[:-1])


def test_penalties_travel_with_the_request(smollm2_llm, client):
    prompt = "Say la la la la la la"
    penalties = dict(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0)
    want = smollm2_llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, **penalties))[0]
    plain = smollm2_llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert want.token_ids != plain.token_ids  # else this would not show the fields arrived
    text, last = client.generate(prompt, max_tokens=16, temperature=0.0, **penalties)
    assert text == want.text and last.usage.completion_tokens == len(want.token_ids)


def test_logit_bias_travels_with_the_request(smollm2_llm, client):
    prompt = "The capital of France is"
    first = smollm2_llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    want = smollm2_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logit_bias={first: -100}))[0]
    assert want.token_ids[0] != first
    text, last = client.generate(prompt, max_tokens=6, temperature=0.0, logit_bias={first: -100.0})
    assert text == want.text and last.usage.completion_tokens == len(want.token_ids)


def test_guided_output_travels_with_the_request(smollm2_llm, client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "year": {"type": "integer"}},
              "required": ["city", "year"]}
    gbnf = 'root ::= "yes" | "no" | "(" root ")"'
    cases = [({"json_schema": schema}, pb.GuidedDecoding(json_schema=json.dumps(schema)),
              lambda text: set(json.loads(text)) == {"city", "year"}),
             ({"choice": ["yes", "no"]}, pb.GuidedDecoding(choice=pb.ChoiceList(values=["yes", "no"])),
              lambda text: text in ("yes", "no")),
             ({"grammar": gbnf}, pb.GuidedDecoding(grammar=gbnf), lambda text: text.strip("()") in ("yes", "no"))]
    for guided, proto, valid in cases:
        want = smollm2_llm.generate(["A trip:"], SamplingParams(max_tokens=24, temperature=0.0, guided=guided))[0]
        text, last = client.generate("A trip:", max_tokens=24, temperature=0.0, guided=proto)
        assert text == want.text and last.finish_reason == pb.FINISH_REASON_STOP and valid(text)


def test_streamed_top_logprobs_come_with_their_tokens(smollm2_llm, client):
    prompt = "The capital of France is"
    want = smollm2_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, logprobs=True,
                                                         top_logprobs=3))[0]
    deltas = list(client.stream(prompt, max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=3))
    assert all(len(d.top_logprobs) == len(d.token_ids) for d in deltas)
    streamed = [top for d in deltas for top in d.top_logprobs]
    assert [list(top.token_ids) for top in streamed] == [[t for t, _ in top] for top in want.top_logprobs]
    np.testing.assert_allclose([list(top.logprobs) for top in streamed],
                               [[v for _, v in top] for top in want.top_logprobs], rtol=1e-6)


def test_the_scored_prompt_comes_with_the_first_tokens(smollm2_llm, client):
    prompt = "The capital of France is"
    want = smollm2_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2))[0]
    first, *rest = list(client.stream(prompt, max_tokens=6, temperature=0.0, prompt_logprobs=2))
    assert first.token_ids and all(not d.prompt_logprobs and not d.prompt_top_logprobs for d in rest)
    np.testing.assert_allclose(first.prompt_logprobs, want.prompt_logprobs[1:], rtol=1e-6)
    assert [list(top.token_ids) for top in first.prompt_top_logprobs] == \
        [[t for t, _ in top] for top in want.prompt_top_logprobs[1:]]
    np.testing.assert_allclose([list(top.logprobs) for top in first.prompt_top_logprobs],
                               [[v for _, v in top] for top in want.prompt_top_logprobs[1:]], rtol=1e-6)
    unscored = list(client.stream(prompt, max_tokens=2, temperature=0.0))
    assert not any(d.prompt_logprobs for d in unscored)


def test_the_scored_prompt_waits_for_its_last_position(smollm2_llm, server):
    """A decode worker's request holds an id handed off before its prompt is scored here (the peer did not
    score it): that id streams first, and the scores come once complete, in one delta."""
    import dataclasses
    import queue

    from jaxinfer.engine.params import Request

    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)
    prompt = smollm2_llm.request("A long road, " * 30, params).prompt_ids
    want = smollm2_llm.generate([prompt], params)[0]
    request = dataclasses.replace(Request(prompt, params), generated_ids=want.token_ids[:1])
    deltas: queue.SimpleQueue = queue.SimpleQueue()
    server.server.worker.submit(request, deltas.put)
    received = [deltas.get(timeout=120)]
    while received[-1].final is None and received[-1].error is None:
        received.append(deltas.get(timeout=120))
    scored = [d for d in received if d.prompt_logprobs is not None]
    assert received[0].token_ids == want.token_ids[:1] and received[0].prompt_logprobs is None
    assert len(scored) == 1 and None not in scored[0].prompt_logprobs[1:]
    np.testing.assert_allclose(scored[0].prompt_logprobs[1:], want.prompt_logprobs[1:], atol=1e-5)
    assert received[-1].final.token_ids == want.token_ids


def test_stop_strings_are_never_streamed(smollm2_llm, client):
    free = smollm2_llm.generate(["Count: one, two,"], SamplingParams(max_tokens=10, temperature=0.0))[0]
    stop = free.text[4:7]
    want = smollm2_llm.generate(["Count: one, two,"], SamplingParams(max_tokens=10, temperature=0.0, stop=[stop]))[0]
    deltas = list(client.stream("Count: one, two,", max_tokens=10, temperature=0.0, stop=[stop]))
    assert "".join(d.text for d in deltas) == want.text and stop not in want.text
    assert deltas[-1].finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        (dict(text=""), "prompt"),
        (dict(text="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
        (dict(text="hi", sampling=pb.SamplingParams(temperature=-1)), "temperature"),
        (dict(text="hi", sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
        (dict(text="hi", sampling=pb.SamplingParams(repetition_penalty=0)), "repetition_penalty: must be in (0.0"),
        (dict(text="hi", sampling=pb.SamplingParams(frequency_penalty=-3)), "frequency_penalty"),
        (dict(text="hi", sampling=pb.SamplingParams(top_logprobs=21, logprobs=True)), "top_logprobs: must be in"),
        (dict(text="hi", sampling=pb.SamplingParams(top_logprobs=2)), "top_logprobs: needs logprobs true"),
        (dict(text="hi", sampling=pb.SamplingParams(prompt_logprobs=21)), "prompt_logprobs: must be in"),
        (dict(text="hi", sampling=pb.SamplingParams(logit_bias={3: 101.0})), r"logit_bias[3]: must be in"),
        (dict(text="hi", sampling=pb.SamplingParams(logit_bias={10**9: 1.0})), "outside the vocabulary"),
        (dict(text="hi", sampling=pb.SamplingParams(guided=pb.GuidedDecoding(regex="(("))), "guided.regex: "),
        (dict(text="hi", sampling=pb.SamplingParams(guided=pb.GuidedDecoding())), "guided: set one of"),
        (dict(token_ids=pb.TokenIds(ids=[1, 10**9])), "prompt_token_ids"),
        (dict(parts=pb.PromptParts(parts=[pb.PromptPart(special="<|nope|>")])), "nope"),
        (dict(text="word " * 9000), "prompt"),
        (dict(text="hi", sampling=pb.SamplingParams(max_tokens=10**9)), "max_tokens"),
        (dict(chat=pb.Messages()), "chat.messages"),
        (dict(text="hi", sampling=pb.SamplingParams(stop=["x"] * 17)), "stop: at most 16 strings, got 17"),
        (dict(text="hi", sampling=pb.SamplingParams(stop=["ok", "x" * 257])), "stop[1]: at most 256 characters"),
        (dict(text="hi", request_id="r" * 257), "request_id: at most 256 characters"),
        (dict(), "prompt"),
    ],
)
def test_invalid_input_names_the_field_and_the_server_keeps_serving(client, request_kwargs, field):
    with pytest.raises(grpc.RpcError) as error:
        list(client.stub.Generate(pb.GenerateRequest(**request_kwargs), timeout=60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details()
    _, last = client.generate("Hello", max_tokens=2, temperature=0.0)
    assert last.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"\x0a\x03\xff\xfeA", "text: invalid UTF-8"),  # field 1 (text), bytes ff fe 41
        (b"\x12\x0b\x0a\x09\x0a\x04user\x12\x01\xc3", "chat.messages.content: invalid UTF-8"),
        (b"\x0a\x09", "request"),  # a length running past the end
    ],
)
def test_undecodable_requests_name_the_field(server, client, raw, field):
    channel = grpc.insecure_channel(server.target)  # raw bytes: no client-side encoding of the request
    generate = channel.unary_stream("/jaxinfer.v1.Inference/Generate",
                                    response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as error:
        list(generate(raw, timeout=60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(field)
    assert client.generate("Hello", max_tokens=2, temperature=0.0)[1].usage.completion_tokens == 2


def test_cancelled_streams_free_their_pages_and_spare_the_others(smollm2_llm, server):
    pool = smollm2_llm.runner.pool
    expected = smollm2_llm.generate(["Tell me about rivers."], SamplingParams(max_tokens=16, temperature=0.0))[0]
    with InferenceClient(server.target, timeout=120) as client:
        cancelled = [client.stream(f"Write a long story number {i}.", max_tokens=200, temperature=0.0)
                     for i in range(4)]
        for call in cancelled:
            next(call)  # running: the first delta arrived
        survivor = client.stream("Tell me about rivers.", max_tokens=16, temperature=0.0)
        for call in cancelled:
            call.cancel()
        assert "".join(d.text for d in survivor) == expected.text
    deadline = time.time() + 30
    while (server.server.worker.num_streams or pool.num_free != pool.capacity) and time.time() < deadline:
        time.sleep(0.05)
    assert server.server.worker.num_streams == 0
    assert pool.num_free == pool.capacity


def test_tokenize_detokenize_and_list_models(smollm2_llm, client):
    ids = client.stub.Tokenize(pb.TokenizeRequest(text="Hello <|im_end|> world")).token_ids
    assert list(ids) == smollm2_llm.encode("Hello <|im_end|> world")
    assert client.stub.Tokenize(pb.TokenizeRequest(text="Hello <|im_end|> world")).forged_tokens == 1
    assert client.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text == "Hello <|im_end|> world"
    (model,) = client.stub.ListModels(pb.ListModelsRequest()).models
    assert model.name == "smollm2-135m" and model.context_length == smollm2_llm.max_model_len
    assert model.vocab_size == smollm2_llm.model_config.vocab_size and model.dtype == "float32"


def test_a_long_tokenize_call_leaves_the_other_calls_running(smollm2_llm, server, client, monkeypatch):
    """Tokenizing runs off the event loop: while one Tokenize call is held inside the tokenizer (as a
    text of megabytes holds it for seconds), health checks and other calls are answered."""
    inside, release = threading.Event(), threading.Event()
    encode = smollm2_llm.tokenizer.encode_prompt

    def held(text, report=None):
        if text == "held":
            inside.set()
            release.wait(60)
        return encode(text, report)

    monkeypatch.setattr(smollm2_llm.tokenizer, "encode_prompt", held)
    with ThreadPoolExecutor(1) as pool:
        tokenizing = pool.submit(client.stub.Tokenize, pb.TokenizeRequest(text="held"), timeout=120)
        try:
            assert inside.wait(30)
            assert health_status(server.target, timeout=10) == health_pb2.HealthCheckResponse.SERVING
            assert list(client.stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10).token_ids) == encode("hi")
            assert not tokenizing.done()
        finally:
            release.set()
        assert list(tokenizing.result().token_ids) == encode("held")


def test_an_adapter_source_the_os_refuses_is_invalid_argument(client):
    with pytest.raises(grpc.RpcError) as error:
        client.stub.LoadAdapter(pb.LoadAdapterRequest(name="x", source="a" * 300), timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "adapter source 'aaa" in error.value.details() and "too long" in error.value.details()


def test_reflection_lists_the_service(server):
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (response,) = list(stub.ServerReflectionInfo(iter([request])))
    names = {s.name for s in response.list_services_response.service}
    assert {"jaxinfer.v1.Inference", "grpc.health.v1.Health"} <= names


def test_committed_stubs_match_the_proto(tmp_path):
    generated = stubs.generate(tmp_path)
    committed = stubs.REPO / "serving" / "proto" / "jaxinfer" / "v1"
    for name in stubs.GENERATED:
        assert filecmp.cmp(generated / name, committed / name, shallow=False), f"{name}: run python -m serving.stubs"


def wait_until_idle(server, pool, seconds: float = 30) -> None:
    deadline = time.time() + seconds
    while (server.server.worker.num_streams or pool.num_free != pool.capacity) and time.time() < deadline:
        time.sleep(0.05)


def test_64_concurrent_streams_with_random_cancellations(smollm2_llm, server):
    prompts = [f"Give one word that rhymes with {w}." for w in ("cat", "tree", "light", "moon")] * 16
    expected = smollm2_llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    rng = random.Random(0)
    cancel = {i for i in range(64) if rng.random() < 0.25}

    def run(i: int) -> str | None:
        with InferenceClient(server.target, timeout=300) as client:
            call = client.stream(prompts[i], max_tokens=8, temperature=0.0)
            if i in cancel:
                next(call)
                call.cancel()
                return None
            return "".join(d.text for d in call)

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(run, range(64)))
    for i, text in enumerate(results):
        if i not in cancel:
            assert text == expected[i].text, i
    wait_until_idle(server, smollm2_llm.runner.pool)
    assert smollm2_llm.runner.pool.num_free == smollm2_llm.runner.pool.capacity


def test_deadline_exceeded_cancels_the_request(smollm2_llm, server):
    with InferenceClient(server.target, timeout=1.0) as client, pytest.raises(grpc.RpcError) as error:
        list(client.stream("Write a very long story.", max_tokens=400, temperature=0.0, ignore_eos=True))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until_idle(server, smollm2_llm.runner.pool)
    assert server.server.worker.num_streams == 0
    assert smollm2_llm.runner.pool.num_free == smollm2_llm.runner.pool.capacity


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def sample_value(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_prometheus_metrics_count_requests_latency_and_engine_state(server, client):
    before = scrape(server.server.metrics_port)
    for status in REQUEST_STATUSES:  # every status has its series before its first request
        sample_value(before, f'jaxinfer_requests_total{{status="{status}"}}')
    ok_before = sample_value(before, 'jaxinfer_requests_total{status="ok"}')
    compiled_before = sample_value(before, "jaxinfer_xla_compiles_while_serving_total")
    for _ in range(2):
        client.generate("Hello there", max_tokens=3, temperature=0.0, ignore_eos=True)
    with pytest.raises(grpc.RpcError):
        client.generate("", max_tokens=3)
    text = scrape(server.server.metrics_port)
    assert sample_value(text, 'jaxinfer_requests_total{status="ok"}') == ok_before + 2
    assert sample_value(text, 'jaxinfer_requests_total{status="invalid"}') >= 1
    assert sample_value(text, "jaxinfer_time_to_first_token_seconds_count") >= 2
    assert sample_value(text, "jaxinfer_inter_token_latency_seconds_count") >= 4
    assert sample_value(text, "jaxinfer_generation_tokens_total") >= 6
    assert sample_value(text, "jaxinfer_kv_pages_total") == server.server.llm.runner.pool.capacity
    assert sample_value(text, "jaxinfer_compiles_total") == server.server.llm.runner.num_compiles
    assert sample_value(text, "jaxinfer_xla_compiles_while_serving_total") == compiled_before  # nothing compiled
    for name in ("jaxinfer_queue_length", "jaxinfer_running_sequences", "jaxinfer_kv_pages_used",
                 "jaxinfer_prefix_cache_hit_rate", "jaxinfer_preemptions_total", "jaxinfer_step_seconds_mean",
                 "jaxinfer_forged_tokens_downgraded_total"):
        sample_value(text, name)


@pytest.fixture(scope="module")
def secured(smollm2_llm, server):
    tenants = (Tenant("acme", api_key="key-acme", max_concurrent=1),
               Tenant("tiny", api_key="key-tiny", max_queued_tokens=20))
    running = RunningServer(smollm2_llm, auth=True, tenants=tenants)
    running.call(running.server.load())
    yield running
    running.close()


def test_api_keys_and_tenant_limits(secured):
    def call(key: str | None, prompt: str = "Hi", **sampling):
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
        request = InferenceClient.request(prompt, **sampling)
        stub = InferenceClient(secured.target, timeout=120).stub
        return stub.Generate(request, metadata=metadata, timeout=120)

    refused = 'jaxinfer_requests_total{status="unauthenticated"}'
    before = sample_value(scrape(secured.server.metrics_port), refused)
    for key in (None, "wrong", "key-acm"):
        with pytest.raises(grpc.RpcError) as error:
            list(call(key, max_tokens=2))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert sample_value(scrape(secured.server.metrics_port), refused) == before + 3
    assert list(call("key-acme", max_tokens=2, temperature=0.0))[-1].usage.completion_tokens == 2

    first = call("key-acme", "Write a long story.", max_tokens=64, temperature=0.0, ignore_eos=True)
    next(first)  # acme now has one request in flight: its limit
    with pytest.raises(grpc.RpcError) as error:
        list(call("key-acme", max_tokens=2))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:  # counted before its prompt is even tokenized
        list(call("key-acme", "", max_tokens=2))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent" in error.value.details()
    first.cancel()

    with pytest.raises(grpc.RpcError) as error:  # prompt plus 30 tokens exceeds tiny's 20 queued tokens
        list(call("key-tiny", max_tokens=30))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_tokens" in error.value.details()
    assert list(call("key-tiny", "Hi", max_tokens=2, temperature=0.0))[-1].usage.completion_tokens == 2


def test_a_generic_reflection_client_calls_generate_without_stubs(smollm2_llm, server):
    from grpc_requests import Client  # builds its messages from the server's reflection alone

    expected = smollm2_llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0.0))[0]
    generic = Client.get_by_endpoint(server.target)
    assert "jaxinfer.v1.Inference" in generic.service_names
    replies = generic.request("jaxinfer.v1.Inference", "Generate",
                              {"text": "The capital of France is", "sampling": {"max_tokens": 6, "temperature": 0.0}})
    replies = list(replies) if not isinstance(replies, dict) else [replies]
    assert "".join(r.get("text", "") for r in replies) == expected.text
    assert replies[-1]["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")


def test_async_client_streams_the_same_text(server, client):
    async def run() -> tuple[str, int]:
        async with AsyncInferenceClient(server.target, timeout=120) as aclient:
            text, last = await aclient.generate("Name a fruit.", max_tokens=6, temperature=0.0)
            return text, last.usage.completion_tokens

    text, completion = asyncio.run(run())
    sync_text, sync_last = client.generate("Name a fruit.", max_tokens=6, temperature=0.0)
    assert (text, completion) == (sync_text, sync_last.usage.completion_tokens)


def test_tls_serves_secure_channels_only(smollm2_llm, server, tmp_path):
    cert, key, cert_pem = self_signed(tmp_path)
    running = RunningServer(smollm2_llm, tls_cert=cert, tls_key=key)
    try:
        running.call(running.server.load())
        credentials = grpc.ssl_channel_credentials(root_certificates=cert_pem)
        with grpc.secure_channel(running.target, credentials) as channel:
            stub = pb_grpc.InferenceStub(channel)
            replies = list(stub.Generate(InferenceClient.request("Hi", max_tokens=2, temperature=0.0), timeout=60))
        assert replies[-1].usage.completion_tokens == 2
        with pytest.raises(grpc.RpcError) as plain:
            InferenceClient(running.target, timeout=10).generate("Hi", max_tokens=2)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        running.close()


def test_a_request_the_engine_fails_to_add_ends_alone_with_a_status(smollm2_llm, server, monkeypatch):
    """Faults injected into the engine thread's add (a stand-in for an engine bug, and for an adapter
    unloaded between the check and the add): that call ends with INTERNAL or INVALID_ARGUMENT, a
    stream running beside it finishes, and the server keeps serving."""
    from jaxinfer.errors import RequestError

    engine = server.server.worker.engine
    real_add = engine.add_request
    faults = {"engine-bug": KeyError("a broken index"), "gone-adapter": RequestError("adapter: 'x' was unloaded")}

    def add_request(request):
        if request.request_id in faults:
            raise faults[request.request_id]
        return real_add(request)

    monkeypatch.setattr(engine, "add_request", add_request)
    expected = smollm2_llm.generate(["Tell me about rivers."], SamplingParams(max_tokens=16, temperature=0.0))[0]
    with InferenceClient(server.target, timeout=120) as client:
        survivor = client.stream("Tell me about rivers.", max_tokens=16, temperature=0.0)
        first = next(survivor)
        codes = {}
        for request_id in faults:
            message = InferenceClient.request("hi", request_id=request_id, max_tokens=4)
            with pytest.raises(grpc.RpcError) as failed:
                list(client.stub.Generate(message, timeout=60))
            codes[request_id] = (failed.value.code(), failed.value.details())
        assert first.text + "".join(d.text for d in survivor) == expected.text
        assert codes["engine-bug"][0] == grpc.StatusCode.INTERNAL
        assert "could not add the request: KeyError" in codes["engine-bug"][1]
        assert codes["gone-adapter"] == (grpc.StatusCode.INVALID_ARGUMENT, "adapter: 'x' was unloaded")
        assert client.generate("hi", max_tokens=2)[1].usage.completion_tokens == 2
    assert health_status(server.target) == health_pb2.HealthCheckResponse.SERVING
    assert server.server.worker.dead is None


def test_a_dead_engine_thread_fails_its_requests_and_reports_not_serving(smollm2_llm):
    """An unexpected error on the engine thread outside a step ends the thread: the running stream
    ends with INTERNAL (not a hang), its pages are freed, health says NOT_SERVING so traffic goes
    elsewhere, and new calls get UNAVAILABLE."""
    running = RunningServer(smollm2_llm)
    try:
        running.call(running.server.load())
        engine = running.server.worker.engine
        real_has_unfinished, armed = engine.has_unfinished, threading.Event()

        def has_unfinished():
            if armed.is_set():
                armed.clear()
                raise RuntimeError("injected fault")
            return real_has_unfinished()

        engine.has_unfinished = has_unfinished
        with InferenceClient(running.target, timeout=120) as client:
            stream = client.stream("Write a long story.", max_tokens=200, temperature=0.0)
            next(stream)
            armed.set()
            with pytest.raises(grpc.RpcError) as ended:
                list(stream)
            assert ended.value.code() == grpc.StatusCode.INTERNAL
            assert "engine thread stopped: RuntimeError: injected fault" in ended.value.details()
            deadline = time.time() + 30
            while health_status(running.target) != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.time() < deadline, "health still says SERVING"
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as refused:
                client.generate("hi", max_tokens=2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not engine.scheduler.has_unfinished()
        assert smollm2_llm.runner.pool.num_free == smollm2_llm.runner.pool.capacity
    finally:
        running.close()


def test_stopping_with_a_stream_in_flight_frees_its_pages(smollm2_llm):
    """A stream still running when the grace period ends is cancelled by gRPC; the engine thread's last
    act takes it out of the engine, so a model shared with other servers (or tests) gets its pages back."""
    running = RunningServer(smollm2_llm, grace_seconds=0.2)
    running.call(running.server.load())
    engine = running.server.worker.engine
    with InferenceClient(running.target, timeout=120) as client:
        stream = client.stream("Write a long story.", max_tokens=400, temperature=0.0)
        next(stream)
        running.close()
        with pytest.raises(grpc.RpcError):
            list(stream)
    assert not engine.scheduler.has_unfinished()
    assert smollm2_llm.runner.pool.num_free == smollm2_llm.runner.pool.capacity


def test_max_queued_bounds_the_requests_waiting_to_start(smollm2_llm):
    """`serve.max_queued` counts the requests waiting behind `max_seqs` running ones, not only those
    between two steps: with 8 running and 2 waiting, the next call gets RESOURCE_EXHAUSTED naming the
    setting; once the backlog is cancelled, calls are taken again and every page is back."""
    running = RunningServer(smollm2_llm, max_queued=2)
    try:
        running.call(running.server.load())
        engine = running.server.worker.engine
        max_seqs = engine.cfg.max_seqs
        with InferenceClient(running.target, timeout=120) as client:
            streams = [client.stream(f"Story {i}:", max_tokens=400, temperature=0.0, ignore_eos=True)
                       for i in range(max_seqs)]
            for stream in streams:
                next(stream)
            streams += [client.stream(f"Waiting {i}:", max_tokens=4) for i in range(2)]
            deadline = time.time() + 60
            while len(engine.scheduler.waiting) < 2:
                assert time.time() < deadline, "the two extra requests never reached the waiting list"
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as refused:
                client.generate("one too many", max_tokens=2)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "serve.max_queued: 2 requests are waiting to start" in refused.value.details()
            for stream in streams:
                stream.cancel()
            wait_until_idle(running, smollm2_llm.runner.pool)
            assert client.generate("taken again", max_tokens=2)[1].usage.completion_tokens == 2
    finally:
        running.close()
    assert smollm2_llm.runner.pool.num_free == smollm2_llm.runner.pool.capacity
