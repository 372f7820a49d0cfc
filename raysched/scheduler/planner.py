"""Plan one worker's next call from the scheduler's mirror of its pool (pure: no Ray, no torch).

Order of decisions, per call:
1. forced retraction (testing switch: one victim at the first decision made at or after each
   multiple of `force_retract_every` calls; a pipelined call is not a decision);
2. fit the decode steps: halve the number of steps until the KV they need fits; if even one
   step does not fit, retract victims (policy order, protected requests skipped) until it does;
3. resume retracted requests (oldest retraction first) while they fit;
4. admit waiting requests (FCFS) while they fit and this worker has the most room (or, with
   prefix reuse, is where the request's matched state lies and has room within a slack of the
   most, or, for a long prompt with no match, has the fewest blocks waiting to be prefilled:
   `Placement`) — only when no retracted request is waiting, so retracted requests always
   go first. A request left to the worker holding its match is passed over, not waited behind:
   the ones after it (of its priority) may still start here;
5. preempt: when the head of the waiting queue is more urgent than some running request here
   and fits on no worker, retract the least urgent running requests until it fits, and admit it.

Worker roles (`roles`): `plan_for_role` shapes these decisions for a prefill worker (admit and
prefill, hand the prefilled requests over, no decode steps) and a decode worker (resume and
decode, never admit); a worker with both roles gets `plan_step` unchanged.

A request whose prefill has not started has nothing computed (nothing to snapshot): it is never
a victim. The worker's prefill order is known (a call's new prompts first, then those still
prefilling, each by a whole chunk until the call's budget is spent; the first always advances), so
the view keeps the requests no call is sure to have fed yet (`WorkerView.unfed`, `note_prefills`).

Priorities (lower is more urgent) order both queues (the scheduler keeps them sorted, see
`request.enqueue`); a request only ever waits behind requests at least as urgent. With every
priority equal (the default 0) steps 3-5 reduce to: resumes first, then FCFS admissions.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from raysched.config import SchedulerConfig
from raysched.request import Request, State
from raysched.scheduler.policy import order_victims, pages
from raysched.scheduler.roles import Role, effective_role, needs_prefill


@dataclass
class WorkerView:
    """What the scheduler knows of one worker's pool (ground truth after each call)."""

    index: int
    free_tokens: int
    free_slots: int
    total_tokens: int
    total_slots: int
    page_size: int
    running: list[Request] = field(default_factory=list)
    allocated: dict[str, int] = field(default_factory=dict)  # request id -> KV tokens held
    calls: int = 0
    forced_round: int = 0  # calls // force_retract_every at the last forced retraction
    role: Role = Role.BOTH  # what this worker does (see `roles`)
    ready: set[str] = field(default_factory=set)  # prefill role: ids prefilled, to hand over
    prefilling: dict[str, int] = field(default_factory=dict)  # id -> tokens its prefill feeds, for
    #   requests this worker may still be prefilling (until a token beyond those comes back)
    unfed: set[str] = field(default_factory=set)  # of those, the ones no call is sure to have fed a
    #   chunk of: nothing computed yet, so never a victim (see `note_prefills`)

    def room(self) -> float:
        """Fraction of the scarcer pool that is free."""
        return min(self.free_tokens / self.total_tokens, self.free_slots / self.total_slots)

    def held(self, req: Request) -> int:
        """Page-rounded KV tokens a running request holds."""
        return pages(self.allocated.get(req.request_id, req.num_cached), self.page_size) * self.page_size


@dataclass
class Decision:
    """What the planner decided for one worker's next call (the dispatcher turns it into the
    `messages.StepPlan` the worker receives)."""

    victims: list[Request] = field(default_factory=list)
    resume: list[Request] = field(default_factory=list)
    admit: list[Request] = field(default_factory=list)
    decode_steps: int = 0
    preempted: int = 0  # victims retracted to admit a more urgent request
    forced_round: int = 0  # > 0: a forced retraction was due (the view records it)
    handovers: list[Request] = field(default_factory=list)  # prefill role: prefilled, snapshot them
    #   for a decode worker (a planned retraction, see `roles`)
    continue_prefill: bool = False  # prefill role: a call without decode steps is still due

    def is_empty(self) -> bool:
        return not (self.victims or self.resume or self.admit or self.decode_steps or self.handovers
                    or self.continue_prefill)


class Placement(Protocol):
    """Where waiting requests would rather run (`raysched.prefix_cache.Placement`)."""

    def admits_here(self, r: Request, index: int, room: float, best_elsewhere: float,
                    admitted: Sequence[Request] = ()) -> bool: ...

    def waits_elsewhere(self, r: Request, index: int) -> bool: ...


