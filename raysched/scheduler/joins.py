"""Requests that start inside a long call (pure: no Ray, no torch).

A long call runs up to `fold_calls` calls' decode steps (see `dispatch.Dispatcher.fold_factor`).
Without joins, a request that arrives while every worker with a free slot is in one waits for a
call to end, or interrupts one (`interrupt_after_ms`): the worker stops, replies, and idles for a
round trip to the scheduler and back. With `scheduler.join_long_calls` the scheduler sends it
into the call instead (`Worker.join(call_id, items)`): the worker prefills it before its next
decode step and decodes on, and the call's reply lists it in `StepResult.joined` (one it could
not fit, or that came after its decoding ended, in `not_admitted`: the scheduler queues it again
at the head). Decisions stay the scheduler's: which request joins which call, by the room the
call left when it was sent (`OpenCall`), never more than that.

    call = OpenCall.of(view, call_id, steps, streams)  # when a long call that takes joins is sent
    taken = call.take(waiting, page_size, cap)    # the head of the queue that fits, in order
    dropped = call.settle(result.joined, result.not_admitted)  # sent, and in neither list
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from raysched.request import Request
from raysched.scheduler.planner import WorkerView
from raysched.scheduler.policy import pages


@dataclass
class OpenCall:
    """A long call in flight that takes joins, and the room it has left for them: KV tokens and
    state slots, counted from the pools its worker last reported, less what the call's own
    requests need for all of its steps (so a join never takes room they were promised)."""

    call_id: int
    steps: int  # decode steps of the whole call
    free_tokens: int
    free_slots: int
    streams: bool = False  # the call streams each step's tokens (a streamed request joins only such a call)
    reserve: bool = False  # `admission: reserve`: a request's room is its whole budget, not the call's steps
    sent: list[Request] = field(default_factory=list)  # requests sent to join it, in order

    @classmethod
    def of(cls, view: WorkerView, call_id: int, steps: int, streams: bool = False, reserve: bool = False) -> OpenCall:
        """The room of `view`'s call `call_id` of `steps` decode steps, whose requests are
        `view.running` (those it starts hold nothing yet in `view.allocated`)."""
        call = cls(call_id, steps, view.free_tokens, 0, streams, reserve)
        ps, new = view.page_size, 0
        for r in view.running:
            held = view.allocated.get(r.request_id)
            new += held is None
            call.free_tokens -= max(0, call.need(r, ps) - pages(held or 0, ps) * ps)
        call.free_slots = min(view.free_slots - new, view.total_slots - len(view.running))
        return call

    def need(self, r: Request, page_size: int) -> int:
        """KV tokens `r` holds by the call's end: its tokens and the call's steps (with `reserve`,
        its whole remaining budget), page-rounded."""
        more = max(r.remaining, 0) if self.reserve else min(self.steps, max(r.remaining, 0))
        return pages(r.num_tokens + more, page_size) * page_size

    def take(self, waiting: Iterable[Request], page_size: int, cap: int) -> list[Request]:
        """The requests at the head of `waiting` that fit, in order (first come, first served:
        it stops at the first that does not), at most `cap`; their room is taken."""
        taken = []
        for r in waiting:
            need = self.need(r, page_size)
            if len(taken) >= cap or self.free_slots < 1 or need > self.free_tokens:
                break
            taken.append(r)
            self.free_tokens -= need
            self.free_slots -= 1
        self.sent.extend(taken)
        return taken

    def debit(self, view: WorkerView, taken: list[Request]) -> None:
        """Take the room of `taken` from `view` too, until the call's reply reports the pools
        again: the other workers' decisions (and interrupts for the requests still waiting)
        must not count it free."""
        view.free_tokens -= sum(self.need(r, view.page_size) for r in taken)
        view.free_slots -= len(taken)

    def settle(self, joined: Iterable[str], not_admitted: Iterable[str]) -> list[str]:
        """The ids of the requests sent that the reply lists neither as joined nor as not
        admitted: they reached the worker after the call's decoding ended (it dropped them)."""
        seen = set(joined) | set(not_admitted)
        return [r.request_id for r in self.sent if r.request_id not in seen]
