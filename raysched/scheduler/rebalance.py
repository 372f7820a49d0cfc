"""Load balancing by live migration: which running request to move, and where (pure, no Ray).

A worker's *virtual usage* (after Llumnix) counts what its running requests will need, not only
what they hold: for each, the K/V of its whole budget (tokens so far + tokens still to come),
over the pool; or, when state slots are the scarcer pool, the share of slots taken. When the
most and the least loaded live, undrained workers differ by more than the threshold, the
request on the first with the most tokens still to come moves to the second, provided the
second has room for what it holds now and the move does not just swap the imbalance. Only
workers that decode take part: a prefill worker (`roles`) hands its requests over itself. While
requests wait (new or retracted), nothing moves: admission puts them where the room is, which
balances at no cost, and a moved request would only take the room a waiting one gets next.

    move = pick_move(views, threshold=0.25, busy={"req-3"}, queued=False)  # -> Move(request, src, dst) | None
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from raysched.request import Request, State
from raysched.scheduler.planner import WorkerView
from raysched.scheduler.roles import Role, effective_role


@dataclass(frozen=True)
class Move:
    request: Request
    src: int
    dst: int


def virtual_usage(view: WorkerView) -> float:
    """The fraction of the scarcer pool the running requests will need by their end."""
    live = [r for r in view.running if r.state is State.RUNNING]
    tokens = sum(r.num_cached + r.remaining for r in live)
    return max(tokens / view.total_tokens, len(live) / view.total_slots)


def pick_move(views: list[WorkerView], threshold: float, busy: Collection[str] = frozenset(),
              queued: bool = False) -> Move | None:
    """One move from the most to the least loaded of `views` (live, undrained workers), or None.
    `busy`: requests already being moved; `queued`: requests are waiting for room."""
    if queued:
        return None
    if any(v.role is not Role.BOTH for v in views):  # (a worker's own role never changes its effective one)
        views = [v for v in views if effective_role(v, views) is not Role.PREFILL]
    if len(views) < 2:
        return None
    loads = {v.index: virtual_usage(v) for v in views}
    heavy = max(views, key=lambda v: (loads[v.index], -v.index))
    light = min(views, key=lambda v: (loads[v.index], v.index))
    gap = loads[heavy.index] - loads[light.index]
    if gap <= threshold:
        return None
    movable = [r for r in heavy.running if r.state is State.RUNNING and r.num_generated
               and r.request_id not in busy and r.num_cached + 16 <= light.free_tokens]
    if len(heavy.running) < 2 or not movable or light.free_slots < 1:  # moving a lone request only swaps
        return None
    best = max(movable, key=lambda r: (r.remaining, r.num_cached))
    share = (best.num_cached + best.remaining) / heavy.total_tokens
    if share >= gap:  # the move would only swap the imbalance
        return None
    return Move(best, heavy.index, light.index)
