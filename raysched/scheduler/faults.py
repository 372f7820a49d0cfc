"""Fault injection, the scheduler's one seam: which fault of the `faults:` config fires at which
call, and carrying it out (torch-free).

`FaultSeam` is the only place the dispatcher meets fault injection: before each worker call it
asks `before_call` (faults between calls, carried out here: kill an actor, kill a node's actors,
end this process, or mark the worker's next snapshot to be corrupted), then `step_point` /
`retract_point` for the `FaultPoint` a call carries to the worker (data: the worker's process
exits there; see `actors.faults`). Faults never change what the scheduler plans (pipelining
included). With no faults configured every answer is empty.

`FaultInjector` is the pure part (which fault is due at which call):

    injector = FaultInjector(config.faults)
    for fault in injector.due_between_calls(worker=0, call=7, scheduler_calls=12): ...
    point = injector.in_step(worker=0, call=7, decode_steps=4, resume_cross_node=None, pipelined=False)
    plan = StepPlan(..., fault=point)
    injector.fired   # one record per fault fired: kind, worker, call, pipelined, folded, decode_steps,
                     #   cross_node, requests
"""

from __future__ import annotations

from collections.abc import Iterator

import logging
import os
from typing import Any, Callable

from raysched.config import FaultSpec
from raysched.messages import FaultPoint

log = logging.getLogger("raysched.scheduler")

BETWEEN_CALLS = ("kill_worker", "remove_node", "corrupt_snapshot", "kill_scheduler")
KILLS_WORKERS = ("kill_worker", "remove_node")


class FaultInjector:
    def __init__(self, faults: tuple[FaultSpec, ...]) -> None:
        self.faults = faults
        self.fired: list[dict] = []
        self._done: set[int] = set()

    @property
    def armed(self) -> bool:
        """Is any fault left to fire?"""
        return len(self._done) < len(self.faults)

    def due_between_calls(self, worker: int, call: int, scheduler_calls: int, holding: bool = True) -> list[FaultSpec]:
        """Faults the scheduler carries out now, before `worker`'s call number `call`
        (`scheduler_calls`: the calls made to all workers so far, which a fault without a
        worker, a kill_scheduler, counts). `holding`: whether the call leaves a request's state
        on the worker; a kill_worker or remove_node waits for such a call (a worker that holds
        nothing has nothing to lose, and the rehearsal would test no recovery)."""
        due = [(i, f) for i, f in self._armed(worker, call, scheduler_calls)
               if f.kind in BETWEEN_CALLS and (holding or f.kind not in KILLS_WORKERS)]
        return [self._fire(i, f, call) for i, f in due]

    def in_step(self, worker: int, call: int, decode_steps: int, resume_cross_node: bool | None,
                pipelined: bool, requests: tuple[str, ...] = (), folded: bool = False) -> FaultPoint | None:
        """The fault point of step call number `call`, if one is due there. `resume_cross_node`:
        whether the call's first snapshot resume comes from another node (None: it has none).
        A kill_in_step waits for a call with at least its `after_decode_steps` decode steps (and
        one), so that it dies where it says, inside the call; a kill_in_join for a folded call
        (one that takes joins when joins are on)."""
        for i, f in self._armed(worker, call):
            if (f.kind == "kill_in_step" and decode_steps >= max(1, f.after_decode_steps)
                    and (pipelined or not f.pipelined)
                    and (folded or not f.folded)) or (f.kind == "kill_in_join" and folded) or (
                    f.kind == "kill_in_restore" and resume_cross_node is not None
                    and (resume_cross_node or not f.cross_node)):
                self._fire(i, f, call, pipelined=pipelined, cross_node=resume_cross_node, requests=requests,
                           folded=folded, decode_steps=decode_steps)
                return FaultPoint(f.kind, f.after_decode_steps)
        return None

    def in_retract(self, worker: int, call: int, request_id: str) -> FaultPoint | None:
        """The fault point of a retract call sent with step call number `call`, if one is due."""
        for i, f in self._armed(worker, call):
            if f.kind == "kill_in_retract":
                self._fire(i, f, call, requests=(request_id,))
                return FaultPoint(f.kind)
        return None

    def in_migration(self, worker: int, call: int, kind: str, stage: int, final: bool,
                     request_id: str) -> FaultPoint | None:
        """The fault point of a migration call to `worker` (its calls so far: `call`): `kind` is
        the fault this call can carry (kill_migration_source | kill_migration_dest |
        refuse_migration); `stage` the pre-copy stage (ignored with `final` and for refusals)."""
        for i, f in self._armed(worker, call):
            if f.kind == kind and (kind == "refuse_migration" or (f.final, f.stage if not f.final else 0)
                                   == (final, stage if not final else 0)):
                self._fire(i, f, call, requests=(request_id,))
                return FaultPoint(f.kind)
        return None

    def _armed(self, worker: int, call: int, scheduler_calls: int | None = None) -> Iterator[tuple[int, FaultSpec]]:
        for i, f in enumerate(self.faults):
            if i in self._done:
                continue
            if f.worker is None:  # the scheduler's own fault: counts its calls to all workers
                if scheduler_calls is not None and scheduler_calls >= f.after_steps:
                    yield i, f
            elif f.worker == worker and call >= f.after_steps:
                yield i, f

    def _fire(self, i: int, fault: FaultSpec, call: int, pipelined: bool = False,
              cross_node: bool | None = None, requests: tuple[str, ...] = (), folded: bool = False,
              decode_steps: int = 0) -> FaultSpec:
        self._done.add(i)
        self.fired.append({"kind": fault.kind, "worker": fault.worker, "call": call, "pipelined": pipelined,
                           "folded": folded, "decode_steps": decode_steps, "cross_node": cross_node,
                           "requests": list(requests)})
        return fault


