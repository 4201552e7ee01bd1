"""Disaggregated serving over gRPC: the prefill worker's `KVChannel.Prefill`, and the decode front's router.

Roles (`serve.role`): `both` (default) serves whole requests; `prefill` also answers
`KVChannel.Prefill` (prompt and first id; the prompt's full KV pages go to the shared KV store);
`decode` is the front clients talk to: it tokenizes a `Generate` request, sends it to one of its
`prefill_peers` (round robin), and decodes on from the stored pages (`jaxinfer.engine.disagg`).
The caller's `authorization` metadata is forwarded, so the prefill worker sees the same tenant
(the same prefix-cache salt, the same limits); both workers need the same tenants and model: the
front sends its KV store identity, and a prefill worker with another refuses (FAILED_PRECONDITION).
A peer that fails, is busy, or does not answer within `serve.prefill_timeout_seconds` is passed
over; if no peer answers, the decode worker prefills the request itself and says so in its log.
If the client's deadline passes while peers are tried, the call ends (DEADLINE_EXCEEDED) instead:
nobody waits for a local prefill any more.
`serve.prefill_tls_ca` makes the channels to the peers TLS (the forwarded API key is a secret).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from typing import TYPE_CHECKING

import grpc

from jaxinfer.engine.disagg import Handoff, handoff, prefill_request, with_seed
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.params import Request, RequestOutput, Usage
from jaxinfer.errors import JaxinferError
from serving.convert import (
    FINISH_REASONS,
    REASON_OF,
    check_request_id,
    delta_failure,
    prompt_logprobs_from_proto,
    prompt_logprobs_proto,
    sampling_params,
    sampling_proto,
    submit_refusal,
    top_logprobs_from_proto,
    top_logprobs_proto,
)
from serving.proto.jaxinfer.v1 import inference_pb2 as pb
from serving.tenants import Tenant
from serving.wire import Undecodable, lenient
from serving.worker import Delta, EngineWorker

if TYPE_CHECKING:
    from serving.service import InferenceService

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["KVChannel"].full_name
ROLES = ("both", "prefill", "decode")


async def run_to_end(worker: EngineWorker, request: Request) -> Delta:
    """Submits a request to the engine thread and waits for its last delta: the final output, or an
    error (cancelled with the caller). `submit`'s QueueFull and WorkerDead are raised as they are."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Delta] = loop.create_future()

    def deliver(delta: Delta) -> None:
        if delta.final is not None or delta.error is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(delta))

    stream = worker.submit(request, deliver)
    try:
        return await done
    finally:
        if not done.done():
            worker.cancel(stream)


