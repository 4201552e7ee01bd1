"""Request admission: every check a request passes before it is queued, each refusal a RequestError
naming the field and the limit (prompt, stop ids, penalties, exec, files, adapters, handoff fields).

A mixin of `Engine` (engine/engine.py); it reads the engine's runner, config, pool, executor,
speculator and KV publisher."""

from __future__ import annotations

import math
from collections.abc import Iterable
from numbers import Integral, Real
from typing import TYPE_CHECKING

from jaxinfer.engine.adapters import AdapterInfo
from jaxinfer.engine.executor import file_mapping
from jaxinfer.engine.params import Request, SamplingParams
from jaxinfer.engine.sampler import MAX_BANNED
from jaxinfer.engine.sequence import prefix_salt
from jaxinfer.errors import RequestError
from jaxinfer.processor.wasi import FileAccessError

if TYPE_CHECKING:
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.disagg import PagePublisher
    from jaxinfer.engine.executor import Executor
    from jaxinfer.engine.speculator import Speculator
    from jaxinfer.engine.step import ModelRunner
    from jaxinfer.kv.prefix_cache import PrefixCachingPool
    from jaxinfer.tokenizer import Tokenizer


def _check_token_ids(name: str, ids: Iterable[object], vocab: int) -> None:
    """Every id an integer (not a float, bool or string) inside the vocabulary."""
    for i, token in enumerate(ids):
        if not isinstance(token, Integral) or isinstance(token, bool):
            raise RequestError(f"{name}[{i}]: must be an integer token id, got {token!r:.40}")
        if not 0 <= token < vocab:
            raise RequestError(f"{name}[{i}]: {token} is outside the vocabulary [0, {vocab})")


def _is_logprob(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and -math.inf <= value <= 0


def _alternatives(pairs: object, count: int, vocab: int) -> bool:
    """Whether `pairs` is `count` (id, logprob) pairs with ids in the vocabulary."""
    return (isinstance(pairs, list | tuple) and len(pairs) == count
            and all(isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], Integral)
                    and not isinstance(p[0], bool) and 0 <= p[0] < vocab and _is_logprob(p[1]) for p in pairs))


