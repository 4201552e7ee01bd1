"""The `jaxinfer.v1.Inference` servicer: proto messages in, engine requests through the worker, deltas out."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid

import grpc
import numpy as np

from jaxinfer.engine.adapters import AdapterInfo, read_adapter_source
from jaxinfer.engine.disagg import decode_request, settled
from jaxinfer.engine.params import Request, RequestOutput
from jaxinfer.errors import CheckpointError, ConfigError, JaxinferError, RequestError
from jaxinfer.llm import LLM
from jaxinfer.tokenizer.tokenizer import GuardReport
from serving.convert import (
    FINISH_REASONS,
    check_request_id,
    delta_failure,
    prompt_logprobs_proto,
    sampling_params,
    submit_refusal,
    top_logprobs_proto,
)
from serving.disagg import DeadlinePassed, PrefillRouter, finished_output
from serving.metrics import ServerMetrics
from serving.proto.jaxinfer.v1 import inference_pb2 as pb
from serving.proto.jaxinfer.v1 import inference_pb2_grpc as pb_grpc  # the servicer base class
from serving.tenants import LimitExceeded, Tenant, TenantBook
from serving.wire import Undecodable, lenient
from serving.worker import Delta, EngineWorker, WorkerDead

log = logging.getLogger("jaxinfer.requests")

def chat_messages(chat: pb.Messages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def engine_request(llm: LLM, message: pb.GenerateRequest, request_id: str) -> Request:
    params = sampling_params(message.sampling)
    kind = message.WhichOneof("prompt")
    if kind == "text":
        return llm.request(message.text, params, request_id)
    if kind == "chat":
        chat = chat_messages(message.chat)
        if not chat:
            raise RequestError("chat.messages: must not be empty")
        return llm.chat_request(chat, params, request_id)
    if kind == "token_ids":
        if not message.token_ids.ids:
            raise RequestError("token_ids.ids: must not be empty")
        return llm.request(list(message.token_ids.ids), params, request_id)
    if kind == "parts":
        parts = [p.text if p.WhichOneof("part") == "text" else {"special": p.special} for p in message.parts.parts]
        if not parts:
            raise RequestError("parts: must not be empty")
        return llm.request(parts, params, request_id)
    raise RequestError("prompt: one of text, chat, token_ids or parts is required")


class InferenceService(pb_grpc.InferenceServicer):
    """Answers UNAVAILABLE until `attach` (the model is loaded and warm) and again once draining."""

    def __init__(self, model_name: str, tenants: TenantBook, metrics: ServerMetrics | None = None):
        self.model_name, self.tenants, self.metrics = model_name, tenants, metrics
        self.llm: LLM | None = None
        self.worker: EngineWorker | None = None
        self.draining = False
        self.active = 0  # Generate calls admitted and not yet ended
        self.not_ready = "the model is still loading"  # why calls are refused before SERVING (or a failed self-test)
        self.router: PrefillRouter | None = None  # set on a decode worker: prompts go to prefill peers

    def attach(self, llm: LLM, worker: EngineWorker) -> None:
        self.llm, self.worker = llm, worker

    def register(self, server: grpc.aio.Server) -> None:
        """Adds the service with deserializers that turn an undecodable request into INVALID_ARGUMENT."""
        methods = {
            "Generate": (grpc.unary_stream_rpc_method_handler, self.Generate, pb.GenerateRequest, pb.GenerateResponse),
            "Tokenize": (grpc.unary_unary_rpc_method_handler, self.Tokenize, pb.TokenizeRequest, pb.TokenizeResponse),
            "Detokenize": (grpc.unary_unary_rpc_method_handler, self.Detokenize, pb.DetokenizeRequest,
                           pb.DetokenizeResponse),
            "ListModels": (grpc.unary_unary_rpc_method_handler, self.ListModels, pb.ListModelsRequest,
                           pb.ListModelsResponse),
            "LoadAdapter": (grpc.unary_unary_rpc_method_handler, self.LoadAdapter, pb.LoadAdapterRequest,
                            pb.AdapterInfo),
            "UnloadAdapter": (grpc.unary_unary_rpc_method_handler, self.UnloadAdapter, pb.UnloadAdapterRequest,
                              pb.UnloadAdapterResponse),
            "ListAdapters": (grpc.unary_unary_rpc_method_handler, self.ListAdapters, pb.ListAdaptersRequest,
                             pb.ListAdaptersResponse),
        }
        handlers = {
            name: make(method, request_deserializer=lenient(request), response_serializer=response.SerializeToString)
            for name, (make, method, request, response) in methods.items()
        }
        service = pb.DESCRIPTOR.services_by_name["Inference"].full_name
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))

    async def admit_call(self, context: grpc.aio.ServicerContext, request: object = None, counted: bool = False
                         ) -> Tenant:
        """The caller's tenant, or the call ends: INVALID_ARGUMENT for an undecodable request,
        UNAUTHENTICATED, or UNAVAILABLE while loading or draining (`counted`: in jaxinfer_requests_total)."""
        refusal = None
        tenant = self.tenants.identify(context.invocation_metadata())
        if isinstance(request, Undecodable):
            refusal = "invalid", grpc.StatusCode.INVALID_ARGUMENT, request.error
        elif tenant is None:
            refusal = ("unauthenticated", grpc.StatusCode.UNAUTHENTICATED,
                       "authorization: a valid 'Bearer <api key>' is required")
        elif self.draining:
            refusal = "unavailable", grpc.StatusCode.UNAVAILABLE, "the server is shutting down"
        elif self.worker is None:
            refusal = "unavailable", grpc.StatusCode.UNAVAILABLE, self.not_ready
        if refusal is not None:
            status, code, message = refusal
            if counted:
                self.count(status)
            await context.abort(code, message)
        return tenant

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        tenant = await self.admit_call(context, request, counted=True)
        self.active += 1  # counted from admission, so a drain waits for requests still being tokenized
        try:
            await self.admit_tenant(tenant, context)  # max_concurrent: before the prompt costs any work
            try:
                async with contextlib.aclosing(self._admitted(request, tenant, context)) as responses:
                    async for response in responses:
                        yield response
            finally:
                self.tenants.release(tenant)
        finally:
            self.active -= 1

    async def admit_tenant(self, tenant: Tenant, context: grpc.aio.ServicerContext) -> None:
        """Counts a call against the tenant's max_concurrent, or ends it with RESOURCE_EXHAUSTED."""
        try:
            self.tenants.admit(tenant)
        except LimitExceeded as exc:
            self.count("limited")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    async def charge_tenant(self, tenant: Tenant, tokens: int, context: grpc.aio.ServicerContext) -> None:
        """Adds an admitted call's tokens to the tenant's max_queued_tokens, or ends it (RESOURCE_EXHAUSTED)."""
        try:
            self.tenants.charge(tenant, tokens)
        except LimitExceeded as exc:
            self.count("limited")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    async def _admitted(self, request: pb.GenerateRequest, tenant: Tenant, context: grpc.aio.ServicerContext):
        request_id = request.request_id or uuid.uuid4().hex
        started = time.perf_counter()
        try:
            check_request_id(request_id)
            engine_req = await asyncio.to_thread(engine_request, self.llm, request, request_id)
        except (RequestError, ValueError) as exc:
            self.count("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        engine_req = dataclasses.replace(engine_req, cache_salt=tenant.cache_salt, tenant=tenant.name,
                                         adapter=request.adapter)
        cost = len(engine_req.prompt_ids) + engine_req.params.max_tokens
        await self.charge_tenant(tenant, cost, context)
        try:
            if self.router is not None and not self.llm.engine.adapter_name(engine_req):  # peers: base model only
                try:
                    engine_req, done = await self._prefill_on_peer(engine_req, context)
                except DeadlinePassed as exc:  # the client has gone: no local prefill to cancel at once
                    self.count("cancelled")
                    self.log_request(request_id, tenant.name, "cancelled", None, time.perf_counter() - started)
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
                if done is not None:
                    self.count("ok", done.final)
                    yield self._response(engine_req.request_id, engine_req, done)
                    return
            # aclosing: a cancelled call cancels the engine request now, not when garbage-collected
            async with contextlib.aclosing(self._stream(engine_req, tenant, context, started)) as responses:
                async for response in responses:
                    yield response
        finally:
            self.tenants.refund(tenant, cost)

    async def _stream(self, engine_req: Request, tenant: Tenant, context: grpc.aio.ServicerContext, started: float):
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[Delta] = asyncio.Queue()

        def deliver(delta: Delta) -> None:  # on the worker thread; a closed loop means nobody listens
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deltas.put_nowait, delta)

        try:
            stream = self.worker.submit(engine_req, deliver)
        except JaxinferError as exc:
            status, code = submit_refusal(exc)
            self.count(status)
            await context.abort(code, str(exc))
        status, final, last = "cancelled", None, None
        try:
            while True:
                delta = await deltas.get()
                if delta.error is not None:
                    status, code = delta_failure(delta)
                    await context.abort(code, delta.error)
                last = self.observe_latency(delta, started, last)
                yield self._response(engine_req.request_id, engine_req, delta)
                if delta.final is not None:
                    status, final = "ok", delta.final
                    return
        finally:
            if final is None:
                self.worker.cancel(stream)  # client cancel, deadline or disconnect: free the pages
            self.count(status, final)
            self.log_request(engine_req.request_id, tenant.name, status, final, time.perf_counter() - started)

    async def _prefill_on_peer(self, engine_req: Request, context: grpc.aio.ServicerContext
                               ) -> tuple[Request, Delta | None]:
        """Has a prefill peer compute the prompt; returns the request to decode here, or the final delta
        when the request ended on the peer. The request is checked here first, so a peer that refuses
        it differs from this worker (a misconfiguration) and is passed over like a failed one."""
        try:
            self.worker.engine.validate(engine_req)
        except JaxinferError as exc:
            self.count("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        passed = await self.router.prefill(engine_req, context.invocation_metadata(), context.time_remaining(),
                                           self.worker.engine.kv_identity)
        if passed is None:
            return engine_req, None
        passed = settled(passed, self.llm.max_model_len)
        if passed.finish_reason is not None:
            out = finished_output(passed)
            return passed.request, Delta(out.text, out.token_ids, out.logprobs or [], final=out,
                                         top_logprobs=out.top_logprobs or [], prompt_logprobs=out.prompt_logprobs,
                                         prompt_top_logprobs=out.prompt_top_logprobs)
        return decode_request(passed), None

    def observe_latency(self, delta: Delta, started: float, last: float | None) -> float | None:
        if self.metrics is None or not delta.token_ids:
            return last
        now = time.perf_counter()
        if last is None:
            self.metrics.ttft.observe(now - started)
        else:
            self.metrics.itl.observe((now - last) / len(delta.token_ids))
        self.metrics.generation_tokens.inc(len(delta.token_ids))
        return now

    def count(self, status: str, final: RequestOutput | None = None) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(status=status).inc()
            if final is not None:
                self.metrics.prompt_tokens.inc(final.usage.prompt_tokens)

    @staticmethod
    def _response(request_id: str, engine_req: Request, delta: Delta) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=request_id, text=delta.text, token_ids=delta.token_ids,
                                       logprobs=delta.logprobs, forged_tokens=engine_req.forged_tokens,
                                       top_logprobs=top_logprobs_proto(delta.top_logprobs),
                                       **prompt_logprobs_proto(delta.prompt_logprobs, delta.prompt_top_logprobs))
        if delta.final is not None:
            out = delta.final
            response.finish_reason = FINISH_REASONS[out.finish_reason]
            response.usage.CopyFrom(pb.Usage(prompt_tokens=out.usage.prompt_tokens,
                                             completion_tokens=out.usage.completion_tokens,
                                             cached_tokens=out.usage.cached_tokens))
        return response

    @staticmethod
    def log_request(request_id: str, tenant: str, status: str, final: RequestOutput | None, seconds: float) -> None:
        usage = final.usage if final is not None else None
        log.info(json.dumps({
            "request_id": request_id, "tenant": tenant, "status": status, "latency_s": round(seconds, 4),
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "finish_reason": final.finish_reason if final else None}))

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        await self.admit_call(context, request)
        report = GuardReport()
        tokenizer = self.llm.tokenizer

        def encode() -> list[int]:
            if request.WhichOneof("input") == "chat":
                return tokenizer.encode_chat(chat_messages(request.chat), report=report)
            return tokenizer.encode_prompt(request.text, report)

        try:  # off the event loop: a long text would hold every other call
            ids = await asyncio.to_thread(encode)
        except (RequestError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(token_ids=ids, forged_tokens=report.downgraded)

    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext):
        await self.admit_call(context, request)
        vocab = self.llm.model_config.vocab_size
        bad = next((t for t in request.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            message = f"token_ids: {bad} is outside the vocabulary [0, {vocab})"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        text = await asyncio.to_thread(self.llm.tokenizer.decode, list(request.token_ids),
                                       skip_special_tokens=request.skip_special_tokens)
        return pb.DetokenizeResponse(text=text)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        await self.admit_call(context, request)
        info = pb.ModelInfo(name=self.model_name, context_length=self.llm.max_model_len,
                            dtype=np.dtype(self.llm.dtype).name, vocab_size=self.llm.model_config.vocab_size)
        for axis, size in self.llm.mesh.shape.items():
            info.mesh[axis] = size
        return pb.ListModelsResponse(models=[info])

    # -- LoRA adapters: applied on the engine thread, between steps ---------------------------------
    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext) -> pb.AdapterInfo:
        await self._admit_admin(context, request)
        try:  # reading and hashing the files happens here; the engine thread only fills the slot
            read = await asyncio.to_thread(read_adapter_source, request.source or request.name)
        except CheckpointError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        info = await self._on_engine(context, lambda engine: engine.load_adapter(request.name, request.source, read))
        return adapter_info(info)

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext):
        await self._admit_admin(context, request)
        await self._on_engine(context, lambda engine: engine.unload_adapter(request.name))
        return pb.UnloadAdapterResponse()

    async def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext):
        await self.admit_call(context, request)
        adapters = await self._on_engine(context, lambda engine: engine.list_adapters())
        return pb.ListAdaptersResponse(adapters=[adapter_info(info) for info in adapters])

    async def _admit_admin(self, context: grpc.aio.ServicerContext, request: object) -> None:
        tenant = await self.admit_call(context, request)
        if not tenant.admin:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"tenant {tenant.name!r}: loading and unloading adapters needs an admin tenant")

    async def _on_engine(self, context: grpc.aio.ServicerContext, fn):
        """`fn(engine)` on the engine thread; a refused request or adapter is INVALID_ARGUMENT."""
        try:
            return await asyncio.wrap_future(self.worker.call(fn))
        except WorkerDead as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except (RequestError, CheckpointError, ConfigError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def adapter_info(info: AdapterInfo) -> pb.AdapterInfo:
    return pb.AdapterInfo(name=info.name, path=info.path, slot=info.slot, rank=info.rank, digest=info.digest,
                          users=info.users)
