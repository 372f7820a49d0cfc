"""Fault injection: which fault of the `faults:` config fires at which call (torch-free).

The scheduler asks before each worker call and acts on the answer; faults never change what it
plans (pipelining included). Faults between calls are carried out by the scheduler (kill an actor,
flip a snapshot byte, end its own process); faults inside a call travel to the worker as data, a
`FaultPoint` in the step plan or the retract call, and the worker's process exits at that point.

    injector = FaultInjector(config.faults)
    for fault in injector.due_between_calls(worker=0, call=7, scheduler_calls=12): ...
    point = injector.in_step(worker=0, call=7, decode_steps=4, resume_cross_node=None, pipelined=False)
    plan = StepPlan(..., fault=point)
    injector.fired   # one record per fault fired: kind, worker, call, pipelined, cross_node, requests
"""

from __future__ import annotations

from collections.abc import Iterator

from raysched.config import FaultSpec
from raysched.messages import FaultPoint

BETWEEN_CALLS = ("kill_worker", "remove_node", "corrupt_snapshot", "kill_scheduler")


class FaultInjector:
    def __init__(self, faults: tuple[FaultSpec, ...]) -> None:
        self.faults = faults
        self.fired: list[dict] = []
        self._done: set[int] = set()

    def due_between_calls(self, worker: int, call: int, scheduler_calls: int) -> list[FaultSpec]:
        """Faults the scheduler carries out now, before `worker`'s call number `call`
        (`scheduler_calls`: the calls made to all workers so far, which a fault without a
        worker, a kill_scheduler, counts)."""
        due = [(i, f) for i, f in self._armed(worker, call, scheduler_calls) if f.kind in BETWEEN_CALLS]
        return [self._fire(i, f, call) for i, f in due]

    def in_step(self, worker: int, call: int, decode_steps: int, resume_cross_node: bool | None,
                pipelined: bool, requests: tuple[str, ...] = ()) -> FaultPoint | None:
        """The fault point of step call number `call`, if one is due there. `resume_cross_node`:
        whether the call's first snapshot resume comes from another node (None: it has none)."""
        for i, f in self._armed(worker, call):
            if (f.kind == "kill_in_step" and decode_steps > 0 and (pipelined or not f.pipelined)) or (
                    f.kind == "kill_in_restore" and resume_cross_node is not None
                    and (resume_cross_node or not f.cross_node)):
                self._fire(i, f, call, pipelined=pipelined, cross_node=resume_cross_node, requests=requests)
                return FaultPoint(f.kind, f.after_decode_steps)
        return None

    def in_retract(self, worker: int, call: int, request_id: str) -> FaultPoint | None:
        """The fault point of a retract call sent with step call number `call`, if one is due."""
        for i, f in self._armed(worker, call):
            if f.kind == "kill_in_retract":
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
              cross_node: bool | None = None, requests: tuple[str, ...] = ()) -> FaultSpec:
        self._done.add(i)
        self.fired.append({"kind": fault.kind, "worker": fault.worker, "call": call, "pipelined": pipelined,
                           "cross_node": cross_node, "requests": list(requests)})
        return fault