class RequestAdmission:
    """Validates requests (`validate`) and names what each runs with (`adapter_name`, `prefix_salt`)."""

    runner: ModelRunner
    cfg: EngineConfig
    pool: PrefixCachingPool
    tokenizer: Tokenizer
    max_model_len: int
    executor: Executor | None
    speculator: Speculator | None
    _publisher: PagePublisher | None
    prefix_caching: bool

    def validate(self, request: Request) -> None:
        """Raises RequestError naming the field and the limit for a request the engine cannot run."""
        self._check_prompt(request.prompt_ids, request.params)
        self._check_guided(request)
        self._check_handoff(request)
        self._check_files(request)
        self._adapter_of(request)

    def adapter_name(self, request: Request) -> str:
        """The adapter a request runs with: its own, or engine.exec_adapter for exec requests ("": none)."""
        return request.adapter or (self.cfg.exec_adapter if request.params.exec else "")

    def prefix_salt(self, request: Request) -> str:
        """The prefix-cache namespace a request's pages get (see `Sequence.cache_salt`)."""
        return prefix_salt(request, self._adapter_of(request))

    def _adapter_of(self, request: Request) -> AdapterInfo | None:
        """The loaded adapter a request runs with; RequestError naming the field that named it."""
        name = self.adapter_name(request)
        if not name:
            return None
        if self.runner.adapters is None:
            raise RequestError("adapter: this engine serves no LoRA adapters (engine.max_adapters is 0)")
        if self.speculator is not None:
            raise RequestError("adapter: not available with speculative decoding (engine.draft_model)")
        return self.runner.adapters.slot_of(name, "adapter" if request.adapter else "engine.exec_adapter")

    def _check_files(self, request: Request) -> None:
        mapping = file_mapping(self.cfg, request)
        if mapping is None:
            return
        if not self.cfg.exec_files_root:
            raise RequestError("exec_files: this engine maps no files (engine.exec_files_root is empty)")
        try:
            mapping.check()
        except FileAccessError as error:  # check turns every OS complaint into FileAccessError
            raise RequestError(str(error)) from error

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("prompt: must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt: {len(prompt_ids)} tokens, the limit is {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len} leaves room for one generated token)"
            )
        if len(self._stop_ids(params)) + len(self._exec_banned(params)) > MAX_BANNED:
            raise RequestError(f"stop_token_ids: with the model's EOS ids (and the exec control tokens) at most "
                               f"{MAX_BANNED} ids can be held back")
        if params.exec and self.executor is None:
            raise RequestError("exec: this engine runs no programs (engine.exec_slots is 0)")
        if params.exec and params.prompt_logprobs is not None:  # its result can end it before the prompt is computed
            raise RequestError("prompt_logprobs: not available with exec (a prompt that ends with a program gets its "
                               "result before the prompt is computed)")
        if params.exec_trace == "full" and self.executor is not None and not self.cfg.exec_trace_entries:
            raise RequestError("exec_trace: full needs engine.exec_trace_entries > 0")
        # What a speculative round does not compute: program steps, alternatives, penalty counts per proposal.
        unspeculated = (["exec"] * params.exec + ["top_logprobs"] * bool(params.top_logprobs)
                        + ["prompt_logprobs"] * (params.prompt_logprobs is not None)
                        + ["logit_bias"] * bool(params.logit_bias) + params.active_penalties)
        if unspeculated and self.speculator is not None:
            raise RequestError(f"{unspeculated[0]}: not available with speculative decoding (engine.draft_model)")
        for name in ("top_logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.runner.model_cfg.vocab_size:
                raise RequestError(f"{name}: at most the vocabulary's {self.runner.model_cfg.vocab_size} ids, "
                                   f"got {getattr(params, name)}")
        self._check_penalties(params)
        vocab = self.runner.model_cfg.vocab_size
        _check_token_ids("prompt_token_ids", prompt_ids, vocab)
        _check_token_ids("stop_token_ids", params.stop_token_ids, vocab)
        outside = next((token for token, _ in params.logit_bias if token >= vocab), None)
        if outside is not None:
            raise RequestError(f"logit_bias[{outside}]: {outside} is outside the vocabulary [0, {vocab})")
        # Every request must fit the pool alone, so preemption always leaves one that can finish.
        prompt_pages = math.ceil((len(prompt_ids) + 1) / self.cfg.page_size)
        if prompt_pages > self.pool.capacity:
            raise RequestError(
                f"prompt: {len(prompt_ids)} tokens and one generated need {prompt_pages} KV pages of "
                f"{self.cfg.page_size} tokens, the pool has {self.pool.capacity}")
        longest = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        pages_needed = math.ceil(longest / self.cfg.page_size)
        if pages_needed > self.pool.capacity:
            raise RequestError(
                f"max_tokens: the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{pages_needed} KV pages of {self.cfg.page_size} tokens, the pool has {self.pool.capacity}"
            )

    def _check_penalties(self, params: SamplingParams) -> None:
        if not params.penalized:
            return
        field = params.active_penalties[0]
        if params.exec:
            raise RequestError(f"{field}: not available with exec (a program's result is not counted)")
        if not self.cfg.penalty_slots:
            raise RequestError(f"{field}: this engine keeps no token counts (engine.max_penalized_seqs is 0)")

    def _check_handoff(self, request: Request) -> None:
        """The fields of disaggregated prefill and decode (engine/disagg.py)."""
        generated, vocab = request.generated_ids, self.runner.model_cfg.vocab_size
        if len(generated) >= request.params.max_tokens:
            raise RequestError(f"generated_ids: {len(generated)} ids already generated, max_tokens is "
                               f"{request.params.max_tokens}")
        if len(request.prompt_ids) + len(generated) >= self.max_model_len:
            raise RequestError(f"generated_ids: prompt plus generated ids reach max_model_len {self.max_model_len}")
        _check_token_ids("generated_ids", generated, vocab)
        if request.generated_logprobs and len(request.generated_logprobs) != len(generated):
            raise RequestError("generated_logprobs: one per generated id is required")
        if request.generated_top_logprobs and len(request.generated_top_logprobs) != len(generated):
            raise RequestError("generated_top_logprobs: one list per generated id is required")
        bad = next((i for i, x in enumerate(request.generated_logprobs) if not _is_logprob(x)), None)
        if bad is not None:
            raise RequestError(f"generated_logprobs[{bad}]: must be a log-probability (a number <= 0), got "
                               f"{request.generated_logprobs[bad]!r:.40}")
        self._check_scored_prompt(request, vocab)
        if request.publish_kv or request.stored_pages:
            if self._publisher is None:
                raise RequestError("publish_kv / stored_pages: this engine has no KV store (engine.kv_store)")
            if not self.prefix_caching:
                raise RequestError("publish_kv / stored_pages: the engine's prefix cache is off")

    @staticmethod
    def _check_scored_prompt(request: Request, vocab: int) -> None:
        """A prefill worker's prompt scores: one per prompt token (None for the first), as asked."""
        scored, tops = request.scored_prompt_logprobs, request.scored_prompt_top_logprobs
        k = request.params.prompt_logprobs
        if scored is None and tops is None:
            return
        if k is None or scored is None or (tops is not None) != bool(k):
            raise RequestError("scored_prompt_logprobs: given only with prompt_logprobs (with their alternatives "
                               "when prompt_logprobs > 0)")
        if len(scored) != len(request.prompt_ids) or (tops is not None and len(tops) != len(scored)):
            raise RequestError(f"scored_prompt_logprobs: one entry per prompt token ({len(request.prompt_ids)}) "
                               "is required")
        if scored[0] is not None:
            raise RequestError(f"scored_prompt_logprobs[0]: must be null (the first token has no context), got "
                               f"{scored[0]!r:.40}")
        bad = next((i for i, x in enumerate(scored[1:], 1) if not _is_logprob(x)), None)
        if bad is not None:
            raise RequestError(f"scored_prompt_logprobs[{bad}]: must be a log-probability (a number <= 0), got "
                               f"{scored[bad]!r:.40}")
        bad = next((i for i, top in enumerate(tops or []) if not _alternatives(top, 0 if i == 0 else k, vocab)), None)
        if bad is not None:
            raise RequestError(f"scored_prompt_top_logprobs[{bad}]: must be {'empty' if bad == 0 else f'{k}'} (id, "
                               f"logprob) pairs with ids in the vocabulary, got {tops[bad]!r:.60}")

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        eos = [] if params.ignore_eos else sorted(self.tokenizer.eos_ids)
        return list(dict.fromkeys([*eos, *params.stop_token_ids]))

    def _exec_banned(self, params: SamplingParams) -> list[int]:
        """Exec control ids a request may not sample: result and trap markers always, exec markers with exec off."""
        if self.executor is None:
            return []
        tokens = self.executor.tokens
        return list(tokens.engine_written) + ([] if params.exec else [tokens.exec_open, tokens.exec_close])
