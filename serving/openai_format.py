"""OpenAI response objects: completions, chat completions, their stream chunks, logprobs, usage and errors.

Plain dicts with the field names of the `openai` package's response types (`ChatCompletion`,
`ChatCompletionChunk`, `Completion`, `CompletionUsage`, ...). A token's text is what the tokenizer
decodes for it alone (special tokens included), as vLLM reports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxinfer.engine.params import RequestOutput
from jaxinfer.tokenizer.tokenizer import Tokenizer

Alternatives = list[tuple[int, float]]


def token_text(tokenizer: Tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


@dataclass
class ChoiceState:
    """What one choice (one engine request) has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Alternatives] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[Alternatives] | None = None
    final: RequestOutput | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.final.finish_reason if self.final is not None else None


def chat_token_logprobs(tokenizer: Tokenizer, ids: Sequence[int], logprobs: Sequence[float],
                        tops: Sequence[Alternatives], top_n: int) -> list[dict[str, Any]]:
    """`ChatCompletionTokenLogprob` entries: token, logprob, bytes and the `top_n` most likely alternatives."""
    entries = []
    for i, (token, logprob) in enumerate(zip(ids, logprobs, strict=True)):
        alternatives = tops[i][:top_n] if i < len(tops) else []
        entries.append({**_token_entry(tokenizer, token, logprob),
                        "top_logprobs": [_token_entry(tokenizer, t, lp) for t, lp in alternatives]})
    return entries


def _token_entry(tokenizer: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def legacy_logprobs(tokenizer: Tokenizer, ids: Sequence[int], logprobs: Sequence[float | None],
                    tops: Sequence[Alternatives | None], top_n: int, offset: int = 0) -> dict[str, list]:
    """The completions endpoint's `logprobs` object: tokens, token_logprobs, top_logprobs (a token -> logprob
    map per position, None where a position has no score: the prompt's first token) and text_offset."""
    texts = [token_text(tokenizer, token) for token in ids]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top_maps: list[dict[str, float] | None] = []
    for i, logprob in enumerate(logprobs):
        alternatives = tops[i] if i < len(tops) else None
        if logprob is None or alternatives is None:
            top_maps.append(None)
            continue
        top_map: dict[str, float] = {}
        for token, value in alternatives[:top_n]:
            top_map.setdefault(token_text(tokenizer, token), value)  # two ids may decode alike: keep the likelier
        top_maps.append(top_map)
    return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": top_maps, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """`CompletionUsage`: each prompt counted once (n choices share it), every choice's completion tokens."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_completion(call_id: str, created: int, model: str, choices: Sequence[dict[str, Any]],
                    usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "object": "chat.completion", "created": created, "model": model,
            "choices": list(choices), "usage": usage_, "system_fingerprint": None}


def chat_choice(index: int, text: str, finish_reason: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
            "finish_reason": finish_reason, "logprobs": None if logprobs is None else {"content": logprobs,
                                                                                    "refusal": None}}


def chat_chunk(call_id: str, created: int, model: str, choices: list[dict[str, Any]],
               usage_: dict[str, Any] | None = None, with_usage: bool = False) -> dict[str, Any]:
    """A `ChatCompletionChunk`; with include_usage every chunk has `usage` (null but in the last one)."""
    chunk = {"id": call_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices, "system_fingerprint": None}
    if with_usage:
        chunk["usage"] = usage_
    return chunk


def chat_chunk_choice(index: int, delta: dict[str, Any], finish_reason: str | None = None,
                      logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "finish_reason": finish_reason,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}


def completion(call_id: str, created: int, model: str, choices: Sequence[dict[str, Any]],
               usage_: dict[str, Any] | None, streamed: bool = False) -> dict[str, Any]:
    """A `Completion` (each stream chunk of the completions endpoint has this shape too)."""
    body = {"id": call_id, "object": "text_completion", "created": created, "model": model,
            "choices": list(choices), "system_fingerprint": None}
    if not streamed or usage_ is not None:
        body["usage"] = usage_
    return body


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict[str, list] | None
                      ) -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


# HTTP status -> OpenAI's error `type`.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
               503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
