"""Prometheus metrics of the server, on their own HTTP port: request outcomes, latencies, and the engine's gauges.

Request-level series are recorded by the servicer as requests run; engine series (queue length,
running sequences, KV pages, prefix hits, preemptions, forged tokens, step time, compiles) are
read from `Engine.metrics()` at scrape time, so they cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineCollector(Collector):
    """Turns `Engine.metrics()` (and the compile counts) into Prometheus families at scrape time."""

    def __init__(self, read: Callable[[], tuple[dict[str, float], int, int] | None]):
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snapshot = self._read()
        if snapshot is None:  # still loading
            return
        m, compiles, compiles_while_serving = snapshot
        gauges = {
            "jaxinfer_queue_length": ("requests waiting for admission", m["waiting"]),
            "jaxinfer_running_sequences": ("sequences in the running batch", m["running"]),
            "jaxinfer_kv_pages_used": ("KV pages in use", m["total_pages"] - m["free_pages"]),
            "jaxinfer_kv_pages_total": ("KV pages in the pool", m["total_pages"]),
            "jaxinfer_prefix_cache_hit_rate": ("prefix-cache hit tokens / queried", m["prefix_hit_rate"]),
            "jaxinfer_step_seconds_mean": ("mean wall time of an engine step", m["step_ms"] / 1000),
            "jaxinfer_host_fraction": ("share of step wall time the host was busy", m["host_fraction"]),
            "jaxinfer_spec_acceptance_rate": ("accepted / proposed draft tokens", m["spec_acceptance_rate"]),
            "jaxinfer_spec_draft_time_share": ("share of step wall time spent proposing", m["spec_draft_share"]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "jaxinfer_preemptions": ("sequences preempted for KV pages", m["preemptions"]),
            "jaxinfer_forged_tokens_downgraded": ("control tokens typed as text", m["forged_tokens_downgraded"]),
            "jaxinfer_engine_steps": ("engine steps run", m["steps"]),
            "jaxinfer_guided_requests": ("requests started with a guided (structured output) constraint",
                                         m["guided_requests"]),
            "jaxinfer_guided_refused_ids": ("sampled ids a guided constraint refused (each ended its request)",
                                            m["guided_refused_ids"]),
            "jaxinfer_prefix_cache_hit_tokens": ("prompt tokens served by the prefix cache", m["prefix_hit_tokens"]),
            "jaxinfer_compiles": ("step executables compiled (warm-up included)", compiles),
            "jaxinfer_xla_compiles_while_serving": ("XLA programs of any kind compiled since serving began "
                                                    "(0 when warm-up covered everything)", compiles_while_serving),
            "jaxinfer_spec_proposed_tokens": ("draft tokens proposed for verification", m["spec_proposed"]),
            "jaxinfer_spec_accepted_tokens": ("draft tokens the target accepted", m["spec_accepted"]),
            "jaxinfer_spec_draft_refilled_tokens": ("draft KV positions recomputed for pages restored from a KV "
                                                    "tier (which holds the target's KV only)",
                                                    m["spec_draft_refilled_tokens"]),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield from self._tiers(m)
        for key, doc in (("weight_bytes", "model parameters on the devices, packed projections at their packed size"),
                         ("kv_pool_bytes", "the KV page pools on the devices")):
            yield GaugeMetricFamily(f"jaxinfer_{key}", doc, value=m[key])
        held = GaugeMetricFamily("jaxinfer_held", "what requests still hold (all 0 when none is left: "
                                 "jaxinfer/engine/held.py)", labels=["resource"])
        for key, value in sorted(m.items()):
            if key.startswith("held_"):
                held.add_metric([key.removeprefix("held_")], value)
        yield held

    @staticmethod
    def _tiers(m: dict[str, float]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Per-tier series with a `tier` label: pages and bytes held, hits (tokens), pages demoted."""
        if "kv_l2_pages" not in m:  # no lower tiers configured
            return
        per_tier = {
            "jaxinfer_kv_tier_pages": (GaugeMetricFamily, "KV pages held by the tier", "kv_{}_pages"),
            "jaxinfer_kv_tier_bytes": (GaugeMetricFamily, "bytes of KV pages held by the tier", "kv_{}_bytes"),
            "jaxinfer_kv_tier_hit_tokens": (CounterMetricFamily, "prompt tokens restored from the tier",
                                            "prefix_hit_tokens_{}"),
            "jaxinfer_kv_tier_demoted_pages": (CounterMetricFamily, "pages moved down into the tier",
                                               "kv_demoted_{}"),
        }
        for name, (family, doc, key) in per_tier.items():
            metric = family(name, doc, labels=["tier"])
            for tier in ("l2", "l3"):
                metric.add_metric([tier], m[key.format(tier)])
            yield metric
        yield CounterMetricFamily("jaxinfer_kv_store_reads", "asynchronous KV store reads", value=m["store_reads"])
        yield CounterMetricFamily("jaxinfer_kv_store_read_seconds", "time from read start to admission",
                                  value=m["store_read_seconds"])
        yield CounterMetricFamily("jaxinfer_kv_store_corrupt", "stored pages dropped for a bad checksum or size",
                                  value=m.get("kv_l3_corrupt", 0))
        yield CounterMetricFamily("jaxinfer_kv_store_timeouts",
                                  "store reads and writes not done within kv_store_timeout_seconds",
                                  value=m.get("kv_l3_timeouts", 0))
        yield CounterMetricFamily("jaxinfer_kv_store_evicted", "stored pages removed by the capacity limit",
                                  value=m.get("kv_l3_evicted", 0))
        yield CounterMetricFamily("jaxinfer_kv_pages_published",
                                  "prompt pages a prefill worker began writing to the KV store",
                                  value=m["pages_published"])


# The final statuses of a Generate or Prefill call (the `status` label of jaxinfer_requests_total);
# `unauthenticated` and `unavailable` (loading or draining) are refused before anything else.
REQUEST_STATUSES = ("ok", "invalid", "limited", "error", "cancelled", "unauthenticated", "unavailable")


class ServerMetrics:
    def __init__(self, read_engine: Callable[[], tuple[dict[str, float], int, int] | None]):
        self.registry = CollectorRegistry()
        self.requests = Counter("jaxinfer_requests", "Generate and Prefill calls by final status", ["status"],
                                registry=self.registry)
        for status in REQUEST_STATUSES:  # every series exists from the start at 0, so rates need no first event
            self.requests.labels(status=status)
        self.ttft = Histogram("jaxinfer_time_to_first_token_seconds", "request arrival to first streamed token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("jaxinfer_inter_token_latency_seconds", "time between streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("jaxinfer_prompt_tokens", "prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("jaxinfer_generation_tokens", "tokens streamed", registry=self.registry)
        self.registry.register(EngineCollector(read_engine))
        self._http = None

    def serve(self, host: str, port: int) -> int:
        """Starts the HTTP endpoint (`/metrics`) in a daemon thread; returns its port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
