"""Prometheus metrics of a raysched deployment, as `GET /metrics` serves them (torch-free).

Series (all prefixed ``raysched_``): per-worker pool occupancy (KV tokens used fraction, Mamba
slots used), requests running / waiting / retracted, and cumulative counters from the scheduler
(requests, tokens, retractions, resumes, migrations, snapshot bytes, worker failures, hand-overs and
their bytes, prefill tokens by worker role, prefix reuse: hits by kind, misses, cached tokens,
evictions, bytes parked), each worker's role and the hand-over latency p50/p99, read from
`Scheduler.stats()` at scrape time; plus TTFT and end-to-end latency histograms of the requests
this server answered (the scheduler's own timings), and client disconnects: requests this server
aborted because the HTTP client left before they ended (a part of `requests_aborted`; a client
that leaves after its request ended is not counted, as there was nothing to abort).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # no *_created series: they only add noise to a scrape

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
COUNTERS = {  # scheduler stats key -> (series name, help)
    "submitted": ("requests_submitted", "requests accepted by the scheduler"),
    "finished": ("requests_finished", "requests that ended normally"),
    "aborted": ("requests_aborted", "requests aborted (client disconnects included)"),
    "tokens": ("generated_tokens", "tokens generated"),
    "retractions": ("retractions", "requests retracted under memory pressure"),
    "resumes": ("resumes", "retracted requests resumed"),
    "migrations": ("migrations", "resumes on another worker"),
    "snapshot_bytes": ("snapshot_bytes", "bytes of snapshots taken"),
    "worker_failures": ("worker_failures", "worker calls that failed"),
    "handovers": ("handovers", "prefilled requests handed from a prefill worker to a decode worker"),
    "handover_bytes": ("handover_bytes", "bytes of hand-over snapshots"),
    "state_cache_misses": ("prefix_cache_misses", "admissions that prefilled their whole prompt (prefix reuse on)"),
    "state_cache_tokens_reused": ("prefix_cached_tokens", "prompt tokens restored from a parked prefix, not prefilled"),
    "state_cache_evictions": ("prefix_cache_evictions", "parked prefix points evicted"),
}
HIT_KINDS = ("chunk", "prompt", "finished")  # where a restored point lay: a chunk boundary of a
#   shared prefix, a prompt's end, a finished turn (`state_cache_hits_<kind>` in the stats)


class ServeMetrics:
    """Histograms kept by the server, plus a collector that turns the latest scheduler stats
    into gauges and counters when scraped."""

    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, workers: list[dict]) -> None:
        self.totals = {w["worker"]: (w["kv_tokens"], w["state_slots"]) for w in workers}
        self.registry = CollectorRegistry()
        self.ttft = Histogram("raysched_ttft_seconds", "time to first token", buckets=LATENCY_BUCKETS,
                              registry=self.registry)
        self.latency = Histogram("raysched_request_latency_seconds", "submit to last token",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.disconnects = 0  # requests aborted because their HTTP client left (see count_disconnect)
        self._lock = threading.Lock()
        self._stats: dict = {}
        self.registry.register(self)

    def observe(self, record: dict) -> None:
        """Count one ended request's timings (finished ones only)."""
        if record.get("state") != "finished":
            return
        if record.get("ttft_s") is not None:
            self.ttft.observe(record["ttft_s"])
        if record.get("latency_s") is not None:
            self.latency.observe(record["latency_s"])

    def count_disconnect(self) -> None:
        """One request aborted because its client left (not counted: a client that left after
        its request had ended; there was nothing to abort). Called from the abort threads."""
        with self._lock:
            self.disconnects += 1

    def render(self, stats: dict) -> bytes:
        self._stats = stats
        return generate_latest(self.registry)

    def collect(self):  # the prometheus_client collector protocol
        s = self._stats
        if not s:
            return
        yield from self._pool_gauges(s)
        tables = GaugeMetricFamily("raysched_requests", "requests by state", labels=["state"])
        for state in ("running", "waiting", "retracted"):
            tables.add_metric([state], s["tables"][state])
        yield tables
        for key, (name, text) in COUNTERS.items():
            yield CounterMetricFamily(f"raysched_{name}", text, value=s.get(key, 0))
        yield CounterMetricFamily("raysched_client_disconnects",
                                  "requests aborted because the HTTP client left before they ended",
                                  value=self.disconnects)
        yield GaugeMetricFamily("raysched_workers_alive", "live worker actors", value=s.get("workers_alive", 0))
        yield from _prefix_series(s)
        yield from _role_series(s)

    def _pool_gauges(self, s: dict):
        kv = GaugeMetricFamily("raysched_pool_kv_used_ratio", "KV pool occupancy per worker", labels=["worker"])
        mamba = GaugeMetricFamily("raysched_pool_mamba_slots_used", "Mamba slots in use per worker",
                                  labels=["worker"])
        for w in s["workers"]:
            if w["worker"] not in self.totals:  # a replacement started after this server
                continue
            kv_total, slots_total = self.totals[w["worker"]]
            kv.add_metric([str(w["worker"])], 1.0 - w["free_tokens"] / kv_total)
            mamba.add_metric([str(w["worker"])], slots_total - w["free_slots"])
        yield kv
        yield mamba


def _prefix_series(s: dict):
    """Prefix reuse: hits by the kind of point restored, and the bytes parked now."""
    hits = CounterMetricFamily("raysched_prefix_cache_hits", "admissions that restored a parked prefix, by kind",
                               labels=["kind"])
    for kind in HIT_KINDS:
        hits.add_metric([kind], s.get(f"state_cache_hits_{kind}", 0))
    yield hits
    yield GaugeMetricFamily("raysched_prefix_cache_bytes", "bytes of parked prefixes (K/V blocks and states)",
                            value=s.get("state_cache_bytes", 0))


def _role_series(s: dict):
    """Prefill tokens by worker role, each worker's role, and the hand-over latency quantiles."""
    prefill = CounterMetricFamily("raysched_prefill_tokens", "prompt tokens prefilled, by worker role",
                                  labels=["role"])
    for role, tokens in sorted(s.get("prefill_tokens_by_role", {}).items()):
        prefill.add_metric([role], tokens)
    yield prefill
    roles = GaugeMetricFamily("raysched_worker_role", "1 for each worker's role", labels=["worker", "role"])
    for w in s["workers"]:
        roles.add_metric([str(w["worker"]), w.get("role", "both")], 1)
    yield roles
    latency = GaugeMetricFamily("raysched_handover_latency_seconds", "hand-over latency (sent to restored)",
                                labels=["quantile"])
    for q in ("p50", "p99"):
        value = s.get(f"handover_latency_{q}_s")
        if value is not None:
            latency.add_metric([q], value)
    yield latency
