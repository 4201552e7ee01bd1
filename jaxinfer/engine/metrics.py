"""The engine's counters (monotonic totals) and the gauges derived from them for monitoring."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    steps: int = 0
    tokens_scheduled: int = 0  # real (unpadded) tokens over all steps
    padded_tokens: int = 0  # bucket sizes over all steps
    prompt_tokens_computed: int = 0
    preemptions: int = 0
    step_seconds: float = 0.0  # wall time inside Engine.step
    host_seconds: float = 0.0  # of which the host was busy (scheduling, batch building, post-processing)
    forged_tokens_downgraded: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0  # all tiers
    prefix_hit_tokens_l2: int = 0  # of which restored from host memory
    prefix_hit_tokens_l3: int = 0  # of which restored from the tensorstore tier
    store_reads: int = 0  # asynchronous KV store reads started for waiting requests
    store_read_seconds: float = 0.0  # from each read's start until the scheduler saw it done
    spec_proposed: int = 0  # draft tokens proposed for verification
    spec_accepted: int = 0  # of which the target accepted
    spec_rounds: int = 0  # row-rounds that speculated (each emits its accepted proposals plus one token)
    spec_draft_calls: int = 0  # draft propose calls (one position each, over the speculating rows)
    spec_draft_refilled_tokens: int = 0  # draft KV computed for restored pages (the tiers hold the target's)
    spec_draft_seconds: float = 0.0  # wall time of the proposal loops (part of step_seconds)
    pages_published: int = 0  # prompt pages a prefill worker began writing to the KV store (failed ones too)
    aborted: int = 0
    discarded_samples: int = 0  # ids sampled for a sequence that had finished meanwhile (overlap's cost)
    exec_programs: int = 0  # programs run for requests with exec on (results and traps)
    exec_traps: int = 0  # of which ended in a trap (including compile errors, limits and timeouts)
    exec_idle_steps: int = 0  # machine-only steps: programs running while no sequence had tokens to compute
    guided_requests: int = 0  # sequences started with a `guided` constraint
    guided_refused_ids: int = 0  # sampled ids the constraint refused (each ends its request: see docs/guided.md)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def snapshot(
    stats: EngineStats, running: int, waiting: int, free_pages: int, total_pages: int,
    tiers: dict[str, float] | None = None,
) -> dict[str, float]:
    """Counters plus gauges: queue lengths, pages, per-step averages, and the lower KV tiers' gauges."""
    steps = max(stats.steps, 1)
    queried = stats.prefix_queried_tokens
    return {
        **stats.as_dict(),
        "running": running,
        "waiting": waiting,
        "free_pages": free_pages,
        "total_pages": total_pages,
        "tokens_per_step": stats.tokens_scheduled / steps,
        "step_ms": 1000 * stats.step_seconds / steps,
        "host_ms_per_step": 1000 * stats.host_seconds / steps,
        "host_fraction": stats.host_seconds / stats.step_seconds if stats.step_seconds else 0.0,
        "prefix_hit_rate": stats.prefix_hit_tokens / queried if queried else 0.0,
        "spec_acceptance_rate": stats.spec_accepted / stats.spec_proposed if stats.spec_proposed else 0.0,
        "spec_tokens_per_round": (stats.spec_accepted + stats.spec_rounds) / stats.spec_rounds
        if stats.spec_rounds else 0.0,
        "spec_draft_share": stats.spec_draft_seconds / stats.step_seconds if stats.step_seconds else 0.0,
        **(tiers or {}),
    }
