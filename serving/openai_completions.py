"""Turns a generation call's choices into OpenAI responses: a whole `ChatCompletion` / `Completion`, or chunks.

`CompletionAssembler.chat` answers /v1/chat/completions and `CompletionAssembler.text` the
completions endpoint, whose `echo` puts the prompt before the completion and whose `logprobs`
(an integer) is the legacy object; with `max_tokens` 0 nothing generated is returned, which with
`echo` and `logprobs` scores a prompt (what lm-eval's loglikelihood requests need).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from serving import openai_format as fmt
from serving.openai_format import ChoiceState
from serving.openai_generate import GenerationCall, Update
from serving.openai_schema import ChatCompletionBody, CompletionBody
from serving.service import InferenceService


class CompletionAssembler:
    def __init__(self, service: InferenceService, body: ChatCompletionBody | CompletionBody, is_chat: bool,
                 prompts: list[str | list[int]] | None = None):
        self.tokenizer = service.llm.tokenizer
        self.model = body.model or service.model_name
        self.body, self.is_chat, self.prompts = body, is_chat, prompts
        self.id_prefix = "chatcmpl" if is_chat else "cmpl"
        self.created = int(time.time())
        self.call_id, self.call = "", None
        self._echoes: dict[int, str] = {}  # prompt index -> its echoed text

    @classmethod
    def chat(cls, service: InferenceService, body: ChatCompletionBody) -> CompletionAssembler:
        return cls(service, body, is_chat=True)

    @classmethod
    def text(cls, service: InferenceService, body: CompletionBody, prompts: list[str | list[int]]
             ) -> CompletionAssembler:
        return cls(service, body, is_chat=False, prompts=prompts)

    def start(self, call_id: str, call: GenerationCall) -> None:
        self.call_id, self.call = call_id, call

    # -- whole responses ------------------------------------------------------------------------
    async def collect(self) -> dict[str, Any]:
        async for _ in self.call.updates():
            pass
        if any(choice.final is None for choice in self.call.choices):  # the client went away: nobody reads this
            return {}
        choices = [self._chat_choice(c) if self.is_chat else self._text_choice(c) for c in self.call.choices]
        if self.is_chat:
            return fmt.chat_completion(self.call_id, self.created, self.model, choices, self._usage())
        return fmt.completion(self.call_id, self.created, self.model, choices, self._usage())

    def _usage(self) -> dict[str, Any]:
        finals = [choice.final for choice in self.call.choices]
        n = self.body.n
        prompt_tokens = sum(out.usage.prompt_tokens for out in finals[::n])  # a prompt's n choices: counted once
        scores_only = not self.is_chat and self.body.scores_only
        completion = 0 if scores_only else sum(out.usage.completion_tokens for out in finals)
        # A prompt's cached tokens: the most any of its choices took from the cache (the later choices take
        # the pages the first computes, so that shows the prompt computed once, not n times).
        cached = sum(max(out.usage.cached_tokens for out in finals[i : i + n]) for i in range(0, len(finals), n))
        return fmt.usage(prompt_tokens, completion, cached)

    def _chat_choice(self, choice: ChoiceState) -> dict[str, Any]:
        logprobs = None
        if self.body.logprobs:
            logprobs = fmt.chat_token_logprobs(self.tokenizer, choice.token_ids, choice.logprobs,
                                               choice.top_logprobs, self.body.top_logprobs or 0)
        return fmt.chat_choice(choice.index, choice.final.text, choice.finish_reason, logprobs)

    def _text_choice(self, choice: ChoiceState) -> dict[str, Any]:
        body = self.body
        generated = not body.scores_only
        text = (self._echo(choice) if body.echo else "") + (choice.final.text if generated else "")
        logprobs = None
        if body.logprobs is not None:
            ids, scores, tops = self._scored(choice) if body.echo else ([], [], [])
            if generated:
                ids, scores, tops = ids + choice.token_ids, scores + choice.logprobs, tops + choice.top_logprobs
            logprobs = fmt.legacy_logprobs(self.tokenizer, ids, scores, tops, body.logprobs)
        return fmt.completion_choice(choice.index, text, "length" if not generated else choice.finish_reason,
                                     logprobs)

    def _echo_len(self, choice: ChoiceState) -> int:
        return len(self._echo(choice)) if self.body.echo else 0

    def _echo(self, choice: ChoiceState) -> str:
        """The prompt as echoed: its text, or its token ids decoded (once per prompt, not per chunk)."""
        i = choice.index // self.body.n
        if i not in self._echoes:
            prompt = self.prompts[i]
            self._echoes[i] = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        return self._echoes[i]

    def _scored(self, choice: ChoiceState) -> tuple[list[int], list[float | None], list]:
        """The prompt's ids, each one's logprob (None for the first) and alternatives (None for the first)."""
        ids = list(self.call.requests[choice.index].prompt_ids)
        scores = list(choice.prompt_logprobs or [None] * len(ids))
        tops = list(choice.prompt_top_logprobs or [[] for _ in ids])
        tops[0] = None
        return ids, scores, tops

    # -- streams ---------------------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        """The response as chunks: a role (chat) or the echoed prompt (text) first for every choice,
        then each delta, each choice's finish reason, and with include_usage a last chunk of usage."""
        with_usage = self.body.include_usage
        for choice in self.call.choices:
            first = self._first_chunk(choice)
            if first is not None:
                yield first
        async for update in self.call.updates():
            if self._streams_prompt_scores and update.delta.prompt_logprobs is not None:  # once, before its text
                yield self._text_chunk([self._scored_echo(update.choice)])
            chunk = self._delta_chunk(update)
            if chunk is not None:
                yield chunk
        if with_usage:
            if self.is_chat:
                yield fmt.chat_chunk(self.call_id, self.created, self.model, [], self._usage(), with_usage=True)
            else:
                yield fmt.completion(self.call_id, self.created, self.model, [], self._usage(), streamed=True)

    def _first_chunk(self, choice: ChoiceState) -> dict[str, Any] | None:
        if self.is_chat:
            return self._chat_chunk([fmt.chat_chunk_choice(choice.index, {"role": "assistant", "content": ""})])
        if self.body.echo and not self._streams_prompt_scores:
            return self._text_chunk([fmt.completion_choice(choice.index, self._echo(choice), None, None)])
        return None

    @property
    def _streams_prompt_scores(self) -> bool:
        """echo with logprobs: the echoed prompt waits for its scores, which come with the first tokens."""
        return not self.is_chat and self.body.echo and self.body.logprobs is not None

    def _scored_echo(self, choice: ChoiceState) -> dict[str, Any]:
        ids, scores, tops = self._scored(choice)
        logprobs = fmt.legacy_logprobs(self.tokenizer, ids, scores, tops, self.body.logprobs)
        return fmt.completion_choice(choice.index, self._echo(choice), None, logprobs)

    def _delta_chunk(self, update: Update) -> dict[str, Any] | None:
        choice, delta = update.choice, update.delta
        if not delta.text and not delta.token_ids and delta.final is None:
            return None
        finish = choice.finish_reason
        if self.is_chat:
            logprobs = None
            if self.body.logprobs:
                logprobs = fmt.chat_token_logprobs(self.tokenizer, delta.token_ids, delta.logprobs,
                                                   delta.top_logprobs, self.body.top_logprobs or 0)
            content = {"content": delta.text} if delta.text or finish is None else {}
            return self._chat_chunk([fmt.chat_chunk_choice(choice.index, content, finish, logprobs)])
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = fmt.legacy_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, delta.top_logprobs,
                                           self.body.logprobs, offset=self._echo_len(choice) + len(choice.text)
                                           - len(delta.text))
        return self._text_chunk([fmt.completion_choice(choice.index, delta.text, finish, logprobs)])

    def _chat_chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return fmt.chat_chunk(self.call_id, self.created, self.model, choices, with_usage=self.body.include_usage)

    def _text_chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = fmt.completion(self.call_id, self.created, self.model, choices, None, streamed=True)
        if self.body.include_usage:
            chunk["usage"] = None
        return chunk
