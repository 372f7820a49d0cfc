"""The workers the scheduler owns, as it sees them (no Ray calls here: handles are opaque).

One `WorkerSlot` per worker actor: its handle, the facts it reported at start (`WorkerInfo`),
the scheduler's mirror of its pools (`WorkerView`, ground truth after each call), whether it is
alive, and the event its dispatch loop sleeps on. `Fleet` is the list of them plus the questions
several parts ask about the whole set (which node, how much room, any alive).

    fleet = Fleet()
    slot = fleet.add(handle, info)      # the dispatcher starts a loop for it
    fleet.notify()                      # wake every loop: there may be work
    fleet.interrupt(slot)               # end its long call early: it needs a decision
"""

from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass, field
from typing import Any, Callable

from raysched.messages import WorkerInfo
from raysched.request import Request
from raysched.scheduler.planner import WorkerView
from raysched.scheduler.roles import Role


@dataclass
class WorkerSlot:
    """One worker actor: handle, facts, pool mirror, liveness, and its loop's wake-up event."""

    index: int
    handle: Any
    info: WorkerInfo
    view: WorkerView
    alive: bool = True
    draining: bool = False  # no admissions or resumes; its requests are being moved off
    event: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    long_call: int = 0  # the call id of its call in flight that folds more than one successor
    #   (`Fleet.interrupt` ends it early); 0: none, or interrupted already
    open_call: Any = None  # `joins.OpenCall` of its long call if that takes joins, until its reply
    noticing: int = 0  # the `StepPlan.notice_id` of its call in flight that sends finish notices
    noticed: dict[str, int] = field(default_factory=dict)  # of that call: tokens applied from notices, per id
    failures: int = 0  # failures in a row of the workers this one replaces, none of which
    #   completed a call since (`Recovery.on_worker_failure`); 0 once a call of its own succeeded

    @classmethod
    def from_info(cls, handle: Any, info: WorkerInfo, role: Role = Role.BOTH) -> WorkerSlot:
        u = info.usage
        view = WorkerView(info.index, u.kv_free_tokens, u.state_free_slots, u.kv_total_tokens,
                          u.state_total_slots, u.page_size, role=role)
        return cls(info.index, handle, info, view)

    def line(self) -> dict:
        """One line of facts (what `Scheduler.start` and `describe` return per worker)."""
        return {"worker": self.index, "role": self.view.role.value, "node": self.info.node_id, "device": self.info.device,
                "kv_tokens": self.info.usage.kv_total_tokens, "state_slots": self.info.usage.state_total_slots,
                "vocab_size": self.info.vocab_size, "max_context": self.info.max_context,
                "draining": self.draining}


