"""The OpenAI-compatible HTTP API as a Starlette app over the gRPC service's engine worker, tenants and metrics.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events when
`stream` is true, ending with `data: [DONE]`), GET /v1/models, POST /tokenize and /detokenize and
GET /tokenizer_info (vLLM's shapes, which lm-eval's remote tokenizer uses), GET /health (503 while
loading or draining) and GET /metrics (the gRPC server's Prometheus registry). Errors have OpenAI's
shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status that says who erred.
Authentication is the gRPC server's: `Authorization: Bearer <api key>` of a configured tenant.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxinfer.engine.params import Request
from jaxinfer.errors import RequestError
from serving.convert import check_request_id
from serving.openai_completions import CompletionAssembler
from serving.openai_format import error_body, token_text
from serving.openai_generate import CallFailed, GenerationCall, fan_out
from serving.openai_schema import (
    BodyError,
    ChatCompletionBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    read_body,
)
from serving.service import InferenceService
from serving.tenants import LimitExceeded, Tenant

FIELD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)")  # a RequestError's message starts with the field it names


class OpenAIFrontEnd:
    """The routes; every handler turns CallFailed (and a bad body) into an OpenAI error response."""

    def __init__(self, service: InferenceService):
        self.service = service
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self._guarded(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", self._guarded(self.completions), methods=["POST"]),
            Route("/v1/models", self._guarded(self.models), methods=["GET"]),
            Route("/tokenize", self._guarded(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._guarded(self.detokenize), methods=["POST"]),
            Route("/tokenizer_info", self._guarded(self.tokenizer_info), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ])

    def _guarded(self, handler: Callable[[HttpRequest], Any]) -> Callable[[HttpRequest], Any]:
        async def guarded(request: HttpRequest) -> Response:
            try:
                return await handler(request)
            except CallFailed as exc:
                return failure(exc)
            except RequestError as exc:  # BodyError knows its field; a RequestError's message starts with it
                param = exc.param if isinstance(exc, BodyError) else field_of(str(exc))
                if param in ("prompt", "prompt_token_ids"):  # the engine's name for what the body sent
                    param = "messages" if request.url.path.endswith("chat/completions") else "prompt"
                message = str(exc)
                if param == "guided":  # the body's own field: response_format, guided or vLLM's guided_*
                    param = getattr(request.state, "guided_field", None) or param
                    message = message if param == "guided" else f"{param}: {message}"
                if request.url.path.endswith("completions"):  # generation calls, as gRPC counts Generate's
                    self.service.count("invalid")
                return failure(CallFailed(400, message, param))
        return guarded

    # -- admission ----------------------------------------------------------------------------
    def admit(self, request: HttpRequest) -> Tenant:
        """The caller's tenant, or CallFailed: 401 for a missing or unknown key, 503 while loading or draining."""
        tenant = self.service.tenants.identify((("authorization", request.headers.get("authorization", "")),))
        if tenant is None:
            self.service.count("unauthenticated")
            raise CallFailed(401, "authorization: a valid 'Bearer <api key>' is required", code="invalid_api_key")
        unavailable = self.unavailable()
        if unavailable is not None:
            self.service.count("unavailable")
            raise CallFailed(503, unavailable)
        return tenant

    def unavailable(self) -> str | None:
        if self.service.draining:
            return "the server is shutting down"
        if self.service.worker is None:
            return self.service.not_ready
        if self.service.worker.dead is not None:
            return f"the engine stopped: {self.service.worker.dead}"
        return None

    def adapter_for(self, model: str) -> str:
        """The adapter a body's `model` names: "" for the served model (or no name), 404 for an unknown one."""
        if model in ("", self.service.model_name):
            return ""
        loaded = [info.name for info in self.service.worker.engine.list_adapters()]
        if model in loaded:
            return model
        served = ", ".join([self.service.model_name, *loaded])
        raise CallFailed(404, f"model: {model!r} is not served here; models: {served}", "model", "model_not_found")

    # -- generation ---------------------------------------------------------------------------
    async def chat_completions(self, request: HttpRequest) -> Response:
        tenant = self.admit(request)
        body: ChatCompletionBody = read_body(ChatCompletionBody, await json_body(request))
        request.state.guided_field = body.guided_field
        params = body.sampling_params(default_max_tokens=1)
        messages = body.template_messages()

        def encode() -> list[Request]:
            request = self.service.llm.chat_request(messages, params)
            if body.token_limit is None:  # as vLLM: what the context (and the KV pool) leaves after the prompt
                request.params = dataclasses.replace(params, max_tokens=self.room_after(len(request.prompt_ids)))
            return [request]

        return await self._generate(request, tenant, body, encode, CompletionAssembler.chat(self.service, body))

    async def completions(self, request: HttpRequest) -> Response:
        tenant = self.admit(request)
        body: CompletionBody = read_body(CompletionBody, await json_body(request))
        request.state.guided_field = body.guided_field
        params = body.sampling_params()
        prompts = body.prompts()

        def encode() -> list[Request]:
            return [self.service.llm.request(prompt, params) for prompt in prompts]

        assembler = CompletionAssembler.text(self.service, body, prompts)
        return await self._generate(request, tenant, body, encode, assembler)

    def room_after(self, prompt_tokens: int) -> int:
        """The most tokens a prompt of this length can be followed by: the context's and the pool's limit."""
        llm = self.service.llm
        pool_tokens = (llm.config.num_pages - 1) * llm.config.page_size
        return max(1, min(llm.max_model_len, pool_tokens) - prompt_tokens)

    async def _generate(self, request: HttpRequest, tenant: Tenant, body, encode: Callable[[], list[Request]],
                        assembler: CompletionAssembler) -> Response:
        adapter = self.adapter_for(body.model)
        call_id = body.request_id or f"{assembler.id_prefix}-{uuid.uuid4().hex}"
        check_request_id(call_id)
        self.service.active += 1  # from admission: a drain waits for calls still being tokenized
        try:
            self._admit_tenant(tenant)
        except BaseException:
            self.service.active -= 1
            raise
        release = Release(self.service, tenant)
        try:
            prompts = await asyncio.to_thread(encode)
            requests = fan_out(prompts, body.n, tenant, adapter, call_id)
            longest = self.service.llm.max_model_len
            release.charge(sum(min(len(r.prompt_ids) + r.params.max_tokens, longest) for r in requests))
            call = GenerationCall(self.service, tenant, requests, lambda: wait_for_disconnect(request))
            call.submit()
        except BaseException:
            release()
            raise
        assembler.start(call_id, call)
        if not body.stream:
            try:
                return JSONResponse(await assembler.collect())
            finally:
                release()
        return ClosingStream(sse(assembler.stream()), on_close=lambda: (call.finish(), release()))

    def _admit_tenant(self, tenant: Tenant) -> None:
        try:
            self.service.tenants.admit(tenant)
        except LimitExceeded as exc:
            self.service.count("limited")
            raise CallFailed(429, str(exc), code="rate_limit_exceeded") from None

    # -- models, tokens, health, metrics -----------------------------------------------------------
    async def models(self, request: HttpRequest) -> Response:
        self.admit(request)
        created = int(time.time())
        base = {"id": self.service.model_name, "object": "model", "created": created, "owned_by": "jaxinfer",
                "root": self.service.model_name, "parent": None, "max_model_len": self.service.llm.max_model_len}
        adapters = [{**base, "id": info.name, "root": info.path, "parent": self.service.model_name}
                    for info in self.service.worker.engine.list_adapters()]
        return JSONResponse({"object": "list", "data": [base, *adapters]})

    async def tokenize(self, request: HttpRequest) -> Response:
        self.admit(request)
        body: TokenizeBody = read_body(TokenizeBody, await json_body(request))
        tokenizer = self.service.llm.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise BodyError("prompt or messages: give exactly one of them", "prompt")

        def encode() -> list[int]:
            if body.messages is not None:
                messages = [message.as_template_message() for message in body.messages]
                return tokenizer.encode_chat(messages, body.add_generation_prompt)
            if body.add_special_tokens:
                return tokenizer.encode_prompt(body.prompt)
            return tokenizer.encode_user(body.prompt, field="prompt")

        tokens = await asyncio.to_thread(encode)  # off the event loop: a long text would hold every other call
        answer: dict[str, Any] = {"count": len(tokens), "max_model_len": self.service.llm.max_model_len,
                                  "tokens": tokens}
        if body.return_token_strs:
            answer["token_strs"] = [token_text(tokenizer, token) for token in tokens]
        return JSONResponse(answer)

    async def detokenize(self, request: HttpRequest) -> Response:
        self.admit(request)
        body: DetokenizeBody = read_body(DetokenizeBody, await json_body(request))
        vocab = self.service.llm.model_config.vocab_size
        bad = next((i for i, token in enumerate(body.tokens) if not 0 <= token < vocab), None)
        if bad is not None:
            raise BodyError(f"tokens[{bad}]: {body.tokens[bad]} is outside the vocabulary [0, {vocab})", "tokens")
        text = await asyncio.to_thread(self.service.llm.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    async def tokenizer_info(self, request: HttpRequest) -> Response:
        self.admit(request)
        tokenizer = self.service.llm.tokenizer
        template = tokenizer.chat_template.source if tokenizer.chat_template else None
        return JSONResponse({"tokenizer_class": "jaxinfer", "eos_token": tokenizer.primary_eos,
                             "bos_token": tokenizer.bos_token, "pad_token": None, "chat_template": template,
                             "model_max_length": self.service.llm.max_model_len,
                             "vocab_size": self.service.llm.model_config.vocab_size})

    async def health(self, request: HttpRequest) -> Response:
        unavailable = self.unavailable()
        if unavailable is not None:
            return JSONResponse(error_body(503, unavailable), status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: HttpRequest) -> Response:
        registry = self.service.metrics.registry
        return Response(await asyncio.to_thread(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)


class ClosingStream(StreamingResponse):
    """A server-sent event stream that runs `on_close` however the response ends, even when the client
    was gone before the stream's generator started (its own `finally` would then never run)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], object]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Release:
    """Gives back a call's tenant admission and token charge exactly once, and ends its `active` count."""

    def __init__(self, service: InferenceService, tenant: Tenant):
        self.service, self.tenant, self.charged, self.done = service, tenant, 0, False

    def charge(self, tokens: int) -> None:
        try:
            self.service.tenants.charge(self.tenant, tokens)
        except LimitExceeded as exc:
            self.service.count("limited")
            raise CallFailed(429, str(exc), code="rate_limit_exceeded") from None
        self.charged = tokens

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        if self.charged:
            self.service.tenants.refund(self.tenant, self.charged)
        self.service.tenants.release(self.tenant)
        self.service.active -= 1


async def sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per chunk, an error as its own event, then `data: [DONE]`.
    What the call holds is given back by `ClosingStream`, however the response ends."""
    try:
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
    except CallFailed as exc:
        yield f"data: {json.dumps(error_body(exc.status, exc.message, exc.param, exc.code))}\n\n"
    yield "data: [DONE]\n\n"


async def json_body(request: HttpRequest) -> object:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BodyError(f"body: not valid JSON ({exc})") from None


async def wait_for_disconnect(request: HttpRequest) -> None:
    """Returns once the client has closed the connection (the ASGI server says http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def field_of(message: str) -> str | None:
    """The field a RequestError names: "logit_bias['x']: must be ..." -> logit_bias."""
    head, colon, _ = message.partition(":")
    match = FIELD.match(head)
    return match.group(1) if colon and match and " " not in head else None


def failure(exc: CallFailed) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status)
