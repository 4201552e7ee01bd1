"""Per-request sampling parameters and the outputs the engine returns."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

from jaxinfer.errors import RequestError
from jaxinfer.guided.spec import GuidedSpec, guided_spec

MAX_SEED = 2**32 - 1
MAX_INT32 = 2**31 - 1
MAX_STOP_TOKEN_IDS = 8  # with the model's EOS ids, they must fit the sampler's banned-id slots
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings are searched on the engine thread at every token
MAX_REPETITION_PENALTY = 100.0
PENALTIES_OFF = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
MAX_TOP_LOGPROBS = 20  # OpenAI's limit; the step computes this many alternatives for every row that asks
MAX_LOGIT_BIAS = 64  # pairs per request: every step carries [rows, 64] ids and values (engine/logit_bias.py)
MAX_BIAS = 100.0  # OpenAI's range: -100 bans a token in practice, 100 all but forces it
DECIMAL_ID = re.compile(r"[0-9]{1,10}")  # a JSON key read as a token id: ASCII digits only (not "²", not "1e3")


@dataclass(frozen=True)
class SamplingParams:
    """What to generate. temperature 0 is greedy; seed makes sampling reproducible per request."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # Penalties as vLLM defines them (engine/penalties.py): 1 and 0 are off.
    repetition_penalty: float = 1.0  # prompt and output tokens: positive logits / r, negative * r
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    presence_penalty: float = 0.0  # minus this if the output has the token
    # OpenAI's: {token id: bias in [-100, 100]} added to the raw logits first (engine/logit_bias.py); JSON's
    # string keys are read as ids. Kept as (id, bias) pairs in id order.
    logit_bias: Mapping[int | str, float] | tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    # Structured output: {"json_schema": {...}} | {"json_object": True} | {"regex": "..."} | {"choice": [...]}
    # | {"grammar": "..."} (jaxinfer/guided/spec.py), kept as a GuidedSpec; None: unconstrained.
    guided: GuidedSpec | Mapping[str, Any] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: the most likely ids at each position and their logprobs
    # Each prompt token's logprob given those before it (None: off); k > 0 adds the k most likely ids there.
    prompt_logprobs: int | None = None
    num_draft_tokens: int | None = None  # speculative proposals per round: None = the engine's, 0 = off
    exec: bool = False  # run the programs this request writes in <|exec|> blocks (engine.exec_slots > 0)
    exec_max_instructions: int | None = None  # fuel per program; None = the engine's cap (also the maximum)
    exec_files: tuple[str, ...] = ()  # the tenant's files mapped to descriptors 3, 4, ... (engine.exec_files_root)
    exec_session: str = ""  # programs start from the memory the tenant's last program in this session ended with
    exec_trace: str = "none"  # what of a program's trace enters the context: none | summary | full
    # Lower limits than the engine's for this request's programs (None: the engine's; larger values are capped).
    exec_timeout_seconds: float | None = None
    exec_memory_pages: int | None = None
    exec_max_trace_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else _list_field("stop", self.stop))
        object.__setattr__(self, "stop_token_ids", _list_field("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "exec_files", _list_field("exec_files", self.exec_files))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "guided", guided_spec(self.guided))
        self._check()

    @property
    def active_penalties(self) -> list[str]:
        """The names of the repetition, frequency and presence penalties that are on."""
        return [name for name, off in PENALTIES_OFF.items() if getattr(self, name) != off]

    @property
    def penalized(self) -> bool:
        return bool(self.active_penalties)

    def _check(self) -> None:
        for name in ("ignore_eos", "logprobs", "exec"):
            _bool_field(name, getattr(self, name))
        _int_field("max_tokens", self.max_tokens, low=1, high=MAX_INT32)
        _int_field("top_k", self.top_k, low=0, high=MAX_INT32)
        _int_field("top_logprobs", self.top_logprobs, low=0, high=MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs: needs logprobs true")
        if self.prompt_logprobs is not None:
            _int_field("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_TOP_LOGPROBS)
        _int_field("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        _float_field("temperature", self.temperature, low=0.0, high=100.0)
        _float_field("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _float_field("min_p", self.min_p, low=0.0, high=1.0)
        _float_field("repetition_penalty", self.repetition_penalty, low=0.0, high=MAX_REPETITION_PENALTY, low_open=True)
        _float_field("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _float_field("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _int_field("seed", self.seed, low=0, high=MAX_SEED)
        if self.num_draft_tokens is not None:
            _int_field("num_draft_tokens", self.num_draft_tokens, low=0, high=64)
        if self.exec_max_instructions is not None:
            _int_field("exec_max_instructions", self.exec_max_instructions, low=1, high=MAX_INT32)
        if len(self.exec_files) > 16 or not all(isinstance(path, str) and path for path in self.exec_files):
            raise RequestError("exec_files: at most 16 non-empty relative paths")
        if self.exec_timeout_seconds is not None:
            _float_field("exec_timeout_seconds", self.exec_timeout_seconds, low=0.0, high=86400.0, low_open=True)
        if self.exec_memory_pages is not None:
            _int_field("exec_memory_pages", self.exec_memory_pages, low=0, high=65536)
        if self.exec_max_trace_tokens is not None:
            _int_field("exec_max_trace_tokens", self.exec_max_trace_tokens, low=0, high=MAX_INT32)
        if self.exec_trace not in ("none", "summary", "full"):
            raise RequestError(f"exec_trace: must be none, summary or full, got {self.exec_trace!r}")
        if not isinstance(self.exec_session, str) or len(self.exec_session) > 256:
            raise RequestError("exec_session: a string of at most 256 characters")
        if len(self.stop) > MAX_STOPS:
            raise RequestError(f"stop: at most {MAX_STOPS} strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop[{i}]: must be a non-empty string")
            if len(s) > MAX_STOP_CHARS:
                raise RequestError(f"stop[{i}]: at most {MAX_STOP_CHARS} characters, got {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for i, t in enumerate(self.stop_token_ids):
            _int_field(f"stop_token_ids[{i}]", t, low=0, high=MAX_INT32)


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as (id, bias) pairs in id order, each checked; a mapping or pairs (what it becomes) in."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, list | tuple) and all(isinstance(p, list | tuple) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise RequestError(f"logit_bias: must map token ids to biases, got {type(value).__name__} {value!r:.80}")
    if len(items) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias: at most {MAX_LOGIT_BIAS} token ids, got {len(items)}")
    pairs: dict[int, float] = {}
    for key, bias in items:
        token = int(key) if isinstance(key, str) and DECIMAL_ID.fullmatch(key) else key
        _int_field(f"logit_bias[{key!r:.20}]", token, low=0, high=MAX_INT32)
        _float_field(f"logit_bias[{key!r:.20}]", bias, low=-MAX_BIAS, high=MAX_BIAS)
        if token in pairs:
            raise RequestError(f"logit_bias: token id {token} is given twice")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _list_field(name: str, value: object) -> tuple:
    """A list-valued field as a tuple; a string or a mapping is refused, not split into its parts."""
    if not isinstance(value, list | tuple):
        raise RequestError(f"{name}: must be a list, got {type(value).__name__} {value!r:.80}")
    return tuple(value)


def _bool_field(name: str, value: object) -> None:
    if not isinstance(value, bool):  # "false" would be true
        raise RequestError(f"{name}: must be true or false, got {value!r:.80}")


def _int_field(name: str, value: object, *, low: int, high: int | None = None) -> None:
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise RequestError(f"{name}: must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"{name}: must be {bound}, got {value}")


def _float_field(name: str, value: object, *, low: float, high: float, low_open: bool = False) -> None:
    if not isinstance(value, Real) or isinstance(value, bool):
        raise RequestError(f"{name}: must be a number, got {value!r}")
    if value != value or value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(f"{name}: must be in {interval}, got {value}")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass
class Request:
    """One generation request as the engine takes it: token ids, not text."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    forged_tokens: int = 0  # control tokens forged in user text and encoded as plain text
    cache_salt: str = ""  # prefix-cache namespace (the tenant): pages are shared only within one salt
    tenant: str = ""  # whose files exec programs may map (engine.exec_files_root/<tenant>/); "" = "default"
    adapter: str = ""  # a loaded LoRA adapter's name ("": the base model, or engine.exec_adapter with exec on)
    # Disaggregated prefill and decode (engine/disagg.py). A prefill worker's request sets `publish_kv`:
    # when it finishes, its prompt's full KV pages are written to the KV store. The decode worker's
    # request continues from the ids generated there, and reads the `stored_pages` leading pages.
    publish_kv: bool = False
    generated_ids: list[int] = field(default_factory=list)
    generated_logprobs: list[float] = field(default_factory=list)
    generated_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # with top_logprobs
    stored_pages: int = 0
    # With prompt_logprobs: the prompt as the prefill worker scored it (RequestOutput's fields), so the
    # decode worker reads its stored pages instead of computing the prompt again to score it.
    scored_prompt_logprobs: list[float | None] | None = None
    scored_prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # The `guided` constraint as validation compiled it (a TokenAutomaton, or a grammar for the host
    # matcher): kept here so the engine thread never compiles it again (engine/guided_rows.py).
    compiled_guide: Any = field(default=None, repr=False, compare=False)


@dataclass
class RequestOutput:
    """One finished request. finish_reason: "stop" (EOS, stop token or string), "length" or "abort".

    `index` is the engine's id for the request (what `Engine.abort` takes)."""

    index: int
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[float] | None = None
    # With top_logprobs: per token, the (id, logprob) pairs of the most likely ids under the raw model,
    # most likely first ([] for a token this engine did not sample: a program's result, a handed-off id).
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With prompt_logprobs: per prompt token, its logprob given the tokens before it (None for the first),
    # and with prompt_logprobs k > 0 the k most likely ids at its position ([] for the first).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    request_id: str = ""
    forged_tokens: int = 0
    stored_pages: int = 0  # prompt pages written to the KV store (requests with `publish_kv`)
