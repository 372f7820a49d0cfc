"""Fault injection on the data plane: the one seam, kept out of the production worker.

`with_faults(Worker)` derives a worker class that honours the `FaultPoint` a call carries (see
`raysched.messages.FaultPoint`): its process exits (`os._exit`, no reply, no clean-up) inside
the step call after some decode steps, right after restoring a snapshot, or inside a retract
call after the gather; `corrupt_snapshot` flips one payload byte of the snapshot after its
checksum was taken. With `scheduler.debug_drop_state` (the negative control of the exactness
tests) it also zeroes each restored request's recurrent state. The scheduler's shell starts
this class only when the config has faults or that switch (`raysched.workers`).

It overrides four hooks of the worker it wraps: `_restore_one`, `_decode`, `_take_joins`, `retract_pending`,
and its live-migration calls (`migrate_out`, `reserve`, `migrate_in`, `commit`: the process
exits after the copy, before the reply; a reservation is refused); and needs from it
`engine.decode(steps)` and, for `debug_drop_state`, `engine.pool.mamba`. A worker class may
define its own `_zero_state` and `_die_at` (the simulated one does: it dies alone, its process
stays). No torch import here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from functools import lru_cache
from typing import Any

from raysched.messages import FaultPoint, StepPlan, StepResult


class FaultHooks:
    """The overriding half of a faulty worker (mixed in ahead of the worker class)."""

    def retract_pending(self, request_id: str, fault: FaultPoint | None = None) -> tuple[Any, int]:
        snap, nbytes = super().retract_pending(request_id)  # type: ignore[misc]
        if fault is not None and fault.kind == "corrupt_snapshot":
            snap = corrupted(snap)
        self._die_at(fault, "kill_in_retract")
        return snap, nbytes

    def _decode(self, plan: StepPlan, *rest: Any) -> Any:
        fault = plan.fault
        if fault is not None and fault.kind == "kill_in_step":
            self.engine.decode(min(fault.after_decode_steps, plan.decode_steps))  # these tokens never leave
            self._die_at(fault, "kill_in_step")
        return super()._decode(plan, *rest)  # type: ignore[misc]

    def _take_joins(self, plan: StepPlan, result: StepResult) -> Any:
        joined = super()._take_joins(plan, result)  # type: ignore[misc]
        prefilling = getattr(self.engine, "prefilling", {})  # (a simulated worker feeds joins whole)
        if any(rid in prefilling for rid in result.joined):
            self._die_at(plan.fault, "kill_in_join")  # a joined prompt half fed
        return joined

    def _restore_one(self, plan: StepPlan, rid: str, snap: Any, result: StepResult) -> bool | None:
        ok = super()._restore_one(plan, rid, snap, result)  # type: ignore[misc]
        if ok is not None:
            self._die_at(plan.fault, "kill_in_restore")
        if ok and self.config.scheduler.debug_drop_state:  # deliberately broken: the negative control
            self._zero_state(rid)
        return ok

    def migrate_out(self, request_id: str, start: int, block_tokens: int, final: bool,
                    fault: FaultPoint | None = None) -> Any:
        out = super().migrate_out(request_id, start, block_tokens, final)  # type: ignore[misc]
        die_at(fault, "kill_migration_source")
        return out

    def reserve(self, request_id: str, num_tokens: int, fault: FaultPoint | None = None) -> bool:
        if fault is not None and fault.kind == "refuse_migration":
            return False
        return super().reserve(request_id, num_tokens)  # type: ignore[misc]

    def migrate_in(self, request_id: str, blocks: list, fault: FaultPoint | None = None) -> bool:
        ok = super().migrate_in(request_id, blocks)  # type: ignore[misc]
        die_at(fault, "kill_migration_dest")
        return ok

    def commit(self, snapshot: list, fault: FaultPoint | None = None) -> bool:
        ok = super().commit(snapshot)  # type: ignore[misc]
        die_at(fault, "kill_migration_dest")
        return ok

    def _zero_state(self, rid: str) -> None:
        parent = getattr(super(), "_zero_state", None)  # the worker's own way, if it has one
        if parent is not None:
            return parent(rid)
        states = self.engine.pool.mamba
        states.zero(states.slot(rid))

    def _die_at(self, fault: FaultPoint | None, kind: str) -> None:
        parent = getattr(super(), "_die_at", None)  # a simulated worker dies alone
        if parent is not None:
            return parent(fault, kind)
        die_at(fault, kind)


@lru_cache(maxsize=None)
def with_faults(worker_cls: type) -> type:
    """`worker_cls` with the fault hooks (one class per worker class, so Ray sees one name)."""
    return type(f"Faulty{worker_cls.__name__}", (FaultHooks, worker_cls), {"__module__": __name__})


def needs_faults(config: Any) -> bool:
    """Whether a serve config asks for the fault seam on its workers."""
    return bool(config.faults) or config.scheduler.debug_drop_state


def corrupted(snap: Any) -> Any:
    """A copy of the snapshot with one payload byte flipped after the checksum was taken."""
    payload = bytearray(snap.payload) if isinstance(snap.payload, (bytes, bytearray)) else snap.payload.copy()
    payload[len(payload) // 2] ^= 0x01
    if isinstance(snap.payload, bytes):
        payload = bytes(payload)
    return dataclasses.replace(snap, payload=payload)


def die_at(fault: FaultPoint | None, kind: str) -> None:
    """End this process on the spot, as a crash would (no reply, no clean-up), if `fault` is `kind`."""
    if fault is not None and fault.kind == kind:
        print(f"fault injection: {kind}: worker process {os.getpid()} exits", file=sys.stderr, flush=True)
        os._exit(1)
