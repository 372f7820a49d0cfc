"""Live migration, drain and the elastic worker set: moving *running* requests (no Ray import,
no torch: worker handles are opaque).

A live migration of request r from worker S to worker D (Llumnix's protocol, with the hybrid
state in the last stage):

    reserve on D (slots for r's tokens)            -> False: r stays on S ("stayed")
    pre-copy stage k = 1..max_stages:              r keeps decoding on S meanwhile
        S.migrate_out(r, sent)  -> the K/V blocks r completed since the last stage (the scheduler
        D.migrate_in(r, [ref])     owns them in the object store; D reads them from there)
        fewer than `last_stage_tokens` unsent?     -> stop-and-copy, mode "live"
    else (stages used up)                          -> stop-and-copy from token 0, mode "snapshot"
    stop-and-copy, sent by S's dispatch loop between two of its calls (`send_finals`): r leaves
        S's running list, S.migrate_out(r, sent, final) copies the last K/V, every recurrent
        state tensor and the sampling state (a `Snapshot` with `kv_from` = sent) and frees r's
        slots; D.commit([ref]) writes it into the reservation; r decodes on D from D's next call.

S frees only in the stop-and-copy, after every pre-copy stage reached D; D's reservation is freed
(`unreserve`) on every path that does not commit. Whatever happens, r goes on once with the same
tokens: finished or aborted mid-copy -> nothing to move; D full or dead before the commit -> r
stays on S; S dead in a pre-copy stage -> recovery resumes r like S's other requests; S or D
dead in the stop-and-copy, or a refused commit -> r is recomputed from its token history
(the counter-based sampler makes the tokens the same).

`drain(w)` stops admissions and resumes to w and moves everything on it: live where it can, by
snapshot where it must (a request still prefilling, or no room anywhere: retracted with a full
snapshot, resumed elsewhere by the normal path).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from raysched.background import detached_task
from raysched.config import MigrationConfig
from raysched.request import Request, State, enqueue
from raysched.sampling import RequestError
from raysched.scheduler.fleet import Fleet, WorkerSlot, quietly
from raysched.scheduler.recovery import Recovery
from raysched.scheduler.retraction import RetractionLedger, estimate_bytes
from raysched.scheduler.faults import FaultSeam
from raysched.scheduler.rebalance import pick_move
from raysched.scheduler.table import RequestTable
from raysched.stats import Counters

log = logging.getLogger("raysched.scheduler")

DRAIN_POLL_S = 0.02
MODES = ("live", "snapshot", "recompute")  # how often a drain looks again at what is left on its worker


class Abandoned(Exception):
    """A migration that ends with the request not moved (the reason is the message)."""


@dataclass
class Final:
    """A stop-and-copy waiting for the source's dispatch loop to send it."""

    req: Request
    kv_from: int
    fault: Any
    sent: asyncio.Future  # -> (payload ref, (bytes, tokens) ref), or None: nothing to move
    stopped_s: float = 0.0