class FaultSeam:
    """Fault injection as the dispatcher sees it. `kill(handle)` ends an actor (Ray's `kill`, or
    a fake in tests); `exit_process` ends the scheduler's process (kill_scheduler)."""

    def __init__(self, faults: tuple[FaultSpec, ...], kill: Callable[[Any], None],
                 exit_process: Callable[[], None] | None = None) -> None:
        self.injector = FaultInjector(faults)
        self._kill = kill
        self._exit_process = exit_process or exit_scheduler_process
        self._corrupt_next: set[int] = set()  # workers whose next snapshot gets a flipped byte

    @property
    def fired(self) -> list[dict]:
        return self.injector.fired

    def before_call(self, w: Any, fleet: Any, holding: bool = True) -> None:
        """Carry out the faults due before worker `w`'s next call (`w.view.calls`); `holding`:
        whether that call leaves a request's state on `w` (see `due_between_calls`)."""
        if not self.injector.armed:
            return  # the common case: no faults configured, or all fired (no pass over the fleet)
        scheduler_calls = sum(x.view.calls for x in fleet.slots)
        for fault in self.injector.due_between_calls(w.index, w.view.calls, scheduler_calls, holding):
            log.warning("fault injection: %s on worker %d after %d calls", fault.kind, w.index, w.view.calls)
            if fault.kind == "kill_worker":
                self._kill(w.handle)
            elif fault.kind == "remove_node":
                for other in fleet.alive():
                    if other.info.node_id == w.info.node_id:
                        self._kill(other.handle)
            elif fault.kind == "kill_scheduler":
                self._exit_process()
            else:
                self._corrupt_next.add(w.index)

    def step_point(self, w: Any, call: int, decode_steps: int, resume_cross_node: bool | None,
                   pipelined: bool = False, folded: bool = False) -> FaultPoint | None:
        """The fault point step call number `call` of `w` carries, if one is due (logged)."""
        if not self.injector.armed:
            return None
        point = self.injector.in_step(w.index, call, decode_steps, resume_cross_node, pipelined,
                                      tuple(r.request_id for r in w.view.running), folded)
        if point is not None:
            log.warning("fault injection: %s sent to worker %d in call %d%s", point.kind, w.index, call,
                        " (pipelined)" if pipelined else " (folded)" if folded else "")
        return point

    def retract_point(self, w: Any, request_id: str) -> FaultPoint | None:
        """The fault point of a retract call sent now: a kill inside it, or a flipped byte."""
        point = self.injector.in_retract(w.index, w.view.calls, request_id)
        if point is None and w.index in self._corrupt_next:
            self._corrupt_next.discard(w.index)
            point = FaultPoint("corrupt_snapshot")
        if point is not None:
            log.warning("fault injection: %s sent to worker %d retracting %s", point.kind, w.index, request_id)
        return point


    def migration_point(self, w: Any, kind: str, request_id: str, stage: int = 0,
                        final: bool = False) -> FaultPoint | None:
        """The fault point a migration call to `w` carries, if one is due (logged)."""
        point = self.injector.in_migration(w.index, w.view.calls, kind, stage, final, request_id)
        if point is not None:
            where = "the stop-and-copy" if final else f"stage {stage}"
            log.warning("fault injection: %s sent to worker %d migrating %s (%s)", kind, w.index, request_id, where)
        return point


def exit_scheduler_process() -> None:
    """Fault injection (kill_scheduler): end this process on the spot, as a crash would."""
    log.error("fault injection: kill_scheduler: scheduler process %d exits", os.getpid())
    logging.shutdown()
    os._exit(1)
