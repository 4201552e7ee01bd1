"""Clients for `jaxinfer.v1.Inference`: `InferenceClient` (sync), `AsyncInferenceClient`, and
`python -m serving.client "prompt"` (streams to the terminal)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from serving.proto.jaxinfer.v1 import inference_pb2 as pb
from serving.proto.jaxinfer.v1 import inference_pb2_grpc as pb_grpc

Prompt = str | list[int] | list[dict[str, str]]  # text, token ids, or chat messages


class InferenceClient:
    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None, api_key: str = ""):
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, prompt: Prompt, adapter: str = "", **sampling: Any) -> Iterator[pb.GenerateResponse]:
        """Streams deltas for a text prompt, token ids, or chat messages ([{"role", "content"}])."""
        return self.stub.Generate(self.request(prompt, adapter=adapter, **sampling), timeout=self.timeout,
                                  metadata=self.metadata)

    def generate(self, prompt: Prompt, adapter: str = "", **sampling: Any) -> tuple[str, pb.GenerateResponse]:
        """The whole text, and the last message (finish reason, usage)."""
        text, last = [], None
        for last in self.stream(prompt, adapter, **sampling):
            text.append(last.text)
        return "".join(text), last

    @staticmethod
    def request(prompt: Prompt, request_id: str = "", adapter: str = "", **sampling: Any):
        common = dict(sampling=pb.SamplingParams(**sampling), request_id=request_id, adapter=adapter)
        if isinstance(prompt, str):
            return pb.GenerateRequest(text=prompt, **common)
        if prompt and all(isinstance(m, dict) for m in prompt):
            chat = pb.Messages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt])
            return pb.GenerateRequest(chat=chat, **common)
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), **common)


class AsyncInferenceClient:
    """The asyncio counterpart of `InferenceClient` (grpc.aio); use it inside a running event loop."""

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None, api_key: str = ""):
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncInferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def stream(self, prompt: Prompt, adapter: str = "", **sampling: Any) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(InferenceClient.request(prompt, adapter=adapter, **sampling), timeout=self.timeout,
                                  metadata=self.metadata)
        try:
            async for response in call:
                yield response
        finally:  # a caller that stops reading early must not leave the server generating
            call.cancel()

    async def generate(self, prompt: Prompt, adapter: str = "", **sampling: Any) -> tuple[str, pb.GenerateResponse]:
        text, last = [], None
        async for last in self.stream(prompt, adapter, **sampling):
            text.append(last.text)
        return "".join(text), last


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m serving.client", description="Stream a completion to the terminal.")
    p.add_argument("prompt")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user message")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key", default="", help="sent as `authorization: Bearer KEY`")
    args = p.parse_args()
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    with InferenceClient(args.target, api_key=args.api_key) as client:
        try:
            for delta in client.stream(prompt, max_tokens=args.max_tokens, temperature=args.temperature):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                if delta.finish_reason:
                    u = delta.usage
                    print(f"\n[{pb.FinishReason.Name(delta.finish_reason)}; prompt {u.prompt_tokens}, "
                          f"completion {u.completion_tokens}, cached {u.cached_tokens}]", file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