class PrefillService:
    """`KVChannel.Prefill` on a prefill worker, under the Inference service's admission, tenant limits,
    drain, metrics and request log."""

    def __init__(self, service: InferenceService):
        self._service = service

    def register(self, server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(self.Prefill, request_deserializer=lenient(pb.PrefillRequest),
                                                      response_serializer=pb.PrefillResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Prefill": handler}),))

    async def Prefill(self, request: pb.PrefillRequest | Undecodable, context: grpc.aio.ServicerContext):
        service = self._service
        tenant = await service.admit_call(context, request, counted=True)
        service.active += 1  # a drain lets it finish, as a Generate call
        try:
            await service.admit_tenant(tenant, context)
            try:
                return await self._admitted(request, tenant, context)
            finally:
                service.tenants.release(tenant)
        finally:
            service.active -= 1

    async def _admitted(self, request: pb.PrefillRequest, tenant: Tenant, context: grpc.aio.ServicerContext):
        service, worker, started = self._service, self._service.worker, time.perf_counter()
        try:
            engine_req = self._engine_request(request, tenant, worker.engine)
        except (JaxinferError, ValueError) as exc:
            service.count("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except IdentityMismatch as exc:  # the servers' configuration, not the request
            service.count("error")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        cost = len(engine_req.prompt_ids) + 1  # the prompt and the first id: all a prefill worker computes
        status, delta = "error", None
        await service.charge_tenant(tenant, cost, context)
        try:
            delta = await run_to_end(worker, prefill_request(engine_req))
            status = "ok" if delta.error is None else delta_failure(delta)[0]
        except JaxinferError as exc:
            status, code = submit_refusal(exc)
            await context.abort(code, str(exc))
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            service.tenants.refund(tenant, cost)
            final = delta.final if delta is not None else None
            service.count(status, final)
            service.log_request(engine_req.request_id, tenant.name, status, final, time.perf_counter() - started)
        if delta.error is not None:
            await context.abort(delta_failure(delta)[1], delta.error)
        return self._response(engine_req, delta.final, worker.engine.max_model_len)

    @staticmethod
    def _engine_request(request: pb.PrefillRequest, tenant: Tenant, engine: Engine) -> Request:
        own = engine.kv_identity
        check_request_id(request.request_id)
        if request.kv_identity and request.kv_identity != own:
            raise IdentityMismatch(
                f"kv_identity: the caller's KV store identity {request.kv_identity} is not this prefill worker's "
                f"{own}: both workers need the same checkpoint, KV dtype and page_size")
        engine_req = Request(list(request.prompt_token_ids), sampling_params(request.sampling),
                             request.request_id, cache_salt=tenant.cache_salt, tenant=tenant.name)
        if engine_req.params.seed is None:
            raise JaxinferError("sampling.seed: a prefill request must carry the seed the decode worker uses")
        return engine_req

    @staticmethod
    def _response(engine_req: Request, out: RequestOutput, max_model_len: int) -> pb.PrefillResponse:
        done = handoff(engine_req, out, max_model_len).finish_reason
        return pb.PrefillResponse(
            token_ids=out.token_ids, logprobs=out.logprobs or [], stored_pages=out.stored_pages, text=out.text,
            top_logprobs=top_logprobs_proto(out.top_logprobs or []),
            **prompt_logprobs_proto(out.prompt_logprobs, out.prompt_top_logprobs),
            finish_reason=FINISH_REASONS[done] if done else pb.FINISH_REASON_UNSPECIFIED,
            usage=pb.Usage(prompt_tokens=out.usage.prompt_tokens, completion_tokens=out.usage.completion_tokens,
                           cached_tokens=out.usage.cached_tokens))


class IdentityMismatch(Exception):
    """The decode front's KV store identity is not the prefill worker's: its pages would never be found."""


class DeadlinePassed(Exception):
    """The caller's deadline passed while prefill peers were tried: nobody waits for the request now."""


class PrefillRouter:
    """The decode front's side of the channel: sends a request to a prefill peer, returns the hand-off.

    A peer that fails, refuses (busy, draining, another model or settings: the front has checked the
    request itself first), or does not answer within `timeout_seconds`, is passed over for the next;
    when none answers, the front prefills the request itself.
    """

    def __init__(self, peers: tuple[str, ...], timeout_seconds: float = 60.0, tls_ca: bytes | None = None):
        """`tls_ca`: PEM root certificates for TLS to the peers (None: plaintext)."""
        self.peers, self.timeout_seconds = peers, timeout_seconds
        credentials = grpc.ssl_channel_credentials(root_certificates=tls_ca) if tls_ca is not None else None
        self._channels = [grpc.aio.secure_channel(peer, credentials) if credentials else grpc.aio.insecure_channel(peer)
                          for peer in peers]
        self._next = itertools.cycle(range(len(peers)))
        self.remote = self.local = 0

    async def prefill(self, request: Request, metadata: tuple, timeout: float | None,
                      kv_identity: str = "") -> Handoff | None:
        """The hand-off from a peer (the request's seed fixed first), or None when no peer answered.
        `timeout`: the caller's time left (None: no deadline); DeadlinePassed once it has run out."""
        request = with_seed(request)
        message = pb.PrefillRequest(prompt_token_ids=request.prompt_ids, sampling=sampling_proto(request.params),
                                    request_id=request.request_id, kv_identity=kv_identity)
        forwarded = tuple((k, v) for k, v in metadata if k == "authorization")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        passed = DeadlinePassed("the client's deadline passed while prefill peers were tried")
        for _ in self.peers:
            peer = next(self._next)
            client_left = math.inf if deadline is None else deadline - loop.time()
            if client_left <= 0:
                raise passed
            left = min(self.timeout_seconds, client_left)
            call = self._channels[peer].unary_unary(f"/{SERVICE}/Prefill",
                                                    request_serializer=pb.PrefillRequest.SerializeToString,
                                                    response_deserializer=pb.PrefillResponse.FromString)
            try:
                reply = await call(message, metadata=forwarded, timeout=left)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and client_left <= self.timeout_seconds:
                    raise passed from None  # the client's deadline, not the peer's own timeout
                log.warning("prefill peer %s: %s: %s", self.peers[peer], exc.code().name, exc.details())
                continue
            self.remote += 1
            done = REASON_OF.get(reply.finish_reason)
            return Handoff(request, list(reply.token_ids), list(reply.logprobs) or [0.0] * len(reply.token_ids),
                           reply.stored_pages, done, reply.text, reply.usage.cached_tokens,
                           top_logprobs_from_proto(reply.top_logprobs),
                           *prompt_logprobs_from_proto(reply, request.params.prompt_logprobs,
                                                       len(request.prompt_ids)))
        if deadline is not None and loop.time() >= deadline:
            raise passed
        self.local += 1
        log.warning("no prefill peer answered; prefilling request %s here", request.request_id)
        return None

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def finished_output(handoff: Handoff) -> RequestOutput:
    """The final output of a request that ended on the prefill worker."""
    request = handoff.request
    return RequestOutput(index=-1, prompt_token_ids=request.prompt_ids, text=handoff.text,
                         token_ids=handoff.generated_ids, finish_reason=handoff.finish_reason,
                         usage=Usage(len(request.prompt_ids), len(handoff.generated_ids), handoff.cached_tokens),
                         logprobs=handoff.generated_logprobs if request.params.logprobs else None,
                         top_logprobs=(list(handoff.generated_top_logprobs) or [[] for _ in handoff.generated_ids]
                                       if request.params.top_logprobs else None),
                         prompt_logprobs=handoff.prompt_logprobs, prompt_top_logprobs=handoff.prompt_top_logprobs,
                         request_id=request.request_id, forged_tokens=request.forged_tokens)