def decode_need(view: WorkerView, running: list[Request], steps: int) -> int:
    """Page-rounded KV tokens the `running` requests must newly take for `steps` decode steps."""
    ps = view.page_size
    need = 0
    for r in running:
        target = r.num_cached + min(steps, max(r.remaining, 0))
        need += max(0, pages(target, ps) * ps - view.held(r))
    return need


def plan_step(view: WorkerView, waiting: deque[Request], retracted: deque[Request],
              cfg: SchedulerConfig, best_room_elsewhere: float, reserve: bool = False,
              others: tuple[WorkerView, ...] = (), placement: Placement | None = None) -> Decision:
    """Decide the next call of the worker described by `view` (mutates the queues it takes from).
    `others`: the other live workers (preemption happens only when no worker has room).
    `placement`: which worker a waiting request would rather run on (None: the roomiest)."""
    plan = Decision()
    settle_prefills(view)
    running = list(view.running)
    free, slots = view.free_tokens, view.free_slots
    if cfg.force_retract_every and view.calls // cfg.force_retract_every > view.forced_round:
        plan.forced_round = view.calls // cfg.force_retract_every
        free, slots = _retract(view, running, plan, 1, free, slots, cfg)
    steps = cfg.decode_steps_per_call
    need = decode_need(view, running, steps)
    while need > free and steps > 1:
        steps = max(1, steps // 2)
        need = decode_need(view, running, steps)
    while need > free:
        before = len(plan.victims)
        free, slots = _retract(view, running, plan, 1, free, slots, cfg)
        if len(plan.victims) == before:
            break  # everyone left is protected: the worker decodes whom it can
        need = decode_need(view, running, steps)
    free -= need
    if not (waiting and retracted and waiting[0].priority < retracted[0].priority):
        free, slots = _take_resumes(view, retracted, plan, steps, free, slots, cfg, waiting)
    if not retracted or (waiting and waiting[0].priority < retracted[0].priority):
        free, slots = _take_admissions(view, waiting, plan, steps, free, slots, cfg, best_room_elsewhere,
                                       reserve, retracted, placement)
    if cfg.preemption and not reserve:
        _preempt(view, waiting, retracted, running, plan, steps, free, slots, cfg, others)
    if running or plan.resume or plan.admit:
        plan.decode_steps = steps
    note_prefills(view, plan, cfg, running)
    if plan.decode_steps and prefill_backlog(view, cfg):
        plan.decode_steps = 1  # the next chunks come with the next call: sooner, and fewer
        #   decode steps run at a partial batch while prompts wait to be fed
    return plan


def prefill_backlog(view: WorkerView, cfg: SchedulerConfig) -> bool:
    """Whether prompt tokens on this worker may remain unfed after the call just noted: a
    request it surely does not feed (the budget), or one longer than a chunk (it needs more
    than one call). A call's own prompts advance only at its start (joins' between its
    steps), so such a call is kept to one decode step and is not folded (`Dispatcher.fold`)."""
    chunk = cfg.prefill_chunk_tokens
    return bool(view.unfed) or bool(chunk and any(n > chunk for n in view.prefilling.values()))


def settle_prefills(view: WorkerView) -> None:
    """Bring `view.prefilling` up to date before a decision: forget the requests that left the
    worker or have a token beyond their prefill (it ended); take in, as unfed, any running
    request without a token that no plan placed here (one that joined a long call)."""
    if view.prefilling:
        here = {r.request_id: r for r in view.running}
        for rid in [rid for rid, fed in view.prefilling.items() if rid not in here or here[rid].num_tokens > fed]:
            del view.prefilling[rid]
            view.unfed.discard(rid)
    for r in view.running:
        if not r.output_ids and r.request_id not in view.prefilling:
            view.prefilling[r.request_id] = r.num_tokens
            view.unfed.add(r.request_id)


def note_prefills(view: WorkerView, plan: Decision, cfg: SchedulerConfig, running: list[Request]) -> None:
    """Record what the call `plan` decides will prefill, and which unfed requests it surely feeds.
    The worker feeds the new prompts (recomputes, then admissions) first, then the others still
    prefilling in an order not seen here, each by at most one chunk, until the budget is spent;
    the first always advances. A request counts as fed only if everything that may go before it
    (each counted at a whole chunk, the most it can take) leaves budget for it."""
    budget, chunk = cfg.prefill_budget_tokens, cfg.prefill_chunk_tokens
    for r in plan.resume:
        if not r.recompute:  # restored from a snapshot: something was computed
            view.prefilling[r.request_id] = r.num_tokens
    spent = 0
    for i, r in enumerate([r for r in plan.resume if r.recompute] + plan.admit):
        view.prefilling[r.request_id] = r.num_tokens
        _mark(view, r.request_id, fed=i == 0 or not budget or spent < budget)
        spent += _most_fed(r.num_tokens, chunk)
    if not view.unfed:
        return
    older = {r.request_id: view.prefilling[r.request_id] for r in running if r.request_id in view.prefilling}
    for rid in [rid for rid in older if rid in view.unfed]:
        ahead = spent + sum(_most_fed(n, chunk) for other, n in older.items() if other != rid)
        _mark(view, rid, fed=not budget or ahead < budget)


def _most_fed(num_tokens: int, chunk: int) -> int:
    """The most tokens one call feeds of a prefill of `num_tokens` (one chunk; 0: no chunks)."""
    return min(num_tokens, chunk) if chunk else num_tokens


def _mark(view: WorkerView, rid: str, fed: bool) -> None:
    if fed:
        view.unfed.discard(rid)
    else:
        view.unfed.add(rid)


def _retract(view: WorkerView, running: list[Request], plan: Decision, count: int, free: int,
             slots: int, cfg: SchedulerConfig) -> tuple[int, int]:
    for victim in order_victims(running, cfg.victim_order, cfg.max_retractions, view.unfed)[:count]:
        running.remove(victim)
        plan.victims.append(victim)
        free += view.held(victim)
        slots += 1
    return free, slots


def _fits(tokens: int, view: WorkerView, free: int, slots: int) -> bool:
    return slots >= 1 and pages(tokens, view.page_size) * view.page_size <= free


def _take_resumes(view: WorkerView, retracted: deque[Request], plan: Decision, steps: int, free: int,
                  slots: int, cfg: SchedulerConfig, waiting: deque[Request]) -> tuple[int, int]:
    room = (cfg.max_batch_size or 1 << 30) - (len(view.running) - len(plan.victims))
    return _take(retracted, plan.resume, room, view, free, slots,
                 need=lambda r: r.num_cached + 1 + min(steps, max(r.remaining, 0)),
                 blocked=lambda r: bool(waiting) and waiting[0].priority < r.priority)  # a more urgent one waits


def _take_admissions(view: WorkerView, waiting: deque[Request], plan: Decision, steps: int, free: int,
                     slots: int, cfg: SchedulerConfig, best_room_elsewhere: float, reserve: bool,
                     retracted: deque[Request], placement: Placement | None = None) -> tuple[int, int]:
    if reserve:  # no-overcommit baseline: running requests keep room for their whole budget
        free -= sum(pages(len(r.prompt_ids) + r.sampling.max_new_tokens, view.page_size) * view.page_size
                    - view.held(r) for r in view.running)
    room = (cfg.max_batch_size or 1 << 30) - (len(view.running) - len(plan.victims) + len(plan.resume))
    budget = (lambda r: r.sampling.max_new_tokens) if reserve else (lambda r: min(steps, r.sampling.max_new_tokens))
    first = retracted[0].priority if retracted else None  # a retracted request goes first
    here = view.room()
    return _take(waiting, plan.admit, room, view, free, slots,
                 need=lambda r: len(r.prompt_ids) + budget(r),
                 blocked=lambda r: (first is not None and r.priority >= first
                                    or not _admits_here(r, view, here, best_room_elsewhere, placement, plan.admit)),
                 passed=lambda r: (first is None or r.priority < first) and placement is not None
                 and placement.waits_elsewhere(r, view.index))


def _admits_here(r: Request, view: WorkerView, room: float, best_elsewhere: float,
                 placement: Placement | None, admitted: Sequence[Request]) -> bool:
    """Does this worker take `r`, or another one: with more room, or where `r`'s state lies
    (or, for a long prompt with no match, with less prefill waiting)?"""
    if placement is None:
        return room >= best_elsewhere
    return placement.admits_here(r, view.index, room, best_elsewhere, admitted)


def _take(queue: deque[Request], taken: list[Request], room: int, view: WorkerView, free: int, slots: int,
          need: Callable[[Request], int], blocked: Callable[[Request], bool],
          passed: Callable[[Request], bool] = lambda r: False) -> tuple[int, int]:
    """Move requests from the head of `queue` to `taken` while fewer than `room` are taken, the
    head is not `blocked`, and its `need` (KV tokens) fits; returns the (free, slots) left. A
    blocked request that another worker will take (`passed`) is passed over: the scan goes on
    to the next one of the same priority instead of stopping there."""
    i = 0
    while i < len(queue) and len(taken) < room:
        r = queue[i]
        if i and r.priority != queue[0].priority:
            break
        if blocked(r):
            if passed(r):
                i += 1
                continue
            break
        if not _fits(need(r), view, free, slots):
            break
        del queue[i]
        taken.append(r)
        free -= pages(need(r), view.page_size) * view.page_size
        slots -= 1
    return free, slots


def _admit_need(r: Request, steps: int, page_size: int) -> int:
    return pages(len(r.prompt_ids) + min(steps, r.sampling.max_new_tokens), page_size) * page_size


def _fits_anywhere(need: int, views: tuple[WorkerView, ...], steps: int) -> bool:
    return any(v.free_slots >= 1 and need <= v.free_tokens - decode_need(v, v.running, steps) for v in views)


def _preempt(view: WorkerView, waiting: deque[Request], retracted: deque[Request], running: list[Request],
             plan: Decision, steps: int, free: int, slots: int, cfg: SchedulerConfig,
             others: tuple[WorkerView, ...]) -> None:
    """Retract the least urgent running requests (strictly less urgent than the waiting head,
    not protected) until the head fits here, then admit it; nothing if the head fits on some
    worker already, a retracted request is at least as urgent, or even every such victim would
    not make room."""
    if not waiting or (retracted and retracted[0].priority <= waiting[0].priority):
        return
    head = waiting[0]
    if not any(r.priority > head.priority for r in running):
        return  # no one here is less urgent (checked first: the fit checks scan every worker)
    need = _admit_need(head, steps, view.page_size)
    if _fits(need, view, free, slots) or _fits_anywhere(need, others, steps):
        return
    candidates = [r for r in order_victims(running, cfg.victim_order, cfg.max_retractions, view.unfed)
                  if r.priority > head.priority]
    candidates.sort(key=lambda r: -r.priority)  # stable: the victim order within a priority
    chosen = []
    for r in candidates:
        if _fits(need, view, free, slots):
            break
        chosen.append(r)
        free += view.held(r) + decode_need(view, [r], steps)
        slots += 1
    if not chosen or not _fits(need, view, free, slots):
        return
    for r in chosen:
        running.remove(r)
        plan.victims.append(r)
    plan.preempted += len(chosen)
    plan.admit.append(waiting.popleft())


def plan_for_role(view: WorkerView, waiting: deque[Request], retracted: deque[Request], cfg: SchedulerConfig,
                  best_room_elsewhere: float, reserve: bool, others: tuple[WorkerView, ...],
                  placement: Placement | None = None) -> Decision:
    """`planner.plan_step` shaped by `view`'s role (mutates the queues it takes from)."""
    role = effective_role(view, others)
    if role is Role.BOTH:
        return plan_step(view, waiting, retracted, cfg, best_room_elsewhere, reserve, others, placement)
    if role is Role.PREFILL:
        return _plan_prefill(view, waiting, retracted, cfg, others, reserve)
    return _plan_decode(view, retracted, cfg, others)


def _plan_prefill(view: WorkerView, waiting: deque[Request], retracted: deque[Request], cfg: SchedulerConfig,
                  others: tuple[WorkerView, ...], reserve: bool) -> Decision:
    """Hand over the prefilled requests, admit new prompts and resume those that need a prefill;
    no decode steps (a call with running requests continues their prefill)."""
    ready = [r for r in view.running if r.request_id in view.ready and r.state is State.RUNNING]
    view.ready.intersection_update(r.request_id for r in view.running)
    view.ready.difference_update(r.request_id for r in ready)
    rest = [r for r in view.running if r not in ready]
    trimmed = dataclasses.replace(view, running=rest, free_tokens=view.free_tokens + sum(view.held(r) for r in ready),
                                  free_slots=view.free_slots + len(ready))
    peers = tuple(o for o in others if o.role is not Role.DECODE)
    best = max((o.room() for o in peers), default=-1.0)
    mine = deque(r for r in retracted if needs_prefill(r))
    decision = plan_step(trimmed, waiting, mine, dataclasses.replace(cfg, decode_steps_per_call=1), best,
                         reserve, peers)
    _take_out(retracted, decision.resume)
    decision.handovers = ready
    decision.continue_prefill = bool(rest) or bool(decision.admit or decision.resume)
    decision.decode_steps = 0
    return decision


def _plan_decode(view: WorkerView, retracted: deque[Request], cfg: SchedulerConfig,
                 others: tuple[WorkerView, ...]) -> Decision:
    """Resume snapshots (hand-overs targeted here, or at no live worker) and decode; never admit."""
    alive = {o.index for o in others}
    mine = deque(r for r in retracted if not needs_prefill(r)
                 and (r.target_worker in (None, view.index) or r.target_worker not in alive))
    decision = plan_step(view, deque(), mine, cfg, -1.0, False, ())
    _take_out(retracted, decision.resume)
    return decision


def _take_out(queue: deque[Request], taken: list[Request]) -> None:
    for r in taken:
        queue.remove(r)


Plan = Decision  # its former name (old imports keep working)
