"""Proto messages <-> engine values: sampling settings and finish reasons, for every service."""

from __future__ import annotations

from typing import Any

import grpc

from jaxinfer.engine.params import SamplingParams
from jaxinfer.errors import JaxinferError, RequestError
from jaxinfer.guided.spec import GuidedSpec
from serving.proto.jaxinfer.v1 import inference_pb2 as pb
from serving.worker import Delta, QueueFull, WorkerDead

DEFAULT_MAX_TOKENS = 128
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
REASON_OF = {code: name for name, code in FINISH_REASONS.items()}
OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
            "presence_penalty", "top_logprobs", "prompt_logprobs", "seed", "min_tokens", "num_draft_tokens",
            "exec_max_instructions", "exec_timeout_seconds", "exec_memory_pages", "exec_max_trace_tokens")


def sampling_params(proto: pb.SamplingParams) -> SamplingParams:
    """Proto sampling settings -> SamplingParams (which names the field and the limit when one is bad)."""
    values: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS}
    for name in OPTIONAL:
        if proto.HasField(name):
            values[name] = getattr(proto, name)
    return SamplingParams(**values, stop=tuple(proto.stop), stop_token_ids=tuple(proto.stop_token_ids),
                          ignore_eos=proto.ignore_eos, logprobs=proto.logprobs, exec=proto.exec,
                          exec_files=tuple(proto.exec_files), exec_session=proto.exec_session,
                          exec_trace=proto.exec_trace or "none", logit_bias=dict(proto.logit_bias),
                          guided=guided_from_proto(proto.guided) if proto.HasField("guided") else None)


def guided_from_proto(message: pb.GuidedDecoding) -> dict[str, Any]:
    """GuidedDecoding -> the `guided` field's one-key form (SamplingParams checks it)."""
    kind = message.WhichOneof("kind")
    if kind is None:
        raise RequestError("guided: set one of json_schema, json_object, regex, choice or grammar")
    value = getattr(message, kind)
    return {kind: list(value.values) if kind == "choice" else value}


def guided_proto(spec: GuidedSpec | None) -> pb.GuidedDecoding | None:
    if spec is None:
        return None
    if spec.kind == "choice":
        return pb.GuidedDecoding(choice=pb.ChoiceList(values=spec.choices))
    return pb.GuidedDecoding(**{spec.kind: True if spec.kind == "json_object" else spec.value})


def top_logprobs_proto(tops: list[list[tuple[int, float]]]) -> list[pb.TopLogprobs]:
    """Per-token (id, logprob) alternatives -> TopLogprobs messages."""
    return [pb.TopLogprobs(token_ids=[token for token, _ in top], logprobs=[value for _, value in top])
            for top in tops]


def top_logprobs_from_proto(messages) -> list[list[tuple[int, float]]]:
    """TopLogprobs messages -> per-token (id, logprob) alternatives."""
    return [list(zip(top.token_ids, top.logprobs, strict=True)) for top in messages]


def prompt_logprobs_proto(scores: list[float | None] | None, tops: list[list[tuple[int, float]]] | None
                          ) -> dict[str, list]:
    """A scored prompt (RequestOutput's fields) as a response's fields: its tokens after the first. Empty
    when there are none, or while some token is unscored (a request aborted before its first token)."""
    if scores is None or None in scores[1:]:
        return {}
    return {"prompt_logprobs": scores[1:], "prompt_top_logprobs": top_logprobs_proto((tops or [])[1:])}


def prompt_logprobs_from_proto(message, wanted: int | None, prompt_len: int
                               ) -> tuple[list[float | None] | None, list[list[tuple[int, float]]] | None]:
    """A response's prompt scores (when `wanted`: the request's prompt_logprobs) as RequestOutput's fields;
    (None, None) unless every token after the first has them (a peer built before these fields sends
    none): the decode worker then scores the prompt itself."""
    scores, tops = list(message.prompt_logprobs), top_logprobs_from_proto(message.prompt_top_logprobs)
    if wanted is None or len(scores) != prompt_len - 1 or (wanted and len(tops) != prompt_len - 1):
        return None, None
    return [None, *scores], ([[], *tops] if wanted else None)


def sampling_proto(params: SamplingParams) -> pb.SamplingParams:
    """SamplingParams -> proto (every field explicit, so the peer applies no defaults of its own)."""
    return pb.SamplingParams(**{name: getattr(params, name) for name in OPTIONAL}, stop=list(params.stop),
                             stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
                             logprobs=params.logprobs, exec=params.exec,
                             exec_files=list(params.exec_files), exec_session=params.exec_session,
                             exec_trace=params.exec_trace, logit_bias=dict(params.logit_bias),
                             guided=guided_proto(params.guided))


MAX_REQUEST_ID_CHARS = 256  # echoed in every streamed response and log line


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise RequestError(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")


def submit_refusal(error: JaxinferError) -> tuple[str, grpc.StatusCode]:
    """(metrics status, gRPC status) of a request the engine thread would not take (`EngineWorker.submit`)."""
    if isinstance(error, WorkerDead):
        return "error", grpc.StatusCode.UNAVAILABLE
    if isinstance(error, QueueFull):
        return "limited", grpc.StatusCode.RESOURCE_EXHAUSTED
    return "invalid", grpc.StatusCode.INVALID_ARGUMENT


def delta_failure(delta: Delta) -> tuple[str, grpc.StatusCode]:
    """(metrics status, gRPC status) of a request that ended with an error: its own, or the server's."""
    return ("invalid", grpc.StatusCode.INVALID_ARGUMENT) if delta.invalid else ("error", grpc.StatusCode.INTERNAL)
