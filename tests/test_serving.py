"""The gRPC server on 127.0.0.1: streaming equals LLM.generate, bad input, cancellation, health, reflection, stubs."""

from __future__ import annotations

import asyncio
import filecmp
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from jaxinfer import SamplingParams
from serving import stubs
from serving.client import InferenceClient
from serving.proto.jaxinfer.v1 import inference_pb2 as pb
from serving.server import SERVICE_NAME, InferenceServer, ServeConfig

pytestmark = pytest.mark.slow


class RunningServer:
    """A real server on a free loopback port, its asyncio loop in a background thread."""

    def __init__(self, llm):
        self.loop = asyncio.new_event_loop()
        self.server = InferenceServer(ServeConfig(port=0), llm=llm)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = self.call(self.server.start())
        self.target = f"127.0.0.1:{self.port}"

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=120)

    def close(self):
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


def health_status(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status


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
        (dict(token_ids=pb.TokenIds(ids=[1, 10**9])), "prompt_token_ids"),
        (dict(parts=pb.PromptParts(parts=[pb.PromptPart(special="<|nope|>")])), "nope"),
        (dict(text="word " * 9000), "prompt"),
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
