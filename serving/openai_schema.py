"""OpenAI request bodies (chat completions, completions, tokenize, detokenize) read into engine values.

The field names are those of the official `openai` package's create-params types. A body is read
with pydantic: a wrong type or an unknown field becomes `BodyError` naming the field's path (the
`param` of OpenAI's error object). Ranges and limits are checked where the engine checks them, by
`SamplingParams`, whose RequestError already names the field. OpenAI fields that change what is
generated and that this engine does not do (tools, suffix, ...) are refused by name rather than
ignored; a few bookkeeping fields (`store`, `metadata`, ...) are accepted and
have no effect. jaxinfer's own settings (`top_k`, `min_p`, `exec`, ...) come as extra body fields,
as the `openai` client sends them with `extra_body`.

Structured output comes as OpenAI's `response_format` ({"type": "json_object"} or {"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}), as jaxinfer's `guided` (the batch
line's form), or as vLLM's `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`;
one of them per request (`guided_field` says which, so an error names what the body sent).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from jaxinfer.engine.params import SamplingParams
from jaxinfer.errors import RequestError

MAX_CHOICES = 16  # `n`: every choice is a sequence in the running batch
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LEGACY_LOGPROBS = 20  # the completions endpoint's integer `logprobs` (OpenAI allows 5; vLLM 20)
# Fields OpenAI defines that would change the output and that this engine does not implement.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "audio", "modalities",
               "prediction", "web_search_options", "reasoning_effort", "verbosity")
VLLM_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}


class BodyError(RequestError):
    """A request body field is missing, of the wrong type or unknown; `param` is its path."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


Number = StrictFloat | StrictInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: StrictStr = ""
    description: StrictStr | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None  # the schema is always enforced whole


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def guided(self) -> dict[str, Any] | None:
        if self.type == "json_schema":
            if self.json_schema is None:
                raise BodyError("response_format.json_schema: required with type json_schema",
                                "response_format.json_schema")
            return {"json_schema": self.json_schema.json_schema}
        return {"json_object": True} if self.type == "json_object" else None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr = ""
    user: StrictStr | None = None  # who is asking, for the caller's own bookkeeping: logged, not used
    store: StrictBool | None = None
    metadata: dict[str, StrictStr] | None = None
    service_tier: StrictStr | None = None
    # Sampling, shared by both endpoints.
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = 1
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # jaxinfer's own (extra_body), named as in SamplingParams and vLLM.
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    exec: StrictBool | None = None
    exec_files: list[StrictStr] | None = None
    exec_session: StrictStr | None = None
    request_id: StrictStr | None = None
    response_format: ResponseFormat | None = None
    guided: dict[StrictStr, Any] | None = None
    guided_json: dict[StrictStr, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    @property
    def guided_field(self) -> str | None:
        """The one body field that asks for structured output (BodyError if several do)."""
        given = [name for name in ("response_format", "guided", *VLLM_GUIDED) if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format.type == "text")]
        if len(given) > 1:
            raise BodyError(f"{given[1]}: give one of {', '.join(given)}, not several", given[1])
        return given[0] if given else None

    def guided_value(self) -> dict[str, Any] | None:
        field = self.guided_field
        if field == "response_format":
            return self.response_format.guided()
        if field in VLLM_GUIDED:
            return {VLLM_GUIDED[field]: getattr(self, field)}
        return self.guided

    def sampling(self, max_tokens: int | None, default_max_tokens: int, **more: Any) -> SamplingParams:
        """SamplingParams of this body (None values take the engine's defaults); `more`: endpoint fields."""
        values = {name: getattr(self, name) for name in (
            "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
            "repetition_penalty", "min_tokens", "ignore_eos", "exec", "exec_session")}
        values = {name: value for name, value in values.items() if value is not None}
        if self.stop is not None:
            values["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids is not None:
            values["stop_token_ids"] = tuple(self.stop_token_ids)
        if self.exec_files is not None:
            values["exec_files"] = tuple(self.exec_files)
        if self.logit_bias:
            values["logit_bias"] = self.logit_bias
        values["guided"] = self.guided_value()
        return SamplingParams(max_tokens=default_max_tokens if max_tokens is None else max_tokens, **values, **more)

    def check_choices(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise BodyError(f"n: must be in [1, {MAX_CHOICES}], got {self.n}", "n")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None  # a participant's name: accepted, not rendered (templates know none)

    def as_template_message(self) -> dict[str, str]:
        """{role, content} as the chat template takes it: text parts joined, `developer` read as `system`."""
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    parallel_tool_calls: StrictBool | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self.check_choices()
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise BodyError("max_tokens and max_completion_tokens: give one of them, not both", "max_tokens")
        return self.sampling(self.token_limit, default_max_tokens, logprobs=self.logprobs,
                             top_logprobs=self.top_logprobs or 0)

    @property
    def token_limit(self) -> int | None:
        """max_completion_tokens or max_tokens, whichever is given; None: the rest of the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [message.as_template_message() for message in self.messages]


TokenIds = list[StrictInt]


class CompletionBody(_Body):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = DEFAULT_COMPLETION_MAX_TOKENS
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per entry: a string, a list of strings, token ids, or a list of token id lists."""
        prompt = self.prompt
        one = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
        prompts = [prompt] if one else list(prompt)
        if not prompts:
            raise BodyError("prompt: must not be empty", "prompt")
        for i, entry in enumerate(prompts):
            if len(entry) == 0:
                raise BodyError(f"prompt[{i}]: must not be empty", "prompt")
        return prompts

    @property
    def scores_only(self) -> bool:
        """max_tokens 0: nothing is generated; with echo and logprobs the prompt is scored (lm-eval's way)."""
        return self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        self.check_choices()
        if self.suffix:
            raise BodyError("suffix: insertion after a suffix is not supported by this engine", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BodyError(f"best_of: only best_of == n is supported, got best_of {self.best_of} and n {self.n}",
                            "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LEGACY_LOGPROBS:
            raise BodyError(f"logprobs: must be in [0, {MAX_LEGACY_LOGPROBS}], got {self.logprobs}", "logprobs")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise BodyError(f"max_tokens: must be >= 0, got {self.max_tokens}", "max_tokens")
        if self.scores_only and self.stream:
            raise BodyError("max_tokens: 0 (scoring) cannot be streamed", "max_tokens")
        scored = self.echo and self.logprobs is not None
        # max_tokens 0 runs one engine token (a prompt's scores come with its last position) and drops it.
        return self.sampling(1 if self.scores_only else self.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS,
                             logprobs=self.logprobs is not None, top_logprobs=self.logprobs or 0,
                             prompt_logprobs=self.logprobs if scored else None)


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr = ""
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True  # with a prompt: the model's BOS, as the completions endpoint adds it
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr = ""
    tokens: list[StrictInt]


def read_body(model: type[BaseModel], body: object) -> Any:
    """`body` (parsed JSON) as `model`; BodyError naming the first bad field (refused fields by name)."""
    if not isinstance(body, dict):
        raise BodyError(f"the request body must be a JSON object, got {type(body).__name__}")
    refused = next((name for name in UNSUPPORTED if body.get(name) is not None), None)
    if refused is not None:
        raise BodyError(f"{refused}: not supported by this engine", refused)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(part) for part in error["loc"] if not _is_union_tag(part))
        message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
        raise BodyError(f"{param or 'body'}: {message}", param or None) from None


def _is_union_tag(part: object) -> bool:
    """pydantic puts the member type tried ("str", "list[int]", ...) into the location of a union error."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))
