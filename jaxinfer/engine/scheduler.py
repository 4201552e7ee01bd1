"""Which tokens each step computes: the waiting and running queues, page allocation, prefix reuse, preemption.

Each step takes one decode token from every running sequence, oldest first, then fills the rest
of the token budget with prompt chunks of waiting sequences, oldest request first (first come,
first served). A long prompt is cut into chunks, so it never holds up decoding for more than one
step. A sequence that needs a page when none is free preempts the newest running sequence, which
gives its pages back and later recomputes its prompt and output so far.

Prefix cache: on admission a sequence takes the longest chain of cached full pages (keys from
`kv/prefix_cache.py`) and computes only the rest; every full page whose ids are known is
published. When the first missing page is being computed by a running sequence (one long system
prompt shared by a batch), the newcomer waits for it instead of computing it again. A sequence whose
prompt is being scored (prompt_logprobs) takes cached pages only as far as it was scored: a cached
page is not computed, so it could not be scored.

Lower KV tiers: the chain continues in L2 (host memory, read at once) and L3 (the KV store). Pages
the store holds are read asynchronously: the sequence stays in the queue, others keep running,
and it is admitted once the read is done (`store_reads`); pages a prefill worker wrote for a
request (`Request.stored_pages`) are read even before this process's store index knows them.

Overlapped scheduling: a running sequence whose newest id is still on the device is scheduled
like any other (the step reads that id on the device); one that already has `max_tokens` ids
counting those in flight is not. A preempted sequence with an id in flight waits in the queue
until the id is read back.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.engine.metrics import EngineStats
from jaxinfer.engine.sequence import ScheduledChunk, Sequence
from jaxinfer.kv.prefix_cache import PrefixCachingPool, chain_keys
from jaxinfer.kv.store import PageStore
from jaxinfer.kv.tiers import HostPage, TieredPages

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self, cfg: EngineConfig, pool: PrefixCachingPool, max_model_len: int, prefix_caching: bool, stats: EngineStats
    ):
        self.cfg, self.pool, self.max_model_len, self.stats = cfg, pool, max_model_len, stats
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._pending: dict[bytes, Sequence] = {}  # page key -> the running sequence that will compute it
        self._arrivals = 0
        self.tiers: TieredPages | None = None  # L2/L3 below the device pool (kv/tiers.py)
        # Writes restored pages into their device pages (set by the engine): called as soon as they are
        # allocated, after the pages those allocations evicted are copied out.
        self.write_pages: Callable[[list[tuple[int, HostPage | np.ndarray]]], None] | None = None
        # What the engine gives a sequence besides pages (a penalty slot): `claim` on admission (False: it
        # waits), `on_release` whenever it gives its pages back (finished, preempted, or not admitted).
        self.claim: Callable[[Sequence], bool] = lambda seq: True
        self.on_release: Callable[[Sequence], None] = lambda seq: None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def computing(self, key: bytes) -> bool:
        """Whether a running sequence will compute the page with this prefix key."""
        return key in self._pending

    def wait_for_store(self) -> bool:
        """Blocks until a KV store read of a waiting sequence is done; False if none is under way."""
        reading = next((s.store_read for s in self.waiting if s.store_read is not None), None)
        if reading is not None:
            reading.wait()
        return reading is not None

    def find(self, index: int) -> Sequence | None:
        return next((s for queue in (self.waiting, self.running) for s in queue if s.index == index), None)

    def finish(self, seq: Sequence) -> None:
        """Takes a finished or cancelled sequence out of its queue and frees its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def accounting_errors(self, other_holders: Iterable[int] = ()) -> list[str]:
        """The page books checked against the sequences (empty when sound): waiting sequences hold no
        pages, every page's references are its running holders (plus `other_holders`, pages held
        outside the scheduler), and every page a sequence waits for has a running owner."""
        holders = collections.Counter(itertools.chain(other_holders, *(seq.pages for seq in self.running)))
        errors = [f"waiting request {seq.index} holds pages {seq.pages}" for seq in self.waiting if seq.pages]
        errors += [f"a pending page's owner, request {seq.index}, is not running"
                   for seq in set(self._pending.values()) if seq not in self.running]
        return errors + self.pool.accounting_errors(holders)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self, draft_room: Callable[[ScheduledChunk], int] | None = None) -> list[ScheduledChunk]:
        """The chunks of the next step; `draft_room(chunk)` tokens of the budget are kept for each
        running chunk (its speculative proposals, which `reserve` gives pages to) before admitting."""
        budget, reserved = self.cfg.max_tokens_per_step, 0
        chunks: list[ScheduledChunk] = []
        preempted: set[Sequence] = set()  # a set: `in running` would walk the list for every sequence
        for seq in sorted(self.running, key=lambda s: s.arrival):
            count = min(seq.num_tokens - seq.num_computed, budget)
            if (seq in preempted or count == 0 or seq.paused or seq.held_for_mask
                    or not seq.wants_token(self.max_model_len)):
                continue
            while not self._pages_for(seq, seq.num_computed + count):
                victim = max(self.running, key=lambda s: s.arrival)
                # The newest is never scheduled yet in this step (running is walked oldest first).
                self._preempt(victim)
                preempted.add(victim)
                if victim is seq:
                    break
            if seq not in preempted:
                chunk = ScheduledChunk(seq, seq.num_computed, count)
                chunks.append(chunk)
                budget -= count
                reserved += draft_room(chunk) if draft_room else 0
        chunks += self._admit(max(0, budget - reserved))
        return chunks

    def reserve(self, seq: Sequence, upto: int) -> bool:
        """Pages for positions < upto if the pool has them now (no preemption); False otherwise."""
        return self._pages_for(seq, upto)

    def trim(self, seq: Sequence) -> None:
        """Gives back pages past the sequence's tokens (reserved for proposals that were rejected)."""
        keep = math.ceil(seq.num_tokens / self.cfg.page_size)
        if len(seq.pages) > keep:
            self.pool.free(seq.pages[keep:])
            del seq.pages[keep:]

    def _admit(self, budget: int) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        deferred: list[Sequence] = []  # an id still in flight, or the next prefix page is being computed
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_seqs:
            seq = self.waiting.popleft()
            if seq.inflight or seq.paused or self._exec_capped(seq) or not self._attach_prefix(seq):
                deferred.append(seq)
                continue
            if not self.claim(seq):
                self._release(seq)  # the prefix pages it just took
                deferred.append(seq)
                continue
            count = min(seq.num_tokens - seq.num_computed, budget)
            if not self._pages_for(seq, seq.num_computed + count):
                self._release(seq)
                self.waiting.appendleft(seq)
                break
            self._arrivals += 1
            seq.arrival = self._arrivals
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed, count))
            budget -= count
        self.waiting.extendleft(reversed(deferred))
        return chunks

    def _exec_capped(self, seq: Sequence) -> bool:
        """Requests with exec on wait while engine.exec_max_running of them run (others pass them)."""
        cap = self.cfg.exec_max_running
        return bool(cap and seq.params.exec and sum(s.params.exec for s in self.running) >= cap)

    # -- pages -------------------------------------------------------------------------------
    def _pages_for(self, seq: Sequence, upto: int) -> bool:
        """Makes sure `seq` owns pages for positions < upto; False if the pool cannot."""
        needed = math.ceil(upto / self.cfg.page_size) - len(seq.pages)
        if needed <= 0:
            return True
        pages = self.pool.allocate(needed)
        if pages is None:
            return False
        seq.pages += pages
        return True

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self._release(victim)
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1
        log.info("preempted request %d (%d tokens to recompute)", victim.index, victim.num_tokens)

    def _release(self, seq: Sequence) -> None:
        self.on_release(seq)
        self.pool.free(seq.pages)
        seq.pages, seq.page_keys, seq.num_computed, seq.published_pages = [], [], 0, 0
        for key in seq.pending_keys:
            if self._pending.get(key) is seq:
                del self._pending[key]
        seq.pending_keys = []

    # -- prefix cache ------------------------------------------------------------------------
    def _attach_prefix(self, seq: Sequence) -> bool:
        """Takes the longest cached prefix; False (nothing taken) while the next page is in flight
        (computed by a running sequence, or being read from the KV store).

        At least one token is always left to compute, so the step has a row to sample from. If the
        first page still missing is being computed by a running sequence (a shared system prompt
        in one batch), waiting for it is cheaper than computing it twice.
        """
        page_size = self.cfg.page_size
        # With the cache off nothing is looked up or waited for: no keys, so no pending pages either.
        keys = chain_keys(seq.tokens(0, seq.num_tokens), page_size, seq.cache_salt) if self.prefix_caching else []
        usable = (seq.num_tokens - 1) // page_size if self.prefix_caching else 0
        if seq.scoring_prompt:  # only pages whose positions were scored already
            usable = min(usable, seq.prompt_scored // page_size)
        if self._reading_store(seq, keys[:usable]):
            return False
        pages = self.pool.lookup(keys[:usable])
        pages += self._restore(seq, keys[len(pages) : usable])
        owner = self._pending.get(keys[len(pages)]) if len(pages) < usable else None
        if owner is not None and owner is not seq:
            self.pool.free(pages)
            return False
        if seq.store_read is not None:
            self.stats.store_read_seconds += seq.store_read.seconds
            seq.store_read = None
        seq.pages, seq.page_keys, seq.num_computed = pages, keys[: len(pages)], len(pages) * page_size
        seq.pending_keys = [k for k in keys[len(pages) :] if self._pending.setdefault(k, seq) is seq]
        if seq.cached_tokens < 0:
            seq.cached_tokens = min(seq.num_computed, len(seq.prompt_ids))
            self.stats.prefix_queried_tokens += len(seq.prompt_ids)
            self.stats.prefix_hit_tokens += seq.cached_tokens
        return True

    def _reading_store(self, seq: Sequence, keys: list[bytes]) -> bool:
        """Starts or polls the KV store read of the pages after those in the pool and L2; True while it runs."""
        store = self.tiers.store if self.tiers is not None else None
        if store is None:
            return False
        if seq.store_read is None:
            first = next((i for i, k in enumerate(keys) if k not in self.pool and not self.tiers.in_host(k)),
                         len(keys))
            # Pages a prefill worker wrote for this request may not be in this process's index yet.
            wanted = self._contiguous(keys, first, seq.request.stored_pages, store)
            if not wanted:
                return False
            seq.store_read = store.read_async(wanted)
            self.stats.store_reads += 1
            return True  # admitted at a later step, never in the one that started the read
        return not seq.store_read.done()

    @staticmethod
    def _contiguous(keys: list[bytes], first: int, hinted: int, store: PageStore) -> list[bytes]:
        """keys[first:] as far as each is hinted or in the store's index."""
        end = first
        while end < len(keys) and (end < hinted or keys[end] in store):
            end += 1
        return keys[first:end]

    def _restore(self, seq: Sequence, keys: list[bytes]) -> list[int]:
        """Continues a prefix hit in the lower tiers: each page found gets a device page and is registered.

        The contents are written at once (`write_pages`), so a restored page that is evicted again
        before the next step is copied out with its real content. The pages are referenced once,
        like `pool.lookup`'s, and counted as hits of their tier.
        """
        from_store = seq.store_read.pages() if seq.store_read is not None else {}
        pages: list[int] = []
        writes: list[tuple[int, HostPage | np.ndarray]] = []
        for key in keys if self.tiers is not None else ():
            data, tier = self.tiers.host_page(key), "l2"
            if data is None:
                data, tier = from_store.get(key), "l3"
            if data is None:
                break
            fresh = self.pool.allocate(1)
            if fresh is None:
                break
            self.pool.register(fresh[0], key)
            writes.append((fresh[0], data))
            pages += fresh
            if tier == "l2":
                self.stats.prefix_hit_tokens_l2 += self.cfg.page_size
            else:
                self.stats.prefix_hit_tokens_l3 += self.cfg.page_size
        if writes:
            try:
                self.write_pages(writes)
            except Exception:  # the pages hold no valid content: nobody may find them, and they go back
                for page in pages:
                    self.pool.forget(page)
                self.pool.free(pages)
                raise
            self.pool.restored.update(pages)
        return pages

    def publish_pages(self, seq: Sequence) -> None:
        """Registers the full pages computed (or dispatched) whose ids are known, so later requests reuse them."""
        page_size, done = self.cfg.page_size, len(seq.page_keys)
        full = min(seq.num_computed, seq.num_known) // page_size
        if full <= done or not self.prefix_caching:
            return
        tokens = seq.tokens(done * page_size, (full - done) * page_size)
        start = seq.page_keys[-1] if seq.page_keys else b""
        for i, key in enumerate(chain_keys(tokens, page_size, seq.cache_salt, start), start=done):
            self.pool.register(seq.pages[i], key)
            if self._pending.get(key) is seq:
                del self._pending[key]
            seq.page_keys.append(key)
