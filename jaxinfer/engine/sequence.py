"""A request's state inside the engine: its tokens, pages, progress and finish, and one step's chunk of it.

Under overlapped scheduling a sequence can have sampled ids that are still on the device
(`inflight`): they count as tokens (positions, pages, the sampler's step number) but their values
are not known to the host until the step that sampled them is read back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jaxinfer.engine.params import Request, SamplingParams
from jaxinfer.kv.pending_read import PendingRead
from jaxinfer.tokenizer.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from jaxinfer.engine.adapters import AdapterInfo
    from jaxinfer.engine.guide_slots import LoadedGrammar
    from jaxinfer.guided.automaton import TokenAutomaton
    from jaxinfer.guided.host_matcher import HostMatcher


def prefix_salt(request: Request, adapter: AdapterInfo | None) -> str:
    """Prefix-cache namespace: the tenant's salt, and the adapter's content hash (its KV is not the base's)."""
    return f"{request.cache_salt}\x00lora:{adapter.digest}" if adapter is not None else request.cache_salt


@dataclass(eq=False)  # identity: `in running` and `remove` must not compare whole token lists
class Sequence:
    index: int
    request: Request
    seed: int
    output_ids: list[int] = field(default_factory=list)  # sampled ids the host has read back
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per output id (top_logprobs > 0)
    inflight: int = 0  # sampled ids still on the device (overlapped scheduling)
    last_row: int = -1  # this sequence's row in the step that sampled its newest id
    pages: list[int] = field(default_factory=list)
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of the full pages computed
    pending_keys: list[bytes] = field(default_factory=list)  # keys this sequence will publish
    num_computed: int = 0  # tokens whose K/V are in the cache (or written by a dispatched step)
    cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission (-1: not yet)
    finish_reason: str | None = None
    detokenizer: IncrementalDetokenizer | None = None  # streams the output text (for stop strings)
    stop_at: int | None = None  # where a stop string starts in the decoded output
    stop_search_from: int = 0  # output text before this is the engine's (a result block): no stop starts there
    arrival: int = 0  # admission order, for preempting the newest
    store_read: PendingRead | None = None  # prefix pages being read from the KV store before admission
    published_pages: int = 0  # prompt pages handed to the KV store (a prefill worker's `publish_kv`)
    exec_source: str | None = None  # a program this sequence wrote, waiting for or running in a slot
    exec_slot: int | None = None  # the processor slot running it
    exec_discard: int = 0  # in-flight samples to drop: they were drawn before the program's result
    adapter: AdapterInfo | None = None  # the LoRA adapter it runs with (counted in its `users` until released)
    penalty_slot: int | None = None  # its row of the runner's penalty counts, while running with penalties
    penalty_loaded: bool = False  # whether that row holds its ids (else it is loaded before its next step)
    # With prompt_logprobs: entry i is prompt token i's logprob (and most likely ids) given those before it.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_scored: int = 0  # prompt positions that dispatched steps score (position p scores token p + 1)
    bias: tuple[np.ndarray, np.ndarray] | None = None  # logit_bias as the step's arrays: ids, biases
    guide: TokenAutomaton | None = None  # its guided constraint's automaton (engine/guided_rows.py)
    guide_state: int = 0  # the automaton's state after the output ids the host has read back
    guide_loaded: LoadedGrammar | None = None  # where the automaton is on the device, while it runs
    matcher: HostMatcher | None = None  # a host-matched grammar's parser (jaxinfer/guided/host_matcher.py)
    mask_row: int | None = None  # its row of the step's bitmask, while it runs

    @property
    def adapter_slot(self) -> int:
        """The adapter's slot in the step (0: none)."""
        return self.adapter.slot if self.adapter is not None else 0

    @property
    def cache_salt(self) -> str:
        return prefix_salt(self.request, self.adapter)

    def guide_row_after(self, ids: list[int]) -> tuple[int, int] | None:
        """(pool row, grammar slot) of its automaton's state after the known output then `ids` (the
        draft's proposals); None without an automaton on the device, or if it refuses `ids`."""
        if self.guide is None or self.guide_loaded is None:
            return None
        state = self.guide.walk(ids, self.guide_state)
        return None if state < 0 else (self.guide_loaded.base + state, self.guide_loaded.slot)

    @property
    def held_for_mask(self) -> bool:
        """A host-matched row whose newest id is still on the device: its next mask needs that id first."""
        return self.matcher is not None and self.inflight > 0

    @property
    def paused(self) -> bool:
        """Waiting for its program's result: not scheduled until the result tokens are appended."""
        return self.exec_source is not None or self.exec_slot is not None

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        """Prompt, read-back output and in-flight samples."""
        return len(self.prompt_ids) + len(self.output_ids) + self.inflight

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host has."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.inflight

    def tokens(self, start: int, count: int) -> list[int]:
        """Known ids at positions [start, start + count) of prompt + output, without copying the rest."""
        split = len(self.prompt_ids)
        if start >= split:
            return self.output_ids[start - split : start - split + count]
        return (self.prompt_ids[start : start + count] + self.output_ids)[:count]

    @property
    def scoring_prompt(self) -> bool:
        """Whether prompt positions are still to be scored (prompt_logprobs): none of them may come from the
        prefix cache, which is not computed."""
        return self.prompt_logprobs is not None and self.prompt_scored < len(self.prompt_ids) - 1

    def wants_token(self, max_model_len: int) -> bool:
        """Whether another sample could still be kept (no length limit reached counting in-flight ids)."""
        return self.num_generated < self.params.max_tokens and self.num_tokens < max_model_len


@dataclass
class ScheduledChunk:
    """Positions [start, start + count) of one sequence, computed in one step."""

    seq: Sequence
    start: int
    count: int
    samples: bool = False  # the chunk reaches the sequence's last token, so its row's sample is kept

    def __post_init__(self) -> None:
        self.samples = self.start + self.count == self.seq.num_tokens
