"""The retraction ledger: how each victim leaves its worker, and the snapshot bytes that are out.

For each victim the planner picked, the ledger chooses the retract mode (the configured one; the
cost model in `auto` mode; recompute whenever the snapshot would overflow the object-store
budget), moves it out of RUNNING, and for a snapshot sends `Worker.retract_pending`, queueing the
request at once with the pending snapshot ref: the scheduler owns that object, it outlives the
worker process that made it, and any worker may resume the request as soon as the bytes exist.
It keeps the bytes of snapshots waiting and in flight against the budget, and counts the bytes
each resume moves between nodes.

No Ray import: worker handles are opaque (`handle.retract_pending.options(...).remote(...)`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from raysched.config import SchedulerConfig
from raysched.request import Request, State, enqueue
from raysched.scheduler.faults import FaultSeam
from raysched.scheduler.fleet import Fleet, WorkerSlot
from raysched.scheduler.planner import Decision
from raysched.scheduler.policy import choose_retract_mode
from raysched.scheduler.recovery import one_line
from raysched.scheduler.roles import choose_target
from raysched.scheduler.table import RequestTable
from raysched.stats import Counters

log = logging.getLogger("raysched.scheduler")


class RetractionLedger:
    def __init__(self, cfg: SchedulerConfig, table: RequestTable, fleet: Fleet, counters: Counters,
                 faults: FaultSeam) -> None:
        self.cfg = cfg
        self.table = table
        self.fleet = fleet
        self.counters = counters
        self.faults = faults
        self.budget_bytes = cfg.snapshot_budget_bytes or 0  # None: set from the store at start
        self.inflight_bytes = 0  # estimated bytes of retractions not yet reported
        self._handover_refs: set = set()  # snapshot refs of hand-overs whose size is not reported yet

    def take_victims(self, w: WorkerSlot, decision: Decision) -> tuple[list[Request], list[str]]:
        """Move the decision's victims (and ended requests) out of `w`'s running list; returns
        (victims to snapshot, request ids the worker drops)."""
        view = w.view
        snap, drop = [], [r.request_id for r in view.running if r.state.is_done]  # aborted, stop string
        view.running = [r for r in view.running if r.state is State.RUNNING]
        tokens_gained = 0
        for r in decision.victims:
            if r.state is not State.RUNNING:  # aborted after the plan saw it: already in `drop`
                continue
            view.running.remove(r)
            tokens_gained += view.held(r)
            r.state, r.retractions = State.RETRACTED, r.retractions + 1
            if self.mode(w, r) == "snapshot":
                r.recompute = False  # a flag left from an earlier recompute would skip this snapshot
                snap.append(r)
            else:
                r.recompute, r.snapshot_ref = True, None
                drop.append(r.request_id)
                enqueue(self.table.retracted, r)
            r.target_worker, r.handover_s = None, None
            self.counters.on_retract(r.recompute)
        snap += self._take_handovers(w, decision.handovers)
        if decision.victims:
            log.info("Retract requests on worker %d: #retracted_reqs: %d, #new_tokens_gained: %d, "
                     "#state_slots_gained: %d", w.index, len(decision.victims), tokens_gained, len(decision.victims))
        return snap, drop

    def _take_handovers(self, w: WorkerSlot, handovers: list[Request]) -> list[Request]:
        """Prefilled requests leaving a prefill worker: always by snapshot (a recompute would
        prefill again), targeted at the decode worker with the most room; not retractions. Their
        bytes count in flight, never against the budget (a decode worker consumes them at once)."""
        taken = []
        for r in handovers:
            if r.state is not State.RUNNING:
                continue
            w.view.running.remove(r)
            r.state, r.recompute = State.RETRACTED, False
            r.target_worker = choose_target(o.view for o in self.fleet.others(w))
            r.handover_s = time.monotonic()
            self.inflight_bytes += estimate_bytes(w, r)
            self.counters.handovers += 1
            taken.append(r)
        return taken

    def mode(self, w: WorkerSlot, r: Request) -> str:
        """snapshot | recompute for this victim (see the module docstring); a snapshot's
        estimated bytes count as in flight from here on."""
        info, mode = w.info, self.cfg.retract
        nbytes = estimate_bytes(w, r)
        if mode == "auto":
            mode = choose_retract_mode(r.num_cached + 1, nbytes, info.copy_bytes_per_s, info.prefill_tokens_per_s,
                                       cross_node=self.fleet.multi_node())
        if mode == "snapshot" and not self.fits(nbytes):
            return "recompute"
        self.inflight_bytes += nbytes if mode == "snapshot" else 0
        return mode

    def send(self, w: WorkerSlot, r: Request) -> tuple[Any, Any, int]:
        """Send `Worker.retract_pending` and queue `r` with the pending snapshot ref now; returns
        (snapshot ref, size ref, estimated bytes): only the small size is awaited, never the
        bytes. (The request may resume elsewhere and grow before the size arrives: the estimate
        counted in flight is the one taken now.)"""
        estimate = estimate_bytes(w, r)
        fault = self.faults.retract_point(w, r.request_id)
        snap_ref, size_ref = w.handle.retract_pending.options(num_returns=2).remote(r.request_id, fault)
        r.snapshot_ref, r.snapshot_bytes, r.snapshot_node = snap_ref, 0, w.info.node_id
        if r.handover_s is not None:  # a hand-over (see `_take_handovers`): its bytes count as such
            self._handover_refs.add(snap_ref)
        enqueue(self.table.retracted, r)
        self.fleet.notify()
        return snap_ref, size_ref, estimate

    def on_sizes(self, w: WorkerSlot, victims: list[Request], calls: list[tuple[Any, Any, int]],
                 sizes: list[Any]) -> None:
        """The sizes of the snapshots `w` took (already queued with their refs), or the errors of
        retractions that failed: those requests are recomputed instead."""
        for req, (ref, _, estimate), size in zip(victims, calls, sizes):
            self.inflight_bytes -= estimate
            handover = ref in self._handover_refs
            self._handover_refs.discard(ref)
            current = req.snapshot_ref is ref  # not resumed (or retracted again) meanwhile
            if isinstance(size, BaseException):
                self.fleet.forget(ref)  # the snapshot's ref holds the same error: read it, so that
                #   Ray does not log it as unhandled when the ref goes
                log.warning("retraction of %s on worker %d failed (%s); it will be recomputed",
                            req.request_id, w.index, one_line(size))
                waiting = current and req.state is State.RETRACTED
                if waiting:  # (one already resuming elsewhere reports the snapshot lost instead)
                    req.snapshot_ref, req.recompute = None, True
                self.counters.recovered += waiting  # recovered by recompute
                continue
            self.counters.snapshot_bytes += size
            self.counters.handover_bytes += size if handover else 0
            if current:
                req.snapshot_bytes = size
                self.counters.note_snapshot_bytes_held(self.held_bytes())

    def count_resume_bytes(self, w: WorkerSlot, resumed: list[Request]) -> None:
        """Bytes each snapshot resume moves between nodes: once from the producer's node to
        this worker's, or nothing on the same node; and what the former flow (producer ->
        scheduler node -> destination) would have moved, for comparison."""
        home = self.fleet.node_id
        for r in resumed:
            nbytes = r.snapshot_bytes or estimate_bytes(w, r)
            here = w.info.node_id
            via = (r.snapshot_node != home) + (here != home)
            self.counters.on_resume_bytes(nbytes * (r.snapshot_node != here), nbytes * via)

    def fits(self, nbytes: int) -> bool:
        """Does a snapshot of `nbytes` fit in the budget now? If not, it is counted as a store
        pressure fallback (the caller retracts by recompute instead)."""
        if self.held_bytes() + nbytes <= self.budget_bytes:
            return True
        self.counters.store_pressure_fallbacks += 1
        return False

    def held_bytes(self) -> int:
        """Bytes of snapshots waiting to be resumed, plus those still in flight."""
        held = sum(r.snapshot_bytes for r in self.table.requests.values() if r.snapshot_ref is not None)
        return held + self.inflight_bytes


def estimate_bytes(w: WorkerSlot, r: Request) -> int:
    """A snapshot's size before the worker reports it: KV of its cached tokens plus one state slot."""
    return r.num_cached * w.info.kv_bytes_per_token + w.info.state_bytes_per_slot
