"""Counters and the occupancy timeline the scheduler keeps (torch-free)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from raysched.messages import StepResult
from raysched.request import Request, State


@dataclass
class Counters:
    submitted: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    tokens: int = 0
    calls: int = 0
    pipelined_calls: int = 0
    retractions: int = 0
    retractions_snapshot: int = 0
    retractions_recompute: int = 0
    resumes: int = 0
    resumes_snapshot: int = 0
    resumes_recompute: int = 0
    migrations: int = 0
    cross_node_migrations: int = 0
    snapshot_bytes: int = 0  # through the object store, in total
    snapshot_bytes_held_peak: int = 0  # most bytes of snapshots waiting (or in flight) at once
    snapshots_refused: int = 0
    worker_failures: int = 0
    workers_replaced: int = 0
    recovered: int = 0
    store_pressure_fallbacks: int = 0
    resubmitted: int = 0  # requests resubmitted to this (restarted) scheduler by their clients
    resubmitted_tokens: int = 0  # tokens they carried (received before the restart)
    busy_s: float = 0.0
    started_s: float = field(default_factory=time.monotonic)
    timeline: deque = field(default_factory=lambda: deque(maxlen=20000))

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
                              u.mamba_total_slots - u.mamba_free_slots,
                              sum(len(t) for t in result.new_tokens.values())))

    def summary(self, tables: dict, views: list) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("timeline", "started_s")}
        d["uptime_s"] = time.monotonic() - self.started_s
        d["tables"] = tables
        d["workers"] = [{"worker": v.index, "free_tokens": v.free_tokens, "free_slots": v.free_slots,
                         "running": len(v.running)} for v in views]
        return d

    def timeline_rows(self) -> list[tuple]:
        return list(self.timeline)