class Fleet:
    """Every worker slot, alive or retired (a slot's index is its position: never reused)."""

    def __init__(self) -> None:
        self.slots: list[WorkerSlot] = []
        self.node_id: str | None = None  # the scheduler's own node (for bytes-moved accounting)
        self.idle: dict[int, WorkerSlot] = {}  # slots whose loop sleeps on its event
        self._rooms: list[float] = []  # room() of each slot after its last reply; -1.0 when retired
        self.long_calls: dict[int, WorkerSlot] = {}  # slots with a `long_call` in flight
        self.interrupts = 0  # long calls ended early
        self._sent: set[asyncio.Task] = set()  # interrupts whose replies are awaited
        self.on_notify: Callable[[], None] = lambda: None  # (the dispatcher's `interrupt_for_waiting`)

    def add(self, handle: Any, info: WorkerInfo, role: Role = Role.BOTH) -> WorkerSlot:
        slot = WorkerSlot.from_info(handle, info, role)
        self.slots.append(slot)
        self._rooms.append(slot.view.room())
        return slot

    def note_room(self, w: WorkerSlot) -> None:
        """`w`'s pools changed (a reply arrived), or whether it takes work did (it was retired,
        or drained, or is in a long call): a worker that takes nothing now counts as -1.0, so it
        never looks roomiest (a worker in a long call is interrupted when it is needed)."""
        self._rooms[w.index] = w.view.room() if w.alive and not w.draining and not w.long_call else -1.0

    def set_draining(self, w: WorkerSlot, draining: bool) -> None:
        """Stop (or restart) admissions and resumes to `w`; wake the loops when it takes work again."""
        w.draining = draining
        self.note_room(w)
        if draining:
            self.interrupt(w)  # what it holds is to move off: its loop decides that between calls
        else:
            self.notify()

    def best_room_except(self, w: WorkerSlot) -> float:
        """The most room any other live worker has (-1.0 if there is none): one pass over a list
        of floats kept up to date by `note_room`, not a call per worker."""
        if len(self._rooms) < 2:
            return -1.0
        top, second = heapq.nlargest(2, self._rooms)
        mine = self._rooms[w.index]
        return second if mine == top else top

    def alive(self) -> list[WorkerSlot]:
        return [w for w in self.slots if w.alive]

    def others(self, w: WorkerSlot) -> list[WorkerSlot]:
        """The live workers other than `w`."""
        return [o for o in self.slots if o is not w and o.alive]

    def targeted_elsewhere(self, r: Request, w: WorkerSlot) -> bool:
        """Does retracted `r` wait for another worker (its `target_worker`, live, not draining)?"""
        t = r.target_worker
        if t is None or t == w.index or not 0 <= t < len(self.slots):
            return False
        return self.slots[t].alive and not self.slots[t].draining

    def notify(self, interrupt: bool = True) -> None:
        """Wake every sleeping dispatch loop (new work, or room freed somewhere); the others decide
        again as soon as their call returns anyway, or sooner if `on_notify` interrupts their
        long call (`interrupt`: whether to ask it; a loop whose call just returned does not)."""
        for w in list(self.idle.values()):
            w.event.set()
        if interrupt and self.long_calls:
            self.on_notify()

    # ------------------------------------------------------------------ long calls
    def start_long_call(self, w: WorkerSlot, call_id: int) -> None:
        w.long_call = call_id
        self.long_calls[w.index] = w
        self.note_room(w)

    def end_long_call(self, w: WorkerSlot) -> None:
        w.long_call = 0
        if self.long_calls.pop(w.index, None) is not None:
            self.note_room(w)

    def interrupt(self, w: WorkerSlot) -> bool:
        """End `w`'s long call after the step under way (`Worker.interrupt`), so that its loop
        decides again: something needs a decision there. False if it has none in flight."""
        if not w.long_call:
            return False
        self.forget(w.handle.interrupt.remote(w.long_call))
        self.end_long_call(w)
        self.interrupts += 1
        return True

    def forget(self, ref: Any) -> None:
        """Read a call's reply in the background (one sent to a worker that just died logs
        nothing)."""
        sent = asyncio.get_running_loop().create_task(quietly(ref))
        self._sent.add(sent)
        sent.add_done_callback(self._sent.discard)

    def interrupt_all(self) -> None:
        for w in list(self.long_calls.values()):
            self.interrupt(w)

    def any_alive(self) -> bool:
        return any(w.alive for w in self.slots)

    def multi_node(self) -> bool:
        """Do live workers sit on more than one node (a resume may cross the network)?"""
        return len({w.info.node_id for w in self.slots if w.alive}) > 1

    def cross_node(self, r: Request, w: WorkerSlot) -> bool:
        """Did `r` last run on another node than `w`'s?"""
        if not r.workers or r.workers[-1] >= len(self.slots):
            return False
        return self.slots[r.workers[-1]].info.node_id != w.info.node_id

    def largest_pool_tokens(self) -> int:
        """The KV tokens of the largest live worker's pool; while none is alive (every worker is
        being replaced), the largest any worker had: a replacement is built from the same config."""
        return max((w.view.total_tokens for w in self.slots if w.alive), default=0) or \
            max((w.view.total_tokens for w in self.slots), default=0)

    def mixed_kernels(self) -> list[str]:
        """The live workers' matrix kernels (`WorkerInfo.kernel`) when they are not all the same:
        a request moved between two of them continues up to rounding only, not bit for bit."""
        kinds = sorted({w.info.kernel for w in self.slots if w.alive and w.info.kernel})
        return kinds if len(kinds) > 1 else []

    def check_same_model(self) -> None:
        prints = {w.info.fingerprint for w in self.slots}
        if len(prints) > 1:
            raise RuntimeError(f"workers loaded different models: {sorted(prints)}")


async def quietly(ref: Any) -> None:
    """Await a worker call whose outcome nobody needs (its failure is not an error)."""
    try:
        await ref
    except Exception:
        pass
