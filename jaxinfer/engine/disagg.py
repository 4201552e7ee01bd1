"""Disaggregated prefill and decode: what a prefill worker computes and what it hands to a decode worker.

The prefill worker runs a request's prompt and samples its first id (`prefill_request`: at most
one token, `publish_kv` on), and writes the prompt's full KV pages to the shared KV store
(`PagePublisher`, as its prefill chunks complete). The hand-off is small: the prompt ids, the sampling
settings with the seed fixed, the ids generated and how many pages were stored. The decode worker
queues `decode_request(handoff)`: its scheduler reads the stored pages from the store into its own
pool (asynchronously, as any L3 hit), recomputes the prompt's last partial page and the first id
(fewer than `page_size + 1` tokens), and decodes on. Sampling keys depend only on the seed and the
number of ids generated, so the output equals the single-engine output (greedy: exactly).

Only full pages travel: a partial page is cheaper to recompute than to store and look up, as
LMCache does for its last partial chunk. The prefill worker streams pages out as its prefill
chunks complete (`PagePublisher`), so most writes overlap the rest of the prefill.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass, field

import jax

from jaxinfer.engine.metrics import EngineStats
from jaxinfer.engine.page_copies import host_pages
from jaxinfer.engine.params import MAX_SEED, Request, RequestOutput
from jaxinfer.engine.sequence import Sequence
from jaxinfer.engine.step import ModelRunner
from jaxinfer.kv.store import PageStore


@dataclass(frozen=True)
class Handoff:
    """A prefilled request, ready for a decode worker; `finish_reason` set means it is already done."""

    request: Request  # the original request, with its seed fixed
    generated_ids: list[int]
    generated_logprobs: list[float]
    stored_pages: int
    finish_reason: str | None
    text: str  # the output text so far (the whole output when finished)
    cached_tokens: int = 0  # prompt tokens the prefill worker found cached
    generated_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # with top_logprobs
    prompt_logprobs: list[float | None] | None = None  # with prompt_logprobs: the prompt as scored there
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


def with_seed(request: Request, rng: random.Random | None = None) -> Request:
    """The request with a fixed seed, so that both workers sample with the same keys."""
    if request.params.seed is not None:
        return request
    seed = (rng or random.SystemRandom()).randint(0, MAX_SEED)
    return dataclasses.replace(request, params=dataclasses.replace(request.params, seed=seed))


def prefill_request(request: Request) -> Request:
    """What the prefill worker runs: the prompt and the first id, with the pages published.

    With `min_tokens` above 1 the first id can stop nothing: stop ids are banned (min_tokens 1 bans
    them for the first id) and stop strings are not looked for, as in one engine.
    """
    original = request.params
    params = dataclasses.replace(original, max_tokens=1, min_tokens=min(original.min_tokens, 1),
                                 stop=original.stop if original.min_tokens <= 1 else ())
    return dataclasses.replace(request, params=params, publish_kv=True)


def handoff(request: Request, output: RequestOutput, max_model_len: int) -> Handoff:
    """The hand-off of a prefilled `request` (seed fixed) from the prefill worker's output. It is
    finished unless it ended only at `prefill_request`'s one-token limit: at its own max_tokens, or
    at the context's end (`max_model_len` of the prefill worker's engine), it is done here."""
    generated = len(output.token_ids)
    done = output.finish_reason != "length" or at_limit(request, generated, max_model_len)
    return Handoff(request, list(output.token_ids), list(output.logprobs or [0.0] * generated),
                   output.stored_pages, output.finish_reason if done else None, output.text, output.usage.cached_tokens,
                   list(output.top_logprobs or []), output.prompt_logprobs, output.prompt_top_logprobs)


def at_limit(request: Request, generated: int, max_model_len: int) -> bool:
    """Whether a request with `generated` ids has reached its max_tokens or the context's end."""
    return request.params.max_tokens <= generated or len(request.prompt_ids) + generated >= max_model_len


def settled(handoff: Handoff, max_model_len: int) -> Handoff:
    """The hand-off as the decode worker must take it: a peer with another max_model_len may end at
    its context's end a request this worker continues, or pass on one that is done here."""
    if handoff.finish_reason not in (None, "length"):
        return handoff
    done = at_limit(handoff.request, len(handoff.generated_ids), max_model_len)
    return dataclasses.replace(handoff, finish_reason="length" if done else None)


def decode_request(handoff: Handoff) -> Request:
    """What the decode worker runs: the original request, continuing after the generated ids."""
    return dataclasses.replace(handoff.request, generated_ids=list(handoff.generated_ids),
                               generated_logprobs=list(handoff.generated_logprobs),
                               generated_top_logprobs=list(handoff.generated_top_logprobs),
                               scored_prompt_logprobs=handoff.prompt_logprobs,
                               scored_prompt_top_logprobs=handoff.prompt_top_logprobs,
                               stored_pages=handoff.stored_pages)


class PagePublisher:
    """Writes a prefill worker's prompt pages to the KV store while its prefill runs.

    `publish` is called after each step that computed some of a `publish_kv` request's pages is
    dispatched: it queues copies of the newly full prompt pages (after that step, so they read
    what it wrote). `write_ready` hands the copies of read-back steps to the store as background
    writes; `finish` does the rest and waits, before the request's output is returned. Full prompt
    pages are never written again, so copying them while later steps run is safe.
    """

    def __init__(self, runner: ModelRunner, store: PageStore, page_size: int, stats: EngineStats):
        self.runner, self.store, self.page_size, self.stats = runner, store, page_size, stats
        self._copies: list[tuple[int, list[bytes], list[jax.Array]]] = []  # (step, keys, host groups)

    def publish(self, seq: Sequence, step: int) -> None:
        """Queues copies of the newly full prompt pages, after `step` (the one that computed them)."""
        full = min(len(seq.page_keys), len(seq.prompt_ids) // self.page_size)
        if full <= seq.published_pages:
            return
        new = range(seq.published_pages, full)
        seq.published_pages = full
        missing = [i for i in new if seq.page_keys[i] not in self.store]
        if missing:
            groups = self.runner.export_pages([seq.pages[i] for i in missing])
            self._copies.append((step, [seq.page_keys[i] for i in missing], groups))

    def write_ready(self, done_step: int | None = None) -> None:
        """Writes the copies queued after steps up to `done_step` (read back, so the copies are done;
        None: all, waiting for them)."""
        waiting = []
        for step, keys, groups in self._copies:
            if done_step is not None and step > done_step:
                waiting.append((step, keys, groups))
                continue
            for key, page in zip(keys, host_pages(groups), strict=False):  # padding rows have no key
                self.stats.pages_published += self.store.put(key, page.numpy(), wait=False)
        self._copies = waiting

    def finish(self, seq: Sequence) -> int:
        """Writes the request's remaining prompt pages and waits for all; returns how many leading prompt
        pages are stored (a write that failed, timed out or was skipped ends the run: the decode worker
        computes the rest)."""
        self.publish(seq, step=-1)
        self.write_ready()
        self.store.flush()
        return sum(1 for _ in itertools.takewhile(self.store.__contains__, seq.page_keys[: seq.published_pages]))
