"""Disaggregated serving over gRPC: the prefill worker's `KVChannel.Prefill`, and the decode front's router.

Roles (`serve.role`): `both` (default) serves whole requests; `prefill` also answers
`KVChannel.Prefill` (prompt and first id; the prompt's full KV pages go to the shared KV store);
`decode` is the front clients talk to: it tokenizes a `Generate` request, sends it to one of its
`prefill_peers` (round robin), and decodes on from the stored pages (`jaxinfer.engine.disagg`).
The caller's `authorization` metadata is forwarded, so the prefill worker sees the same tenant
(the same prefix-cache salt, the same limits); both workers need the same tenants and model. If
no peer answers, the decode worker prefills the request itself and says so in its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable

import grpc

from jaxinfer.engine.disagg import Handoff, handoff, prefill_request, with_seed
from jaxinfer.engine.params import Request, RequestOutput, Usage
from jaxinfer.errors import JaxinferError
from serving.convert import FINISH_REASONS, REASON_OF, sampling_params, sampling_proto
from serving.proto.jaxinfer.v1 import inference_pb2 as pb
from serving.wire import Undecodable, lenient
from serving.worker import Delta, EngineWorker

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["KVChannel"].full_name
ROLES = ("both", "prefill", "decode")


async def run_to_end(worker: EngineWorker, request: Request) -> RequestOutput:
    """Submits a request to the engine thread and waits for its final output (cancelled with the caller)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Delta] = loop.create_future()

    def deliver(delta: Delta) -> None:
        if delta.final is not None or delta.error is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(delta))

    stream = worker.submit(request, deliver)
    try:
        delta = await done
    finally:
        if not done.done():
            worker.cancel(stream)
    if delta.error is not None:
        raise JaxinferError(delta.error)
    return delta.final


class PrefillService:
    """`KVChannel.Prefill` on a prefill worker; `admit` is the Inference service's tenant and state check."""

    def __init__(self, admit: Callable[..., Awaitable], state: Callable[[], EngineWorker | None]):
        self._admit, self._worker = admit, state

    def register(self, server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(self.Prefill, request_deserializer=lenient(pb.PrefillRequest),
                                                      response_serializer=pb.PrefillResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Prefill": handler}),))

    async def Prefill(self, request: pb.PrefillRequest | Undecodable, context: grpc.aio.ServicerContext):
        tenant = await self._admit(context, request)
        try:
            engine_req = Request(list(request.prompt_token_ids), sampling_params(request.sampling),
                                 request.request_id, cache_salt=tenant.cache_salt)
            if engine_req.params.seed is None:
                raise JaxinferError("sampling.seed: a prefill request must carry the seed the decode worker uses")
            out = await run_to_end(self._worker(), prefill_request(engine_req))
        except (JaxinferError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        done = handoff(engine_req, out).finish_reason
        return pb.PrefillResponse(
            token_ids=out.token_ids, logprobs=out.logprobs or [], stored_pages=out.stored_pages, text=out.text,
            finish_reason=FINISH_REASONS[done] if done else pb.FINISH_REASON_UNSPECIFIED,
            usage=pb.Usage(prompt_tokens=out.usage.prompt_tokens, completion_tokens=out.usage.completion_tokens,
                           cached_tokens=out.usage.cached_tokens))


class PrefillRouter:
    """The decode front's side of the channel: sends a request to a prefill peer, returns the hand-off."""

    def __init__(self, peers: tuple[str, ...]):
        self.peers = peers
        self._channels = [grpc.aio.insecure_channel(peer) for peer in peers]
        self._next = itertools.cycle(range(len(peers)))
        self.remote = self.local = 0

    async def prefill(self, request: Request, metadata: tuple, timeout: float | None) -> Handoff | None:
        """The hand-off from a peer (the request's seed fixed first), or None when no peer answered."""
        request = with_seed(request)
        message = pb.PrefillRequest(prompt_token_ids=request.prompt_ids, sampling=sampling_proto(request.params),
                                    request_id=request.request_id)
        forwarded = tuple((k, v) for k, v in metadata if k == "authorization")
        for _ in self.peers:
            peer = next(self._next)
            call = self._channels[peer].unary_unary(f"/{SERVICE}/Prefill",
                                                    request_serializer=pb.PrefillRequest.SerializeToString,
                                                    response_deserializer=pb.PrefillResponse.FromString)
            try:
                reply = await call(message, metadata=forwarded, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED):
                    log.warning("prefill peer %s: %s", self.peers[peer], exc.details())
                    continue
                raise
            self.remote += 1
            done = REASON_OF.get(reply.finish_reason)
            return Handoff(request, list(reply.token_ids), list(reply.logprobs) or [0.0] * len(reply.token_ids),
                           reply.stored_pages, done, reply.text)
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
                         usage=Usage(len(request.prompt_ids), len(handoff.generated_ids)),
                         logprobs=handoff.generated_logprobs if request.params.logprobs else None,
                         request_id=request.request_id, forged_tokens=request.forged_tokens)