class Migrator:
    def __init__(self, cfg: MigrationConfig, table: RequestTable, fleet: Fleet, counters: Counters,
                 recovery: Recovery, faults: FaultSeam, ledger: RetractionLedger) -> None:
        self.cfg = cfg
        self.ledger = ledger  # the snapshot budget a drain's snapshots count against too
        self.table = table
        self.fleet = fleet
        self.counters = counters
        self.recovery = recovery
        self.faults = faults
        self.finals: dict[int, list[Final]] = {}  # source worker -> stop-and-copies to send
        self.moving: dict[str, tuple[int, ...]] = {}  # request id being moved -> (source, destination)
        #   of a migration under way; () for a retraction by snapshot

    # ------------------------------------------------------------------ one request
    async def migrate(self, request_id: str, worker: int | None = None, mode: str = "live") -> dict:
        """Move a running request to `worker` (None: the live worker with the most room). Returns
        {"from", "to", "mode": live | snapshot | recompute | stayed | ended | recovered, "stages",
        "precopy_bytes", "final_bytes", "downtime_s", "reason"}. `mode`: live (pre-copy, then a
        short stop-and-copy), snapshot (one blocking copy of the whole state), recompute (stop it
        and prefill its history again on the destination): the last two are baselines."""
        if mode not in MODES:
            raise RequestError(f"migration mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.check_index(worker)  # bad input first, whatever state the request is in
        req = self.table.requests.get(request_id)
        if req is None or req.state is not State.RUNNING or req.worker is None:
            raise RequestError(f"request {request_id!r} is not running (migrate moves running requests)")
        if request_id in self.moving:
            raise RequestError(f"request {request_id!r} is already being migrated")
        src = self.fleet.slots[req.worker]
        dst = self.destination(src, worker)
        out = {"from": src.index, "to": dst.index, "mode": "stayed", "stages": 0, "precopy_bytes": 0,
               "final_bytes": 0, "downtime_s": 0.0, "reason": ""}
        if mode == "recompute":
            return await self._recompute_on(req, src, dst, out)
        self.moving[request_id] = (src.index, dst.index)  # its stages run between the two
        self.fleet.interrupt(src)  # workers' calls: no long calls on them meanwhile (`involves`)
        self.fleet.interrupt(dst)
        try:
            await self._migrate(req, src, dst, out, mode == "snapshot")
        except Abandoned as why:
            out["reason"] = str(why)
            self.counters.migrations_abandoned += 1
            log.info("migration of %s from worker %d to %d: %s (%s)", request_id, src.index, dst.index,
                     out["mode"], why)
        finally:
            self.moving.pop(request_id, None)
        return out

    def involves(self, w: WorkerSlot) -> bool:
        """Is `w` the source or the destination of a migration under way?"""
        return any(w.index in ends for ends in self.moving.values())

    def check_index(self, worker: int | None) -> None:
        """A worker named by index must be one of the fleet's (None: any)."""
        if worker is not None and not (isinstance(worker, int) and 0 <= worker < len(self.fleet.slots)):
            raise RequestError(f"worker must be one of 0..{len(self.fleet.slots) - 1}, got {worker!r}")

    def destination(self, src: WorkerSlot, worker: int | None) -> WorkerSlot:
        """The worker asked for (checked), or the live, undrained one with the most room."""
        if worker is not None:
            if not (isinstance(worker, int) and 0 <= worker < len(self.fleet.slots)):
                raise RequestError(f"worker must be one of 0..{len(self.fleet.slots) - 1}, got {worker!r}")
            dst = self.fleet.slots[worker]
            if not dst.alive or dst.draining or dst is src:
                why = "is the request's own worker" if dst is src else "is not alive" if not dst.alive else "is draining"
                raise RequestError(f"worker {worker} {why}: it cannot take a migration")
            return dst
        candidates = [w for w in self.fleet.others(src) if not w.draining]
        if not candidates:
            raise RequestError("no other live worker to migrate to")
        return max(candidates, key=lambda w: (w.view.room(), -w.index))

    async def _migrate(self, req: Request, src: WorkerSlot, dst: WorkerSlot, out: dict, snapshot: bool) -> None:
        rid, cfg = req.request_id, self.cfg
        room = req.num_cached + cfg.block_tokens
        ok = await self._call(dst, dst.handle.reserve.remote(rid, room, self.faults.migration_point(
            dst, "refuse_migration", rid)), req, out)
        if not ok:
            raise Abandoned("the destination has no room")
        dst.view.free_tokens -= room  # until its next step reply reports the reservation
        dst.view.free_slots -= 1
        self.fleet.note_room(dst)
        sent = 0
        try:
            while not snapshot:
                self._check_running(req, src, out)
                out["stages"] += 1
                fault = self.faults.migration_point(src, "kill_migration_source", rid, out["stages"])
                blocks, info = src.handle.migrate_out.options(num_returns=2).remote(
                    rid, sent, cfg.block_tokens, False, fault)
                try:
                    nbytes, end, held = await self._call(src, info, req, out)
                except Abandoned:  # (e.g. r left the source meanwhile): its blocks' ref holds the same
                    self.fleet.forget(blocks)  # error; read it, so that Ray does not print it as unread
                    raise
                if end > sent:
                    fault = self.faults.migration_point(dst, "kill_migration_dest", rid, out["stages"])
                    if not await self._call(dst, dst.handle.migrate_in.remote(rid, [blocks], fault), req, out):
                        raise Abandoned("the destination has no room for the pre-copied blocks")
                    out["precopy_bytes"] += nbytes
                    sent = end
                if held - sent < cfg.last_stage_tokens:  # unsent at the source (which decodes on)
                    break
                if out["stages"] >= cfg.max_stages:
                    snapshot = True  # too many stages: one blocking copy of everything
            await self._stop_and_copy(req, src, dst, 0 if snapshot else sent, out, "snapshot" if snapshot else "live")
        except BaseException:
            if dst.alive:
                await quietly(dst.handle.unreserve.remote(rid))
            raise

    async def _stop_and_copy(self, req: Request, src: WorkerSlot, dst: WorkerSlot, kv_from: int, out: dict,
                             mode: str) -> None:
        """Stop `req` on `src` (through its dispatch loop, between two calls), copy the rest,
        commit on `dst`, and make `dst` run it."""
        rid = req.request_id
        final = Final(req, kv_from, self.faults.migration_point(src, "kill_migration_source", rid, final=True),
                      asyncio.get_running_loop().create_future())
        self.finals.setdefault(src.index, []).append(final)
        src.event.set()
        refs = await final.sent
        if refs is None:
            self._check_running(req, src, out)  # finished, aborted or retracted meanwhile
            raise Abandoned("the request left its worker before the stop-and-copy")
        payload, info = refs
        try:
            out["final_bytes"] = (await info)[0]
        except Exception as err:
            self._lost(req, src, err, out)
        fault = self.faults.migration_point(dst, "kill_migration_dest", rid, final=True)
        committed = dst.handle.commit.remote([payload], fault)
        self._run_on(req, dst)  # dst's next call (sent after the commit) decodes it
        try:
            ok = await committed
        except Exception as err:
            self._refused_commit(req, dst, err, out)
        if not ok:
            self._refused_commit(req, dst, None, out)
        out["mode"] = mode
        out["downtime_s"] = time.monotonic() - final.stopped_s
        self.counters.on_migration(out["mode"], out["precopy_bytes"], out["final_bytes"], out["downtime_s"])

    def send_finals(self, w: WorkerSlot) -> None:
        """The hook `w`'s dispatch loop runs before each decision: send the stop-and-copies
        waiting for `w` (their requests leave `w`'s running list first, so no plan names them)."""
        for final in self.finals.pop(w.index, []):
            req = final.req
            if req.state is not State.RUNNING or req not in w.view.running or not w.alive:
                final.sent.set_result(None)
                continue
            w.view.running.remove(req)
            w.view.free_tokens += w.view.held(req)  # freed by this call (no step reply reports it)
            w.view.free_slots += 1
            w.view.allocated.pop(req.request_id, None)
            self.fleet.note_room(w)
            final.stopped_s = time.monotonic()
            final.sent.set_result(tuple(w.handle.migrate_out.options(num_returns=2).remote(
                req.request_id, final.kv_from, self.cfg.block_tokens, True, final.fault)))

    # ------------------------------------------------------------------ outcomes
    def _run_on(self, req: Request, dst: WorkerSlot) -> None:
        req.worker = dst.index
        req.workers.append(dst.index)
        dst.view.running.append(req)
        dst.event.set()

    def _check_running(self, req: Request, src: WorkerSlot, out: dict) -> None:
        if req.state is not State.RUNNING or req.worker != src.index:
            out["mode"] = "ended" if req.state.is_done else "stayed"
            raise Abandoned(f"the request {'ended' if req.state.is_done else 'was retracted'} mid-copy")

    async def _call(self, w: WorkerSlot, ref: Any, req: Request, out: dict) -> Any:
        """Await one migration call of `w`; a failure abandons the migration (a dead worker is
        retired at once: recovery resumes what it held)."""
        try:
            return await ref
        except Exception as err:
            death = self.recovery.actors.is_death(err)
            if death and w.alive:
                self.recovery.on_worker_failure(w, err)
            # the source's death recovers `req`, whichever loop saw it first (by now it may
            # be running again elsewhere); the destination's leaves it on the source
            if req.state is State.RETRACTED or (death and w.index == out["from"]):
                out["mode"] = "recovered"
            raise Abandoned(f"worker {w.index} failed a migration call ({type(err).__name__})") from None

    def _lost(self, req: Request, src: WorkerSlot, err: BaseException, out: dict) -> None:
        """The stop-and-copy's source call failed after `req` left the source's running list:
        recompute it from its token history."""
        if self.recovery.actors.is_death(err) and src.alive:
            self.recovery.on_worker_failure(src, err)
        self._recompute(req, out)
        raise Abandoned(f"the source failed the stop-and-copy ({type(err).__name__}); recomputed")

    def _refused_commit(self, req: Request, dst: WorkerSlot, err: BaseException | None, out: dict) -> None:
        """The destination did not take the final state: recompute `req` (a dead destination's
        recovery does it with its other requests)."""
        if err is not None and self.recovery.actors.is_death(err):
            if dst.alive:
                self.recovery.on_worker_failure(dst, err)  # req is in dst's running list: recovered
            else:
                self._recompute_from(req, dst)
            out["mode"] = "recovered"
            raise Abandoned(f"the destination failed the commit ({type(err).__name__}); recomputed")
        self._recompute_from(req, dst)
        out["mode"] = "recovered"
        raise Abandoned(f"the destination refused the commit ({err!r}); recomputed")

    def _recompute_from(self, req: Request, dst: WorkerSlot) -> None:
        if req in dst.view.running:
            dst.view.running.remove(req)
            if req.workers and req.workers[-1] == dst.index:
                req.workers.pop()
            self._recompute(req, {})

    def _recompute(self, req: Request, out: dict) -> None:
        if req.state is State.RUNNING:
            self.counters.recovered += 1
            req.snapshot_ref, req.recompute, req.state = None, True, State.RETRACTED
            enqueue(self.table.retracted, req, front=True)
            self.fleet.notify()
        out["mode"] = "recovered"

    async def _recompute_on(self, req: Request, src: WorkerSlot, dst: WorkerSlot, out: dict) -> dict:
        """The recompute baseline: stop `req` on `src` and let the planner prefill its history
        again, on `dst` (`Request.target_worker`: no other live worker resumes it; the fleet
        goes on admitting and draining as before)."""
        req.target_worker = dst.index
        t0 = time.monotonic()
        if await self.retract_by_snapshot(req, recompute=True) == "ended":
            req.target_worker = None
            out["mode"] = "ended"
            return out
        while req.state is State.RETRACTED:
            await asyncio.sleep(DRAIN_POLL_S / 4)
        out.update(mode="recompute", downtime_s=time.monotonic() - t0)
        return out

    # ------------------------------------------------------------------ rebalance
    async def rebalance_loop(self, threshold: float, interval_s: float, max_moves: int) -> None:
        """Every `interval_s`: move one running request from the most to the least loaded worker
        when their virtual usage differs by more than `threshold` and nothing waits
        (`rebalance.pick_move`)."""
        in_flight: set[asyncio.Task] = set()
        while not self.recovery.closing:
            await asyncio.sleep(interval_s)
            if len(in_flight) >= max_moves:
                continue
            views = [w.view for w in self.fleet.alive() if not w.draining]
            move = pick_move(views, threshold, self.moving, bool(self.table.waiting or self.table.retracted))
            if move is None:
                continue
            self.counters.rebalance_moves += 1
            task = detached_task(self._quiet_migrate(move.request.request_id, move.dst))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)

    async def _quiet_migrate(self, request_id: str, dst: int) -> None:
        try:
            await self.migrate(request_id, dst)
        except RequestError as err:  # it ended, or the destination went, meanwhile
            log.info("rebalance: %s", err)

    # ------------------------------------------------------------------ drain
    async def drain(self, index: int) -> dict:
        """Stop admissions to worker `index` and move everything on it elsewhere; once it holds
        nothing, returns where its requests went (`drain_report`)."""
        w = self.worker(index)
        if not self.fleet.others(w) or all(o.draining for o in self.fleet.others(w)):
            raise RequestError(f"worker {index} is the last one taking work: nothing to drain it to")
        self.fleet.set_draining(w, True)
        t0, went = time.monotonic(), []
        queued = len(self.table.waiting) + len(self.table.retracted)  # on no worker: the others take them
        while w.alive and any(r.state is State.RUNNING for r in w.view.running):
            reqs = [r for r in w.view.running if r.state is State.RUNNING and r.request_id not in self.moving]
            went += await asyncio.gather(*[self._move_off(r) for r in reqs])
            await asyncio.sleep(DRAIN_POLL_S)
        return drain_report(went, queued, time.monotonic() - t0)

    def undrain(self, index: int) -> None:
        """Let a drained (still live) worker take work again."""
        self.fleet.set_draining(self.worker(index), False)

    async def _move_off(self, req: Request) -> str:
        """Move one request off its (draining) worker: live, else by a full snapshot (a request
        still prefilling, or no room elsewhere now), resumed by the normal path."""
        if req.num_generated:
            try:
                out = await self.migrate(req.request_id)
            except RequestError:
                out = {"mode": "stayed"}
            if out["mode"] != "stayed":
                return out["mode"]
        return await self.retract_by_snapshot(req)

    async def retract_by_snapshot(self, req: Request, recompute: bool = False) -> str:
        """Stop `req` and queue it with a full snapshot (resumed wherever there is room), or,
        with `recompute` or when the snapshot budget is full, without one (its history is
        prefilled again). Returns "snapshot", "requeued" (without one) or "ended" (it finished
        or was aborted meanwhile)."""
        src = self.fleet.slots[req.worker]
        recompute = recompute or not self.ledger.fits(estimate_bytes(src, req))
        self.moving[req.request_id] = ()  # (no destination: it is queued)
        final = Final(req, 0, None, asyncio.get_running_loop().create_future())
        try:
            self.finals.setdefault(src.index, []).append(final)
            src.event.set()
            self.fleet.interrupt(src)  # its loop sends the Final between calls: end a long call now
            refs = await final.sent
            if refs is None:
                return "ended"
            try:
                nbytes = (await refs[1])[0]
                snap = None if recompute else refs[0]
            except Exception as err:  # nothing computed yet, or the worker died: recompute
                if self.recovery.actors.is_death(err) and src.alive:
                    self.recovery.on_worker_failure(src, err)
                snap, nbytes = None, 0
            went = "ended"
            if req.state is State.RUNNING:  # (not aborted meanwhile)
                req.snapshot_ref, req.snapshot_bytes, req.recompute = snap, nbytes, snap is None
                req.state, req.retractions = State.RETRACTED, req.retractions + 1
                enqueue(self.table.retracted, req, front=True)
                self.counters.on_migration("recompute" if recompute else "snapshot", 0, req.snapshot_bytes,
                                           time.monotonic() - final.stopped_s)
                went = "requeued" if snap is None else "snapshot"
            self.fleet.notify()
            return went
        finally:
            self.moving.pop(req.request_id, None)

    def worker(self, index: Any) -> WorkerSlot:
        if not (isinstance(index, int) and 0 <= index < len(self.fleet.slots)) or not self.fleet.slots[index].alive:
            alive = [w.index for w in self.fleet.alive()]
            raise RequestError(f"worker must be a live worker index ({alive}), got {index!r}")
        return self.fleet.slots[index]


def drain_report(went: list[str], queued: int, seconds: float) -> dict:
    """Where a drained worker's requests went, from `_move_off`'s answer per request: "live"
    (live migration), "snapshot" (a full snapshot, resumed wherever there is room), "requeued"
    (stopped without a snapshot, or its move failed: its history is prefilled again), "ended"
    (finished or aborted meanwhile); "moved" is the three moves together and "fallbacks" the
    moves that were not live. "queued": requests waiting when the drain began, on no worker (the
    others take them); "seconds": how long the drain took."""
    counts = {mode: sum(m == mode for m in went) for mode in ("live", "snapshot", "ended")}
    counts["requeued"] = sum(m in ("requeued", "recovered") for m in went)
    moved = counts["live"] + counts["snapshot"] + counts["requeued"]
    return {"moved": moved, "fallbacks": moved - counts["live"], **counts, "queued": queued, "seconds": seconds}
