"""Counters and the occupancy timeline the scheduler keeps (torch-free)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from raysched.messages import StepResult
from raysched.request import Request, State


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile `q` (0-100) of `values`; None when there are none."""
    if not values:
        return None
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


@dataclass
class Counters:
    submitted: int = 0
    finished: int = 0
    aborted: int = 0
    readers_lost: int = 0  # requests aborted because their reader's sink died (its process left)
    failed: int = 0
    tokens: int = 0
    calls: int = 0
    pipelined_calls: int = 0  # successors sent as a second call before the first returned
    folded_calls: int = 0  # calls that ran their successor's decode steps too (`fold_successor`)
    joins: int = 0  # requests sent to start inside a long call (`scheduler.join_long_calls`)
    joins_refused: int = 0  # of those, the ones the call had no room for (they wait again)
    joins_late: int = 0  # of those, the ones that came after the call's decoding ended (the same)
    finish_notices: int = 0  # requests that finished inside a long call that went on (`StepPlan.notices`)
    retractions: int = 0
    retractions_snapshot: int = 0
    retractions_recompute: int = 0
    preemptions: int = 0  # retractions made to admit a more urgent request
    resumes: int = 0
    resumes_snapshot: int = 0
    resumes_recompute: int = 0
    migrations: int = 0
    cross_node_migrations: int = 0
    snapshot_bytes: int = 0  # through the object store, in total
    snapshot_bytes_held_peak: int = 0  # most bytes of snapshots waiting (or in flight) at once
    snapshots_refused: int = 0
    snapshots_lost: int = 0  # unreadable at resume (node lost, retraction failed): recomputed
    resume_bytes_moved: int = 0  # snapshot bytes sent between nodes by resumes
    resume_bytes_via_scheduler: int = 0  # what the former flow (worker -> scheduler -> worker) moved
    worker_failures: int = 0
    workers_replaced: int = 0
    recovered: int = 0
    store_pressure_fallbacks: int = 0
    state_cache_hits: int = 0  # admissions that restored a parked state
    state_cache_hits_finished: int = 0  # ... of a finished turn
    state_cache_hits_prompt: int = 0  # ... of a prompt's end
    state_cache_hits_chunk: int = 0  # ... of a prefill chunk boundary (a shared prefix)
    state_cache_hits_same_worker: int = 0  # hits whose point lay on the worker that restored it
    state_cache_hits_same_node: int = 0  # ... on another worker of the same node
    state_cache_hits_other_node: int = 0  # ... on another node (read over the network)
    state_cache_misses: int = 0  # admissions (with the cache on) that prefilled in full
    state_cache_tokens_reused: int = 0  # prompt tokens restored instead of prefilled
    state_cache_fallbacks: int = 0  # hits whose parked state was lost or refused: full prefill
    resubmitted: int = 0  # requests resubmitted to this (restarted) scheduler by their clients
    resubmitted_tokens: int = 0  # tokens they carried (received before the restart)
    handovers: int = 0  # prefilled requests snapshotted for a decode worker (roles)
    handover_bytes: int = 0
    prefill_tokens_by_role: dict = field(default_factory=dict)  # role -> prompt tokens prefilled
    handover_latencies_s: deque = field(default_factory=lambda: deque(maxlen=20000))  # send -> restored
    live_migrations: int = 0  # requests moved by live migration (pre-copy + stop-and-copy)
    snapshot_migrations: int = 0  # ... by a blocking snapshot copy (too many stages, or drain)
    migrations_abandoned: int = 0  # migrations that left the request where it was (or recovered it)
    migration_precopy_bytes: int = 0
    migration_final_bytes: int = 0
    rebalance_moves: int = 0  # migrations the rebalancer started
    autoscale_grows: int = 0  # workers the autoscale policy added
    autoscale_shrinks: int = 0  # idle workers it drained and removed
    downtimes_s: deque = field(default_factory=lambda: deque(maxlen=4096))  # stop-and-copy durations
    busy_s: float = 0.0
    started_s: float = field(default_factory=time.monotonic)
    timeline: deque = field(default_factory=lambda: deque(maxlen=20000))
    decision_s: deque = field(default_factory=lambda: deque(maxlen=20000))  # per worker call: decide +
    #   send (the scheduler's time from a worker's wake-up to its call leaving), most recent first out
    decision_cpu_s: deque = field(default_factory=lambda: deque(maxlen=20000))  # the same, in the
    #   scheduler thread's CPU time: what is left when the OS runs other processes in between

    def on_retract(self, recompute: bool) -> None:
        self.retractions += 1
        if recompute:
            self.retractions_recompute += 1
        else:
            self.retractions_snapshot += 1

    def note_snapshot_bytes_held(self, nbytes: int) -> None:
        self.snapshot_bytes_held_peak = max(self.snapshot_bytes_held_peak, nbytes)

    def on_resume(self, recompute: bool, migrated: bool, cross_node: bool) -> None:
        self.resumes += 1
        self.resumes_recompute += recompute
        self.resumes_snapshot += not recompute
        self.migrations += migrated
        self.cross_node_migrations += cross_node

    def on_resume_bytes(self, moved: int, via_scheduler: int) -> None:
        self.resume_bytes_moved += moved
        self.resume_bytes_via_scheduler += via_scheduler

    def on_prefill(self, role: str, tokens: int) -> None:
        self.prefill_tokens_by_role[role] = self.prefill_tokens_by_role.get(role, 0) + tokens

    def on_handover_restored(self, latency_s: float) -> None:
        self.handover_latencies_s.append(latency_s)

    def on_cache_lookup(self, cached_tokens: int, kind: str | None, source: str | None = None) -> None:
        if cached_tokens:
            self.state_cache_hits += 1
            self.state_cache_tokens_reused += cached_tokens
            self.state_cache_hits_finished += kind == "finished"
            self.state_cache_hits_prompt += kind == "prompt"
            self.state_cache_hits_chunk += kind == "chunk"
            self.state_cache_hits_same_worker += source == "same_worker"
            self.state_cache_hits_same_node += source == "same_node"
            self.state_cache_hits_other_node += source == "other_node"
        else:
            self.state_cache_misses += 1

    def on_migration(self, mode: str, precopy_bytes: int, final_bytes: int, downtime_s: float) -> None:
        self.live_migrations += mode == "live"
        self.snapshot_migrations += mode == "snapshot"
        self.migration_precopy_bytes += precopy_bytes
        self.migration_final_bytes += final_bytes
        self.downtimes_s.append(downtime_s)

    def on_finish(self, req: Request) -> None:
        if req.state is State.FINISHED:
            self.finished += 1
        elif req.state is State.ABORTED:
            self.aborted += 1
        else:
            self.failed += 1

    def on_step(self, worker: int, result: StepResult, now: float) -> None:
        self.calls += 1
        self.busy_s += result.busy_s
        u = result.usage
        self.timeline.append((round(now - self.started_s, 4), worker,
                              1.0 - u.kv_free_tokens / u.kv_total_tokens,
                              u.state_total_slots - u.state_free_slots,
                              sum(len(t) for t in result.new_tokens.values())))

    def summary(self, tables: dict, views: list) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("timeline", "started_s", "decision_s", "decision_cpu_s",
                                                                 "handover_latencies_s", "downtimes_s")}
        d["decision_p50_s"] = percentile(self.decision_s, 50)
        d["decision_p99_s"] = percentile(self.decision_s, 99)
        d["decision_cpu_p50_s"] = percentile(self.decision_cpu_s, 50)
        d["decision_cpu_p99_s"] = percentile(self.decision_cpu_s, 99)
        d["prefill_tokens_by_role"] = dict(self.prefill_tokens_by_role)
        d["handover_latency_p50_s"] = percentile(self.handover_latencies_s, 50)
        d["handover_latency_p99_s"] = percentile(self.handover_latencies_s, 99)
        d["migration_downtime_s"] = percentiles(self.downtimes_s)
        d["uptime_s"] = time.monotonic() - self.started_s
        d["tables"] = tables
        d["workers"] = [{"worker": v.index, "role": v.role.value, "free_tokens": v.free_tokens,
                         "free_slots": v.free_slots, "running": len(v.running)} for v in views]
        return d

    def timeline_rows(self) -> list[tuple]:
        return list(self.timeline)


def percentiles(values: deque | list) -> dict:
    """{"p50", "p99", "max"} of `values` (nearest rank; all 0.0 when empty)."""
    v = sorted(values)
    if not v:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    rank = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"p50": rank(0.5), "p99": rank(0.99), "max": v[-1]}
