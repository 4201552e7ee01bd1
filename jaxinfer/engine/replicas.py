"""Data-parallel replicas: several engines, each on its own submesh, behind one engine interface.

With `engine.mesh_data = D` every data row of the ('data', 'expert', 'model') mesh is an independent replica: its
own copy of the weights (sharded over its row's devices), its own KV pages, scheduler and processor
slots. A request goes to the replica that already holds the longest prefix of its prompt (cached
or being computed), else to the least loaded; requests of one exec session always go to the same
replica, which keeps that session's memory. `step` steps every replica in turn: a step returns
once it is dispatched, so the replicas' devices compute at the same time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import fields

from jaxinfer.engine.adapters import AdapterInfo, ReadAdapter
from jaxinfer.engine.engine import Engine, run_to_completion
from jaxinfer.engine.executor import tenant_of
from jaxinfer.engine.held import distinct_runners, held_resources, summed
from jaxinfer.engine.metrics import EngineStats, snapshot
from jaxinfer.engine.params import Request, RequestOutput, SamplingParams
from jaxinfer.engine.sequence import Sequence
from jaxinfer.kv.prefix_cache import chain_keys


class ReplicaStepFailed(Exception):
    """Some replicas' steps raised: `finished` holds what the others finished in the step, and only
    the failed replicas' requests (`failed_request`) are lost. `all_failed`: no replica is left."""

    def __init__(self, finished: list[RequestOutput], errors: dict[int, Exception], num_replicas: int,
                 all_failed: bool):
        super().__init__("; ".join(f"replica {replica}: {error!r}" for replica, error in sorted(errors.items())))
        self.finished, self.errors, self.num_replicas, self.all_failed = finished, errors, num_replicas, all_failed

    def failed_request(self, index: int) -> bool:
        return index % self.num_replicas in self.errors


