"""Requests sent to start inside a long call (`Worker.join`), for both data planes (no torch).

The scheduler decides which waiting request joins which long call, by the room the call left
(`raysched.scheduler.joins.OpenCall`); the worker only keeps what was sent until the call takes
it between two of its decode steps, and, when the call's decoding ends, names what came too late.
`join` runs beside the step call (the worker actor's control concurrency group, or the simulated
host's event loop), so the box is locked.

    box.put(call_id, items)        # Worker.join
    items = box.take(plan)         # between decode steps of the call `plan` (none if not plan.joins)
    late = box.close(plan)         # its decoding is over: the ids sent and not taken

A long call sent with `StepPlan.notices` goes on past a request's finish; `notify_finished` tells
the scheduler of it at once (after the reader's push went out), so its room can take a join.
"""

from __future__ import annotations

import threading
from typing import Any

from raysched.messages import FinishNotice, PrefillItem, StepPlan


class JoinBox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[int, list[PrefillItem]] = {}  # call id -> items sent to join it, not taken yet
        self._closed = 0  # the last call id whose decoding is over (a later join for it is dropped)

    def put(self, call_id: int, items: list[PrefillItem]) -> None:
        """Keep `items` for call `call_id`; dropped if its decoding is over (its reply, which does
        not list them, tells the scheduler)."""
        with self._lock:
            if call_id > self._closed:
                self._items.setdefault(call_id, []).extend(items)

    def take(self, plan: StepPlan) -> list[PrefillItem]:
        """What was sent to join the call `plan` and not taken yet (nothing if it takes no joins)."""
        if not plan.joins:
            return []
        with self._lock:
            return self._items.pop(plan.call_id, [])

    def pending(self, plan: StepPlan) -> bool:
        """Is something waiting to join the call `plan`?"""
        with self._lock:
            return bool(plan.joins and self._items.get(plan.call_id))

    def close(self, plan: StepPlan) -> list[str]:
        """The call `plan`'s decoding is over: later joins for it (or an earlier call) are
        dropped; the ids of those sent and not taken, which its reply lists as not admitted."""
        if not plan.call_id:
            return []
        with self._lock:
            self._closed = max(self._closed, plan.call_id)
            late = [c for c in self._items if c <= self._closed]
            return [item.request_id for c in late for item in self._items.pop(c)]


def goes_on_past_finish(plan: StepPlan) -> bool:
    """Does the call `plan` decode on after a step in which a request finished? (It ends
    there with `end_at_finish`, unless it tells the scheduler instead: `notices`.)"""
    return plan.notices is not None or not plan.end_at_finish


def notify_finished(plan: StepPlan, worker: int, finished: dict[str, str],
                    tokens: dict[str, list[int]], send: FinishNotice | None = None) -> None:
    """Tell `plan.notices` (the scheduler) that `finished` (id -> why) ended inside the call,
    with each one's tokens of this call (`tokens`: the call's tokens so far); through `send`
    where given (a simulated host's batched replies), else by a Ray call. Fire and forget: a
    scheduler that is gone learns nothing here, and the call's reply still lists them."""
    if plan.notices is None or not finished:
        return
    ended: dict[str, Any] = {rid: (why, list(tokens.get(rid, ()))) for rid, why in finished.items()}
    if send is not None:
        send(worker, plan.notice_id, ended)
        return
    try:
        plan.notices.call_finished.remote(worker, plan.notice_id, ended)
    except Exception:  # (its actor died: the reply, or the recovery of this call, ends them)
        pass
