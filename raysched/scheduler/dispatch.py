"""The dispatch-and-apply loop: one asyncio task per worker, plan -> call -> apply.

    decide (pure, `planner.plan_step`)  ->  retract victims + step call  ->  apply the result

so a slow worker never blocks the others, and client calls get through between awaits. A
pure-decode call whose successor needs no decision runs that successor's steps too (*folded*,
`scheduler.fold_successor`: one Ray call instead of two), and up to `fold_calls` calls' steps
while none of them needs one (a *long call*, which the scheduler interrupts when something
does: `interrupt_for_waiting`, `Fleet.interrupt`); with folding off, the successor follows at
once as a second call (*pipelined*: the worker never waits for the scheduler); forced
retraction (a testing switch) turns neither off. A step call streams its tokens (`scheduler.stream_each_step`):
each decode step's tokens go to the clients as the worker sends them, while the call runs on.
Applying the call's result adds any tokens not sent yet, ends the requests that finished, puts
back those that did not fit, and hands over to the prefix-reuse glue; a failed call goes to
recovery.

No Ray import: worker handles are opaque (`handle.step.remote(...)` returns an awaitable,
`handle.step_stream.options(num_returns="streaming").remote(...)` an async iterator of them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from typing import Any, Callable

from raysched.background import detached_task
from raysched.config import ServeConfig
from raysched.messages import SNAPSHOT_LOST, PrefillItem, StepPlan, StepResult
from raysched.request import Request, State, enqueue
from raysched.scheduler.faults import FaultSeam
from raysched.scheduler.fleet import Fleet, WorkerSlot
from raysched.scheduler.joins import OpenCall
from raysched.scheduler.planner import Decision, decode_need, plan_for_role, prefill_backlog
from raysched.scheduler.prefix_cache import PrefixCache
from raysched.scheduler.recovery import Recovery
from raysched.scheduler.retraction import RetractionLedger
from raysched.scheduler.roles import note_prefilled
from raysched.scheduler.table import RequestTable
from raysched.stats import Counters

log = logging.getLogger("raysched.scheduler")


class Dispatcher:
    def __init__(self, config: ServeConfig, table: RequestTable, fleet: Fleet, counters: Counters,
                 ledger: RetractionLedger, cache: PrefixCache, recovery: Recovery, faults: FaultSeam) -> None:
        self.config = config
        self.table = table
        self.fleet = fleet
        self.counters = counters
        self.ledger = ledger
        self.cache = cache
        self.recovery = recovery
        self.faults = faults
        self.before_decide: Callable[[WorkerSlot], None] = lambda w: None  # (live migration's stop-and-copy)
        self.migrating: Callable[[WorkerSlot], bool] = lambda w: False  # (a live migration involves w)
        self.round_due: Any = None  # the interrupt round scheduled for waiting requests, if any
        self.notices: Any = None  # this scheduler's own handle, for long calls' finish notices
        #   (`with_notices`; None outside an actor: long calls end at a finish)
        self.notice_ids = 0  # the last `StepPlan.notice_id` given
        fleet.on_notify = self.interrupt_for_waiting

    # ------------------------------------------------------------------ loop
    def start_loop(self, w: WorkerSlot) -> None:
        w.task = detached_task(self.run(w))

    async def run(self, w: WorkerSlot) -> None:
        """Worker `w`'s loop, until the scheduler closes or the worker is retired."""
        try:
            while not self.recovery.closing and w.alive:
                self.before_decide(w)
                t0 = (time.perf_counter(), time.thread_time())
                decision = self.decide(w)
                if decision.is_empty():
                    await self.sleep(w)
                    continue
                await self.execute(w, decision, t0)
        except asyncio.CancelledError:
            pass
        except Exception as err:  # a bug in the scheduler itself: fail loudly, do not hang clients
            log.exception("worker loop %d crashed", w.index)
            self.table.fail(f"scheduler loop for worker {w.index} crashed: {err!r}")

    async def sleep(self, w: WorkerSlot) -> None:
        """Nothing to do for `w`: wait until `Fleet.notify` wakes it."""
        w.event.clear()
        self.fleet.idle[w.index] = w
        try:
            await w.event.wait()
        finally:
            self.fleet.idle.pop(w.index, None)

    def decide(self, w: WorkerSlot) -> Decision:
        """The planner's decision for `w`'s next call (takes requests off the queues). The other
        workers are looked at only when something waits for admission (where it goes, and
        whether it could fit elsewhere before preempting). Nothing new starts on a worker being
        drained, and a retracted request targeted at another live worker (a hand-over, a
        recompute migration) waits for it. With prefix reuse, requests waiting for blocks another
        request is prefilling are held back, and the others prefer the worker where their
        matched state lies."""
        waiting, retracted, placement = self.table.waiting, self.table.retracted, None
        if w.draining:  # nothing new starts on a worker being drained
            waiting, retracted = deque(), deque()
        elif any(self.fleet.targeted_elsewhere(r, w) for r in retracted):
            retracted = deque(r for r in retracted if not self.fleet.targeted_elsewhere(r, w))
        if waiting and not w.draining and self.cache.index is not None:
            rooms = {o.index: -1.0 if o.draining else o.view.room() for o in (w, *self.fleet.others(w))}
            held, placement = self.cache.survey(waiting, rooms)
            self.interrupt_for_late_asks(w)
            if held:
                waiting = deque(r for r in waiting if r.request_id not in held)
        best_elsewhere = self.fleet.best_room_except(w) if waiting else -1.0
        peers = (waiting and self.config.scheduler.preemption) or self.config.roles is not None  # roles: who is left
        others = tuple(o.view for o in self.fleet.others(w) if not o.draining) if peers else ()
        reserve = self.config.scheduler.admission == "reserve"
        decision = plan_for_role(w.view, waiting, retracted, self.config.scheduler,
                                 best_elsewhere, reserve, others, placement)
        if waiting is not self.table.waiting and not w.draining:
            for r in decision.admit:
                self.table.waiting.remove(r)
        if retracted is not self.table.retracted and not w.draining:
            for r in decision.resume:
                self.table.retracted.remove(r)
        self.counters.preemptions += decision.preempted
        if decision.forced_round:
            w.view.forced_round = decision.forced_round
        return decision

    # ------------------------------------------------------------------ call
    async def execute(self, w: WorkerSlot, decision: Decision, t0: tuple[float, float] | None = None) -> None:
        """Send `decision` to `w` (retractions, the step call, maybe a pipelined successor),
        await the replies, and apply them. `t0`: when the decision began, by the clock and by
        this thread's CPU time (its latency, and the CPU it took, are counted)."""
        prefixes = self.prefix_hits(w, decision)
        snap_victims, drop = self.ledger.take_victims(w, decision)
        resume_snap = [r for r in decision.resume if not r.recompute]
        cross_node = self.fleet.cross_node(resume_snap[0], w) if resume_snap else None
        self.mark_running(w, decision.resume + decision.admit)
        self.faults.before_call(w, self.fleet, holding=bool(w.view.running or snap_victims))
        folded = self.fold(w, decision)
        step = self.with_notices(w, self.step_plan(w, decision, drop, resume_snap, [r for r, _ in prefixes],
                                                   cross_node, folded))
        if folded > 2:  # more than one successor: the call ends early when interrupted
            self.fleet.start_long_call(w, step.call_id)
        retract_calls = [self.ledger.send(w, r) for r in snap_victims]  # queued: others may resume them
        calls = [self.send_step(w, step, *[[r.snapshot_ref] for r in resume_snap], *[e.refs for _, e in prefixes])]
        if step.joins:  # waiting requests may start inside it (`join_waiting`)
            w.open_call = OpenCall.of(w.view, step.call_id, decision.decode_steps, streams=calls[0][1],
                                      reserve=self.config.scheduler.admission == "reserve")
        self.ledger.count_resume_bytes(w, resume_snap)
        if not folded and self.can_pipeline(w, decision):  # the worker never waits for us
            calls.append(self.send_step(w, self.successor_plan(w, decision.decode_steps)))
            self.counters.pipelined_calls += 1
        w.view.calls += len(calls)
        if t0 is not None:
            self.counters.decision_s.append(time.perf_counter() - t0[0])
            self.counters.decision_cpu_s.append(time.thread_time() - t0[1])
        result, streamed = await self.receive(calls[0])
        if w.noticing:  # its tokens that finish notices applied already
            streamed, w.noticing, w.noticed = {**streamed, **w.noticed}, 0, {}
        self.fleet.end_long_call(w)
        self.settle_joins(w, decision, result)
        self.apply(w, decision, result, resume_snap, streamed)  # its last tokens go out now,
        if len(calls) == 2:  # while the pipelined call runs
            result, streamed = await self.receive(calls[1])
            self.apply(w, Decision(decode_steps=decision.decode_steps), result, [], streamed)
        sizes = await asyncio.gather(*[call[1] for call in retract_calls], return_exceptions=True)
        self.ledger.on_sizes(w, snap_victims, retract_calls, sizes)
        self.fleet.notify(interrupt=False)  # (the queues are this loop's to serve next)

    def send_step(self, w: WorkerSlot, plan: StepPlan, *args: Any) -> tuple[Any, bool]:
        """Start a step call: (the call, whether it streams). It streams (`Worker.step_stream`, a
        Ray streaming generator) when a request on `w` is read as it comes
        (`Request.streaming`) and `scheduler.stream_each_step` is on; else one reply
        (`Worker.step`): a message per decode step costs the scheduler, so only a reader gets it."""
        if self.streams(w):
            return w.handle.step_stream.options(num_returns="streaming").remote(plan, *args), True
        return w.handle.step.remote(plan, *args), False

    def streams(self, w: WorkerSlot) -> bool:
        """Does a step call to `w` now stream each step to us (`send_step`)?"""
        sinks = self.table.sinks
        return self.config.scheduler.stream_each_step and any(r.streaming and r.request_id not in sinks
                                                              for r in w.view.running)

    async def receive(self, sent: tuple[Any, bool]) -> tuple[Any, dict[str, int]]:
        """A step call's `StepResult` (or the exception it raised), and how many of its tokens
        per request went out ahead of it: a streamed call's `StepTokens` are applied as they
        come, so each decode step's tokens reach the clients as that step completes."""
        call, streams = sent
        streamed: dict[str, int] = {}
        if not streams:
            return await settled(call), streamed
        result: Any = RuntimeError("a step stream ended without its result")
        try:
            async for ref in call:  # to its end, so the stream's own references are released
                piece = await ref
                if isinstance(piece, StepResult):
                    result = piece
                    continue
                self.add_tokens(piece.new_tokens, time.monotonic())
                for rid, toks in piece.new_tokens.items():
                    streamed[rid] = streamed.get(rid, 0) + len(toks)
        except Exception as err:  # (after its result: the worker's next call finds out)
            return (result if isinstance(result, StepResult) else err), streamed
        return result, streamed

    def prefix_hits(self, w: WorkerSlot, decision: Decision) -> list:
        """(request, match) for each admitted request whose prompt starts with a parked point;
        admissions whose blocks another request is about to prefill go back to the queue."""
        hits, back = self.cache.admit(decision.admit, w.index)
        for r in reversed(back):
            decision.admit.remove(r)
            enqueue(self.table.waiting, r, front=True)
        self.interrupt_for_late_asks(w)
        return hits

    def interrupt_for_late_asks(self, w: WorkerSlot) -> None:
        """End the long calls of other workers asked for a branch point their prefill passed
        (`PrefixCache.late_unsent`): the states they keep for it age out, and its request may
        finish meanwhile."""
        for index in self.cache.late_unsent() - {w.index}:
            self.fleet.interrupt(self.fleet.slots[index])

    def step_plan(self, w: WorkerSlot, decision: Decision, drop: list[str], resume_snap: list[Request],
                  prefixed: list[Request], cross_node: bool | None, folded: int = 0) -> StepPlan:
        """The message for `w`: drop, resume these snapshots, prefill the rest, decode (`folded`:
        the successors folded in, `fold`; a long call ends at the first request that finishes)."""
        starting = [r for r in decision.resume if r.recompute] + decision.admit
        prefill = [prefill_item(r, self.table.sink_for(r, w.index, starts=True)) for r in starting]
        cfg = self.config.scheduler
        return StepPlan(drop=tuple(drop), resume=tuple(r.request_id for r in resume_snap), prefill=tuple(prefill),
                        sinks=self.sinks_to_send(w, resume_snap) if self.table.sinks else (),
                        decode_steps=decision.decode_steps, prefix=tuple(r.request_id for r in prefixed),
                        park_min_tokens=self.cache.park_min_tokens(), park_at=self.cache.park_at(w.index),
                        trail_calls=self.cache.trail_calls(), park_turns=self.cache.park_turns(),
                        fault=self.faults.step_point(w, w.view.calls, decision.decode_steps, cross_node,
                                                     folded=folded > 0),
                        prefill_chunk_tokens=cfg.prefill_chunk_tokens, prefill_budget_tokens=cfg.prefill_budget_tokens,
                        call_id=w.view.calls + 1, end_at_finish=folded > 2,
                        joins=folded > 2 and self.joins_taken(w))

    def sinks_to_send(self, w: WorkerSlot, resume_snap: list[Request]) -> tuple[tuple[str, Any, int], ...]:
        """`StepPlan.sinks`: the readers' sinks of the requests resumed from snapshots here, and of
        the running ones `w` has not been sent (`RequestTable.sink_for`), with their positions."""
        resumed = [(r, self.table.sink_for(r, w.index, starts=True)) for r in resume_snap]
        running = [(r, self.table.sink_for(r, w.index)) for r in w.view.running if r.request_id in self.table.sinks]
        return tuple((r.request_id, sink, r.num_generated) for r, sink in resumed + running if sink is not None)

    def successor_plan(self, w: WorkerSlot, decode_steps: int) -> StepPlan:
        """The pipelined call: decode on, nothing else."""
        cfg = self.config.scheduler
        return StepPlan(decode_steps=decode_steps, park_min_tokens=self.cache.park_min_tokens(),
                        trail_calls=self.cache.trail_calls(), park_turns=self.cache.park_turns(),
                        fault=self.faults.step_point(w, w.view.calls + 1, decode_steps, None, pipelined=True),
                        prefill_chunk_tokens=cfg.prefill_chunk_tokens, prefill_budget_tokens=cfg.prefill_budget_tokens)

    def fold(self, w: WorkerSlot, decision: Decision) -> int:
        """With `scheduler.fold_successor`, a call whose successor would be pipelined runs the
        successors' decode steps itself: `decision.decode_steps` grows `fold_factor` times (the
        same steps between two decisions, with one Ray call and one reply instead of several:
        Ray's task submission was half the scheduler's CPU at 32 workers, `raysched bench
        scale`, benchmarks/README). Returns the factor (0: not folded)."""
        if not (self.config.scheduler.fold_successor and self.can_pipeline(w, decision)):
            return 0
        if prefill_backlog(w.view, self.config.scheduler):
            return 0  # prompts wait to be fed: those feed at each call's start
        factor = self.fold_factor(w, decision.decode_steps)
        decision.decode_steps *= factor
        self.counters.folded_calls += 1
        return factor

    def fold_factor(self, w: WorkerSlot, steps: int) -> int:
        """How many calls' steps one folded call runs: 2 (`can_pipeline` holds), or up to
        `scheduler.fold_calls` while the running requests have room for all the steps. Beyond
        2 the call is a *long call*: it ends after the step in which a request finishes
        (`StepPlan.end_at_finish`: that room may be needed, and its client hears at once), and
        anything else that needs a decision there (a request waiting for room, an abort, a
        drain, a reader) interrupts it (`interrupt_for_waiting`, `Fleet.interrupt`). No long
        calls on a worker a live migration involves (its stages run between calls)."""
        limit = self.config.scheduler.fold_calls
        if limit <= 2 or w.draining or self.migrating(w):
            return 2
        def fits(factor: int) -> bool:  # (the need grows with the steps: a bisection finds the most)
            return decode_need(w.view, w.view.running, factor * steps) <= w.view.free_tokens

        if fits(limit):
            return limit
        lo, hi = 2, limit  # lo: at least 2, as without room checks; hi does not fit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def interrupt_for_waiting(self) -> None:
        """Requests may wait (`Fleet.notify`): once the oldest has waited `join_after_ms`, send
        those that waited that long into long calls with room (`join_waiting`), and once it has
        waited `interrupt_after_ms`, interrupt long calls for those still waiting
        (`interrupt_round`; sooner, a call that ends anyway may start them: with many workers one
        ends every few ms, and each interrupt costs a call and the worker's wait for the next)."""
        if self.round_due is None:
            self.schedule_round(last_s=float("-inf"))

    def waits_s(self) -> tuple[float, float]:
        """(how long a request waits before it joins a long call, before it interrupts one)."""
        cfg = self.config.scheduler
        interrupt_s = cfg.interrupt_after_ms / 1000.0
        return (min(cfg.join_after_ms / 1000.0, interrupt_s) if self.joining() else interrupt_s), interrupt_s

    def schedule_round(self, last_s: float) -> None:
        """Run `interrupt_round` when a queued request reaches its next wait (`waits_s`) that
        the round at `last_s` did not see it reach (now, if one has)."""
        join_s, interrupt_s = self.waits_s()
        dues = [r.arrival_s + (join_s if r.arrival_s > last_s - join_s else interrupt_s)
                for r in (*self.table.waiting, *self.table.retracted) if r.arrival_s > last_s - interrupt_s]
        if not dues:
            return
        wait_s = min(dues) - time.monotonic()
        if wait_s > 0:
            self.round_due = asyncio.get_running_loop().call_later(wait_s, self.interrupt_round)
        else:
            self.interrupt_round()

    def interrupt_round(self) -> None:
        """Join the requests that waited `join_after_ms` into long calls (`join_waiting`),
        interrupt long calls for those that waited `interrupt_after_ms` (`interrupt_for`), and
        set the round for the next one to get there."""
        self.round_due = None
        now = time.monotonic()
        join_s, interrupt_s = self.waits_s()
        if self.joining():
            self.join_waiting([r for r in self.table.waiting if r.arrival_s <= now - join_s])
        ripe_s = now - interrupt_s
        self.interrupt_for([r for r in self.table.waiting if r.arrival_s <= ripe_s],
                           [r for r in self.table.retracted if r.arrival_s <= ripe_s])
        self.schedule_round(last_s=now)

    # ------------------------------------------------------------------ joins (see `joins`)
    def joining(self) -> bool:
        """Do long calls take joins here: `scheduler.join_long_calls`, and no prefix reuse (a
        joined request starts from nothing: it has no parked state to restore)."""
        return self.config.scheduler.join_long_calls and self.cache.index is None

    def joins_taken(self, w: WorkerSlot) -> bool:
        """Will a long call to `w` take joins (`StepPlan.joins`)?"""
        return self.joining() and w.info.joins and self.config.roles is None

    def join_waiting(self, ripe: list[Request]) -> None:
        """Send `ripe` (waiting requests, in queue order) into long calls that have room for
        them, roomiest first, while no retracted request waits (those go first, as in the
        planner). Each taken request is running on that worker from now on."""
        if not ripe or self.table.retracted:
            return
        cap = self.config.scheduler.max_batch_size or 1 << 30
        open_calls = sorted((o for o in self.fleet.long_calls.values() if o.open_call is not None
                             and o.open_call.free_slots > 0 and o.open_call.call_id == o.long_call and not o.draining),
                            key=lambda o: -o.open_call.free_slots)
        for o in open_calls:
            call = o.open_call
            taken = call.take(ripe if call.streams else [r for r in ripe if not r.streaming],
                              o.view.page_size, cap - len(o.view.running))
            if not taken:
                continue
            for r in taken:
                self.table.waiting.remove(r)
            gone = {id(r) for r in taken}  # (by identity: a Request compares all its fields)
            ripe = [r for r in ripe if id(r) not in gone]
            call.debit(o.view, taken)
            self.mark_running(o, taken)
            self.counters.joins += len(taken)
            items = [prefill_item(r, self.table.sink_for(r, o.index, starts=True)) for r in taken]
            self.fleet.forget(o.handle.join.remote(call.call_id, items))
            if not ripe:
                return

    def with_notices(self, w: WorkerSlot, step: StepPlan) -> StepPlan:
        """A long call that takes joins and replies once goes on past a request's finish and
        tells us of it (`StepPlan.notices`, `on_finish_notice`), with `scheduler.finish_notices`:
        its other requests then see no gap where the call would have ended, and the finished
        one's room takes a join, without the worker waiting for a round trip here."""
        if not (step.joins and self.notices is not None and self.config.scheduler.finish_notices) or self.streams(w):
            return step
        self.notice_ids += 1
        w.noticing, w.noticed = self.notice_ids, {}
        return dataclasses.replace(step, notices=self.notices, notice_id=self.notice_ids)

    def on_finish_notice(self, index: int, notice_id: int, ended: dict[str, tuple[str, list[int]]]) -> None:
        """Worker `index`'s call `notice_id` is going on past `ended` (id -> (why, its tokens of
        that call)): each ends now with those tokens (the call's reply skips them), and its room
        (the KV it held, its slot, what the call kept for its steps) goes back to the worker's
        view and to the call's joins; then the ripe waiting requests may join. A notice for a
        call that is over, or a request that is no longer running there, changes nothing."""
        w = self.fleet.slots[index] if 0 <= index < len(self.fleet.slots) else None
        if w is None or not w.alive or w.noticing != notice_id:
            return
        now = time.monotonic()
        for rid, (reason, toks) in ended.items():
            req = self.table.requests.get(rid)
            if req is not None and req.state is State.RUNNING and req.worker == index and rid not in w.noticed:
                self.end_noticed(w, req, reason, toks, now)
        if self.joining():
            join_s, _ = self.waits_s()
            self.join_waiting([r for r in self.table.waiting if r.arrival_s <= now - join_s])

    def end_noticed(self, w: WorkerSlot, req: Request, reason: str, toks: list[int], now: float) -> None:
        """End `req`, running in `w`'s call, with `toks` (its tokens of that call, which its
        reply will skip); its room goes back to `w`'s view and to the call's joins."""
        call = w.open_call
        held, kept = w.view.held(req), (call.need(req, w.view.page_size) if call is not None else 0)
        w.noticed[req.request_id] = len(toks)
        self.add_tokens({req.request_id: toks}, now)
        if req.state is State.RUNNING:
            self.finish(req, State.FINISHED, reason)
        if req not in w.view.running:  # (one a stop string ended stays there until dropped)
            w.view.allocated.pop(req.request_id, None)
            w.view.free_tokens, w.view.free_slots = w.view.free_tokens + held, w.view.free_slots + 1
            if call is not None:
                call.free_tokens, call.free_slots = call.free_tokens + kept, call.free_slots + 1
        self.counters.finish_notices += 1

    def settle_joins(self, w: WorkerSlot, decision: Decision, result: Any) -> None:
        """`w`'s long call replied: the requests sent to join it count as this call's admissions
        (applied with it); those it dropped (they came after its decoding ended) are listed
        as not admitted, so that `put_back` queues them again."""
        call, w.open_call = w.open_call, None
        if call is None or not call.sent:
            return
        decision.admit.extend(call.sent)
        if isinstance(result, StepResult):
            late = call.settle(result.joined, result.not_admitted)
            self.counters.joins_refused += sum(1 for r in call.sent if r.request_id in result.not_admitted)
            self.counters.joins_late += len(late)
            result.not_admitted.extend(late)

    def interrupt_for(self, waiting: list[Request], retracted: list[Request]) -> None:
        """End enough long calls that workers can start `waiting` and resume `retracted`.
        Workers that decide soon (no long call) take what their free slots hold; for the rest,
        the roomiest workers in long calls with free slots are interrupted until their slots
        cover it (a worker in a long call does not count as room elsewhere meanwhile:
        `Fleet.note_room`). A retracted request waiting for its target interrupts it. With
        preemption, when no worker has a free slot, the worker running the least urgent request
        is interrupted if a waiting one is more urgent."""
        fleet = self.fleet
        for r in retracted:
            if r.target_worker is not None and r.target_worker in fleet.long_calls:
                fleet.interrupt(fleet.slots[r.target_worker])
        need = len(waiting) + sum(1 for r in retracted if r.target_worker is None)
        if not need:
            return
        need -= sum(o.view.free_slots for o in fleet.slots if o.alive and not o.draining and not o.long_call)
        roomy = sorted((o for o in fleet.long_calls.values() if o.view.free_slots and not o.draining),
                       key=lambda o: -o.view.room())
        for o in roomy:
            if need <= 0:
                break
            need -= o.view.free_slots
            fleet.interrupt(o)
        if waiting and self.config.scheduler.preemption and not any(o.view.free_slots for o in fleet.alive()):
            self.interrupt_to_preempt(min(r.priority for r in waiting))

    def interrupt_to_preempt(self, urgent: int) -> None:
        """End the long call of the worker running the least urgent request, if it is less
        urgent (a larger `priority`) than `urgent`: its next decision may retract it."""
        calls = [(max(r.priority for r in o.view.running), o) for o in self.fleet.long_calls.values() if o.view.running]
        if calls:
            least, o = max(calls, key=lambda c: c[0])
            if least > urgent:
                self.fleet.interrupt(o)

    def can_pipeline(self, w: WorkerSlot, decision: Decision) -> bool:
        """Whether the call after this one needs no decision: nothing new starts on `w`, the
        running requests have room for twice the steps, and either nothing waits or no running
        request reaches its length limit in this call (so this call frees no room that a waiting
        request could take at once: what waits could not start here now, and could not after this
        call either). The worker then never waits for the scheduler between the two calls."""
        if decision.resume or decision.admit or not decision.decode_steps:
            return False
        steps = decision.decode_steps
        if (self.table.waiting or self.table.retracted) and any(r.remaining <= steps for r in w.view.running):
            return False
        return decode_need(w.view, w.view.running, 2 * steps) <= w.view.free_tokens

    def mark_running(self, w: WorkerSlot, reqs: list[Request]) -> None:
        for r in reqs:
            if r.state is State.RETRACTED:
                self.counters.on_resume(r.recompute, migrated=bool(r.workers) and r.workers[-1] != w.index,
                                        cross_node=self.fleet.cross_node(r, w))
            r.state, r.worker, r.target_worker = State.RUNNING, w.index, None
            r.workers.append(w.index)
            w.view.running.append(r)

    # ------------------------------------------------------------------ apply
    def apply(self, w: WorkerSlot, decision: Decision, result: Any, resumed: list[Request],
              streamed: dict[str, int] | None = None) -> None:
        """Apply one step call's reply (a `StepResult`, or the exception the call raised);
        `streamed`: its tokens per request that went out already (see `receive`)."""
        streamed = streamed or {}
        if isinstance(result, BaseException):
            for rid in streamed:  # a snapshot older than tokens sent: recompute from the history
                req = self.table.requests.get(rid)
                if req is not None:
                    req.snapshot_ref = None
            self.recovery.on_worker_failure(w, result)
            for r in resumed:  # their snapshots were not consumed: resume from them elsewhere
                r.recompute = r.snapshot_ref is None
            self.cache.forget_lookups(decision.admit)
            return
        now = time.monotonic()
        assert isinstance(result, StepResult)
        update_view(w, result)
        self.fleet.note_room(w)
        self.count_prefill(w, decision, result, streamed)
        note_prefilled(w.view, result.new_tokens, result.finished)
        self.add_tokens(result.new_tokens, now, skip=streamed)
        self.cache.on_result(w, decision, result)
        for r in resumed:
            if r.request_id not in result.not_admitted and r.request_id not in result.resume_failed:
                r.snapshot_ref = None  # restored: release the object
                if r.handover_s is not None:  # a hand-over arrived (see `roles`)
                    self.counters.on_handover_restored(now - r.handover_s)
                    r.handover_s = None
        self.put_back(w, result)
        for rid, reason in result.finished.items():
            req = self.table.requests.get(rid)
            if req is not None and req.state is State.RUNNING:
                self.finish(req, State.FINISHED, reason)
        self.counters.on_step(w.index, result, now)

    def count_prefill(self, w: WorkerSlot, decision: Decision, result: StepResult, streamed: dict[str, int]) -> None:
        """Prompt tokens this call's new prefills feed, by the worker's role (the history before
        this call's tokens joined it; turn-cache hits count only the suffix they prefill)."""
        for r in decision.admit + [r for r in decision.resume if r.recompute]:
            if r.request_id not in result.not_admitted:
                fed = r.num_tokens - streamed.get(r.request_id, 0) - result.cached.get(r.request_id, 0)
                self.counters.on_prefill(w.view.role.value, fed)

    def add_tokens(self, new_tokens: dict[str, list[int]], now: float, skip: dict[str, int] | None = None) -> None:
        """Give each running request its new tokens, but the first `skip[id]` (sent already)."""
        for rid, toks in new_tokens.items():
            req = self.table.requests.get(rid)
            if skip:
                toks = toks[skip.get(rid, 0):]
            if req is not None and req.state is State.RUNNING and toks:
                toks = cut_at_stop_string(req, toks)
                req.add_tokens(toks, now)
                self.counters.tokens += len(toks)
                self.table.notify(rid)
                if req.text_stream is not None and req.text_stream.stopped is not None:
                    self.finish(req, State.FINISHED, "stop", worker_holds=True)

    def put_back(self, w: WorkerSlot, result: StepResult) -> None:
        """Resumes and prefills that did not fit go back to the head of their queue."""
        for rid, why in result.resume_failed.items():
            req = self.table.requests.get(rid)
            if why.startswith(SNAPSHOT_LOST):  # its node died with it, or its retraction failed
                log.warning("%s of %s on worker %d; recomputing it instead", why, rid, w.index)
                self.counters.snapshots_lost += 1
                self.counters.recovered += 1
            else:
                log.warning("snapshot of %s refused on worker %d (%s); recomputing it instead", rid, w.index, why)
                self.counters.snapshots_refused += 1
            if req is not None and req.state is State.RUNNING:  # not aborted while in flight
                req.snapshot_ref, req.recompute = None, True
                self.table.unrun(req, w.view)
        for rid in result.not_admitted:
            req = self.table.requests.get(rid)
            if req is not None and req.state is State.RUNNING:  # an aborted one stays ended
                self.table.unrun(req, w.view)

    def stop(self, req: Request, generated: list[int]) -> None:
        """A reader's sink matched a stop string (`raysched.sink`): `generated` (what the reader
        received, up to the token that completed it) is the request's output, and it ends now,
        dropped from its worker as an abort is (the worker may hold it: its next call drops it)."""
        if req.state.is_done:
            return
        if req.state is State.WAITING:
            self.table.waiting.remove(req)
        elif req.state is State.RETRACTED and req in self.table.retracted:
            self.table.retracted.remove(req)
        req.output_ids, req.snapshot_ref = [int(t) for t in generated], None
        self.finish(req, State.FINISHED, "stop", worker_holds=True)

    def finish(self, req: Request, state: State, reason: str, worker_holds: bool = False) -> None:
        """End a request. One the worker still holds (aborted, or stopped by a stop string) stays
        in the worker's view until the next call drops it."""
        if req.worker is not None and not worker_holds and state is not State.ABORTED:
            view = self.fleet.slots[req.worker].view
            if req in view.running:
                view.running.remove(req)
        self.table.finish(req, state, reason)


async def settled(ref: Any) -> Any:
    """A call's reply, or the exception it raised."""
    try:
        return await ref
    except Exception as err:
        return err


def update_view(w: WorkerSlot, result: StepResult) -> None:
    """The worker's pools as its reply reports them (ground truth)."""
    u = result.usage
    w.view.free_tokens, w.view.free_slots = u.kv_free_tokens, u.state_free_slots
    w.view.allocated = dict(result.allocated)


def cut_at_stop_string(req: Request, tokens: list[int]) -> list[int]:
    """The new tokens up to the one that completes a stop string (all of them if none does)."""
    if req.text_stream is None:
        return tokens
    req.text_stream.add(tokens)
    if req.text_stream.stopped is None:
        return tokens
    return tokens[:req.text_stream.num_tokens - req.num_generated]


def prefill_item(r: Request, sink: Any = None) -> PrefillItem:
    return PrefillItem(r.request_id, r.token_ids, len(r.prompt_ids), r.sampling.to_dict(), sink)