class ReplicaSet:
    """Engines built with `first_index=r, index_stride=len(engines)`: a request's index names its replica."""

    def __init__(self, engines: list[Engine]):
        self.engines = engines
        self.tokenizer = engines[0].tokenizer
        self.cfg = engines[0].cfg
        self.runner = engines[0].runner  # the first replica's (for what every replica has alike)
        self.failed: set[int] = set()  # replicas whose step raised: taken out of routing for good
        for engine in engines[1:]:  # one cache of compiled constraints for all (each loads its own device tables)
            engine.runner.guide_compiler = engines[0].guide_compiler()
            engine.runner.grammar_matchers = engines[0].grammar_matchers()

    # -- routing ----------------------------------------------------------------------------------
    def route(self, request: Request) -> Engine:
        """The replica for a new request, among those that have not failed (ReplicaStepFailed)."""
        healthy = [engine for replica, engine in enumerate(self.engines) if replica not in self.failed]
        if not healthy:
            raise RuntimeError("every replica has failed (ReplicaStepFailed): none can take a request")
        session = request.params.exec_session if request.params.exec else ""
        if session:
            digest = hashlib.sha256(f"{tenant_of(request)}\x00{session}".encode()).digest()
            return healthy[int.from_bytes(digest[:4], "big") % len(healthy)]
        keys = self._prompt_keys(request)
        return max(healthy, key=lambda engine: (self._held_pages(engine, keys), -self._load(engine)))

    def _prompt_keys(self, request: Request) -> list[bytes]:
        """The prompt's full-page prefix keys: the same on every replica (adapters are loaded on all)."""
        first = self.engines[0]
        if not first.prefix_caching:
            return []
        return chain_keys(request.prompt_ids, self.cfg.page_size, first.prefix_salt(request))

    @staticmethod
    def _held_pages(engine: Engine, keys: list[bytes]) -> int:
        """Leading pages of the prompt that the replica holds or is computing."""
        count = 0
        for key in keys:
            if key not in engine.pool and not engine.scheduler.computing(key):
                break
            count += 1
        return count

    @staticmethod
    def _load(engine: Engine) -> int:
        scheduler = engine.scheduler
        return sum(seq.num_tokens - seq.num_computed + 1 for seq in (*scheduler.running, *scheduler.waiting))

    def _owner(self, index: int) -> Engine:
        return self.engines[index % len(self.engines)]

    # -- the engine interface -------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        self.engines[0].validate(request)

    def prefetch_guided(self, params: Iterable[SamplingParams]) -> None:
        self.engines[0].prefetch_guided(params)

    def add_request(self, request: Request) -> Sequence:
        return self.route(request).add_request(request)

    def generate(self, requests: list[Request], on_finish: Callable[[RequestOutput], None] | None = None
                 ) -> list[RequestOutput]:
        self.prefetch_guided(request.params for request in requests)
        for request in requests:
            self.validate(request)
        sequences = [self.route(request).add_request(request) for request in requests]
        return run_to_completion(self, sequences, on_finish)

    def has_unfinished(self) -> bool:
        return any(engine.has_unfinished() for engine in self.engines)

    @property
    def num_requests(self) -> int:
        """Requests added and not finished, over every replica."""
        return sum(engine.num_requests for engine in self.engines)

    @property
    def max_running(self) -> int:
        """Requests that run at once: every replica's `max_seqs`."""
        return sum(engine.max_running for engine in self.engines)

    def step(self) -> list[RequestOutput]:
        """Steps every replica; one that fails spares the others (see `ReplicaStepFailed`)."""
        finished: list[RequestOutput] = []
        failed: dict[int, Exception] = {}
        for replica, engine in enumerate(self.engines):
            try:
                if engine.has_unfinished():
                    finished += engine.step()
            except Exception as exc:
                failed[replica] = exc
        if failed:
            self.failed |= set(failed)
            raise ReplicaStepFailed(finished, failed, len(self.engines), len(self.failed) == len(self.engines))
        return finished

    def abort(self, index: int) -> RequestOutput | None:
        return self._owner(index).abort(index)

    def discard_inflight(self) -> None:
        for engine in self.engines:
            engine.discard_inflight()

    def adapter_name(self, request: Request) -> str:
        return self.engines[0].adapter_name(request)

    def shown_special_ids(self, params: SamplingParams) -> frozenset[int]:
        return self.engines[0].shown_special_ids(params)

    @property
    def prefix_caching(self) -> bool:
        return self.engines[0].prefix_caching

    def persist_prefix_cache(self) -> None:
        for engine in self.engines:
            engine.persist_prefix_cache()

    # -- adapters: resident on every replica ----------------------------------------------------------
    def load_adapter(self, name: str, source: str = "", read: ReadAdapter | None = None) -> AdapterInfo:
        loaded: list[Engine] = []
        try:
            for engine in self.engines:
                info = engine.load_adapter(name, source, read)
                loaded.append(engine)
        except BaseException:
            for engine in loaded:  # all or none: a name means the same adapter on every replica
                engine.unload_adapter(name)
            raise
        return info

    def unload_adapter(self, name: str) -> None:
        def users(engine: Engine) -> int:
            return next((info.users for info in engine.list_adapters() if info.name == name), 0)

        # Refused while in use: a replica using it goes first, so a refusal comes before any change.
        for engine in sorted(self.engines, key=users, reverse=True):
            engine.unload_adapter(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.engines[0].list_adapters()

    # -- metrics ----------------------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """Every replica's counters added up (steps count each replica's steps)."""
        total = EngineStats()
        for engine in self.engines:
            for field in fields(EngineStats):
                setattr(total, field.name, getattr(total, field.name) + getattr(engine.stats, field.name))
        return total

    def metrics(self) -> dict[str, float]:
        schedulers = [engine.scheduler for engine in self.engines]
        return {**snapshot(self.stats, sum(len(s.running) for s in schedulers), sum(len(s.waiting) for s in schedulers),
                           sum(e.pool.num_free for e in self.engines), sum(e.pool.capacity for e in self.engines)),
                **held_resources(self), "replicas": len(self.engines),
                **summed(runner.device_bytes() for runner in distinct_runners(self.engines))}

