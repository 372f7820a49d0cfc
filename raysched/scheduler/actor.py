"""The scheduler actor: a thin facade over the parts of `raysched.scheduler`.

One async Ray actor, the single authority over requests and workers. It builds the parts and
hands each call to the one that owns it:

- `table.RequestTable`: submit, validate, wait, stream, abort, forget;
- `dispatch.Dispatcher`: one loop per worker (decide, call, apply);
- `retraction.RetractionLedger`: retract modes, the snapshot budget, bytes in flight;
- `recovery.Recovery`: starting workers, worker failure, replacement, restart;
- `migration.Migrator`: live migration, drain, the elastic worker set;
- `autoscale.AutoscalePolicy`: when to grow or shrink that set (the loop here applies it);
- `prefix_cache.PrefixCache`: prefix reuse around each call (`state_cache`: the index);
- `faults.FaultSeam`: fault injection, the one seam;
- `planner` / `policy`: pure decisions.

Torch is never imported here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import time
from typing import Any

import ray

from raysched.background import detached_task
from raysched.config import AutoscaleConfig, ServeConfig
from raysched.ray_compat import inline_return_bytes, object_store_stats, request_resources
from raysched.request import Request, State
from raysched.sampling import RequestError, SamplingParams
from raysched.scheduler.autoscale import AutoscalePolicy, Load, WorkerLoad
from raysched.scheduler.dispatch import Dispatcher
from raysched.scheduler.faults import FaultSeam
from raysched.scheduler.fleet import Fleet, WorkerSlot
from raysched.scheduler.heap import GcPauses, release_freed_memory, tune_gc
from raysched.scheduler.migration import Migrator
from raysched.scheduler.recovery import Recovery, was_restarted
from raysched.scheduler.prefix_cache import PrefixCache
from raysched.scheduler.retraction import RetractionLedger
from raysched.scheduler.state_cache import StateCache
from raysched.scheduler.table import Limits, RequestTable, validate_generated
from raysched.stats import Counters
from raysched.tokenizer import require_tokenizer
from raysched.workers import kill_worker, release_workers, route_notices, worker_bundle

log = logging.getLogger("raysched.scheduler")

READER_CHECK_S = 1.0  # how often the readers' sinks are asked whether they live


class Scheduler:
    def __init__(self, config: ServeConfig) -> None:
        release_freed_memory()  # a long-lived process: keep its heap from hoarding freed blocks
        self.gc_pauses = GcPauses()
        self.restarted = was_restarted()  # by Ray (max_restarts) after this actor's process died
        if self.restarted:  # a rehearsed fault fires once per deployment, not again after the restart
            config = dataclasses.replace(config, faults=())
        self.config = config
        self.counters = Counters()
        self.table = RequestTable(self.counters, f"req-r{os.getpid()}-" if self.restarted else "req-")
        self.fleet = Fleet()
        self.faults = FaultSeam(config.faults, kill=kill_worker)
        self.ledger = RetractionLedger(config.scheduler, self.table, self.fleet, self.counters, self.faults)
        self.prefix_cache = PrefixCache(_state_cache(config), self.table, self.counters,
                                        config.state_cache.placement_slack, branch_points=True,
                                        late_calls=config.state_cache.late_branch_calls,
                                        turn_points=config.state_cache.turn_points)
        self.recovery = Recovery(config, self.table, self.fleet, self.counters, on_added=self._start_loop,
                                 on_stopped=self._stopped)
        self.dispatch = Dispatcher(config, self.table, self.fleet, self.counters, self.ledger, self.prefix_cache,
                                   self.recovery, self.faults)
        self.migrator = Migrator(config.migration, self.table, self.fleet, self.counters, self.recovery, self.faults,
                                 self.ledger)
        self.dispatch.before_decide = self._before_decide
        self.dispatch.migrating = self.migrator.involves
        self._start_task: asyncio.Task | None = None
        self._growing = 0  # autoscale grows in flight
        self._shrinking = 0  # autoscale shrinks in flight
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            tune_gc()  # its own process (not a test's): its long-lived objects exist from here on

    # the tables other code reads (tests, introspection)
    @property
    def requests(self) -> dict:
        return self.table.requests

    @property
    def waiting(self):
        return self.table.waiting

    @property
    def retracted(self):
        return self.table.retracted

    @property
    def workers(self) -> list[WorkerSlot]:
        return self.fleet.slots

    # ================================================================== lifecycle
    async def start(self) -> list[dict]:
        """Start the worker actors and their loops, once (the creator calls it; a restarted
        scheduler calls it itself on its first submit); returns one line of facts per worker."""
        if self._start_task is None:
            if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
                self.dispatch.notices = ray.get_runtime_context().current_actor  # (`call_finished`)
            self._start_task = detached_task(self._start_workers())
        await asyncio.shield(self._start_task)
        return [w.line() for w in self.fleet.slots]

    async def _start_workers(self) -> None:
        await self.recovery.start_workers()
        self.fleet.node_id = ray.get_runtime_context().get_node_id()
        store = _local_object_store_bytes()
        if self.prefix_cache.index is not None and self.config.state_cache.budget_bytes is None:
            self.prefix_cache.index.budget_bytes = store // 4
        if self.config.scheduler.snapshot_budget_bytes is None:
            self.ledger.budget_bytes = store // 2
        rb = self.config.scheduler.rebalance
        if rb.enabled:
            detached_task(self.migrator.rebalance_loop(rb.threshold, rb.interval_s, rb.max_moves))
        if self.config.autoscale is not None:
            detached_task(self._autoscale_loop(self.config.autoscale))
        detached_task(self._watch_readers())

    def _start_loop(self, w: WorkerSlot) -> None:
        """A worker joined: its loop starts; branch points move to the grid every worker shares."""
        self.prefix_cache.use_grid([o.info.prefix_grid for o in self.fleet.alive()])
        route_notices(w.handle, self.dispatch.on_finish_notice)
        self.dispatch.start_loop(w)

    def _before_decide(self, w: WorkerSlot) -> None:
        """Each turn of `w`'s dispatch loop: its calls so far succeeded (`Recovery.note_served`);
        live migration's stop-and-copy goes out first (`Migrator.send_finals`)."""
        self.recovery.note_served(w)
        self.migrator.send_finals(w)

    def _stopped(self) -> None:
        """Recovery stopped the scheduler (a crash loop): release what it holds, as `shutdown`."""
        detached_task(self.shutdown())

    async def describe(self) -> dict:
        """The config this scheduler serves and its live workers (for `raysched.connect`)."""
        return {"config": self.config, "workers": [w.line() for w in self.fleet.alive()]}

    async def shutdown(self) -> None:
        self.recovery.closing = True
        self.fleet.interrupt_all()
        for w in self.fleet.slots:
            w.event.set()
            if w.task:
                w.task.cancel()
        for r in self.table.requests.values():
            r.snapshot_ref = None
        self.prefix_cache.clear()
        release_workers([w.handle for w in self.fleet.slots])
        self.gc_pauses.close()

    # ================================================================== client API
    async def submit(self, prompt_ids: list[int], sampling: dict | None = None,
                     request_id: str | None = None, priority: int = 0, stream: bool = False,
                     sink: Any = None, shared_prefix: int = 0) -> str:
        """Validate and queue a request; returns its id. Bad input raises RequestError at once.
        `priority`: lower is more urgent; the waiting queue is kept in priority order. `sink`:
        the reader's `raysched.sink.TokenSink`: its workers send it each step's tokens directly
        (the scheduler sees them once per call, in the reply). `stream` without a sink: its
        tokens will be read here as they come (`next_tokens`), so its first call streams too
        (`scheduler.stream_each_step`; a first `next_tokens` marks it as well). `shared_prefix`:
        prompt tokens other prompts share (a chat's system message; see `Client.submit`)."""
        self.table.raise_if_fatal()
        if self.restarted:
            await self.start()
        req = self.table.submit(prompt_ids, sampling, self._limits(), request_id, priority, shared_prefix)
        req.streaming = bool(stream) and sink is None
        if sink is not None:
            self._attach(req, sink, late=False)
        elif req.sampling.stop:  # stop strings are matched here, on the text, as tokens arrive
            req.text_stream = require_tokenizer(self.config.model).text_stream(req.sampling.stop, req.sampling.min_tokens)
        self.fleet.notify()
        return req.request_id

    def _attach(self, req: Request, sink: Any, late: bool) -> None:
        """Read `req` through `sink`; its stop strings are matched there (`raysched.sink`). One
        attached `late` keeps being matched here too, on its replies, until it ends (the tokens
        it had come to the sink only with its next plan; both cut at the same token)."""
        self.table.attach(req, sink, late)
        if not late:
            req.text_stream = None
        if req.sampling.stop:
            me = ray.get_runtime_context().current_actor
            sink.open.remote(req.request_id, self.config.model, tuple(req.sampling.stop), req.sampling.min_tokens, me)
        else:
            sink.open.remote(req.request_id)

    async def attach_sink(self, request_id: str, sink: Any) -> bool:
        """From now on `request_id`'s tokens go to `sink` (a reader that starts reading a request
        submitted without one): its worker's call in flight is interrupted, and the next one
        seeds the sink with the tokens so far and sends each step's tokens there. False: it had
        ended (`wait` has its record)."""
        req = self.table.get(request_id)
        if req.state.is_done:
            return False
        self._attach(req, sink, late=True)
        self._interrupt_worker_of(req)
        return True

    async def status(self, request_id: str) -> str:
        """"live", "ended" (`wait` returns its record) or "unknown" (a reader whose sink went
        quiet asks: after a scheduler restart, "unknown" means resubmit)."""
        return self.table.status(request_id)

    async def call_finished(self, worker: int, notice_id: int, ended: dict[str, tuple[str, list[int]]]) -> None:
        """A worker's long call went on past requests that finished in it (`StepPlan.notices`):
        `ended` maps each to (why, its tokens of that call); they end now."""
        self.dispatch.on_finish_notice(worker, notice_id, ended)

    async def stop(self, request_id: str, generated: list[int]) -> None:
        """A reader's sink matched a stop string after `generated`: the request ends there."""
        req = self.table.requests.get(request_id)
        if req is not None:
            self._interrupt_worker_of(req)
            self.dispatch.stop(req, generated)

    async def debug_block(self, flag_path: str, max_s: float = 120.0) -> float:
        """Testing only: block this actor's event loop (nothing here runs: no decision, no reply
        applied, no client call) while the file `flag_path` exists, at most `max_s`; returns
        the seconds blocked (`flag_path` + ".on" exists while it blocks). Tokens that still
        reach readers meanwhile did not pass here."""
        t0 = time.monotonic()
        open(flag_path + ".on", "w").close()
        try:
            while os.path.exists(flag_path) and time.monotonic() - t0 < max_s:
                time.sleep(0.01)
        finally:
            os.remove(flag_path + ".on")
        return time.monotonic() - t0

    async def resubmit(self, prompt_ids: list[int], sampling: dict, request_id: str,
                       generated: list[int], priority: int = 0, sink: Any = None) -> str:
        """A request submitted to this scheduler before it died (Ray restarted it), with the
        tokens the client had received. It resumes by recompute from prompt + those tokens, ahead
        of new admissions; the counter-based sampler continues at draw number len(generated), so
        the tokens that follow are the ones the request would have had."""
        if self.restarted:
            await self.start()
        validate_generated(generated, SamplingParams.from_dict(sampling or {}), self._limits().vocab_size)
        rid = await self.submit(prompt_ids, sampling, request_id, priority, sink=sink)
        self.counters.resubmitted += 1
        if generated:
            self.table.continue_from(self.table.requests[rid], generated)
            self.counters.resubmitted_tokens += len(generated)
        return rid

    async def abort(self, request_id: str, forget: bool = False) -> bool:
        """Abort a request at any stage; False if it had already ended. `forget`: also move it
        out of the live tables (as `wait` would; the record stays readable for a while), for a
        caller that will not read it, such as an HTTP handler whose client went away."""
        req = self.table.requests.get(request_id)
        self._interrupt_worker_of(req)  # its long call decodes it on in vain
        aborted = self.table.abort(request_id) is not None
        if forget and req is not None:
            self.table.forget(req)
        return aborted

    async def wait(self, request_id: str, timeout: float | None = None) -> dict:
        """Wait for the request to end; returns its record and forgets it."""
        return await self.table.wait(request_id, timeout)

    async def next_tokens(self, request_id: str, cursor: int) -> tuple[list[int], bool]:
        """Tokens generated after `cursor` (waits for at least one unless the request ended)."""
        req = self.table.requests.get(request_id)
        if req is not None and not req.streaming:  # its worker's long call does not stream
            self._interrupt_worker_of(req)
        return await self.table.next_tokens(request_id, cursor)

    def _interrupt_worker_of(self, req: Request | None) -> None:
        if req is not None and req.worker is not None and req.state is State.RUNNING:
            self.fleet.interrupt(self.fleet.slots[req.worker])

    # ================================================================== moving running requests
    async def migrate(self, request_id: str, worker: int | None = None, mode: str = "live") -> dict:
        """Live-migrate a running request to `worker` (None: the one with the most room); see
        `migration.Migrator.migrate` for the result and the baseline modes."""
        return await self.migrator.migrate(request_id, worker, mode)

    async def drain(self, worker: int) -> dict:
        """Stop admissions to `worker` and move everything on it elsewhere; returns
        {"moved", "seconds", "fallbacks"} once it holds nothing."""
        return await self.migrator.drain(worker)

    async def undrain(self, worker: int) -> None:
        """Let a drained worker take work again (admissions, resumes, rebalancing)."""
        self.migrator.undrain(worker)

    async def remove_worker(self, worker: int) -> dict:
        """Drain `worker`, then end its actor; the drain's result."""
        out = await self.migrator.drain(worker)
        self.recovery.retire(self.fleet.slots[worker])
        return out

    async def add_worker(self) -> dict:
        """Start one more worker; it joins the plan at once. Its line of facts."""
        slot = await self.recovery.start_worker()
        if slot is None:
            raise RuntimeError("could not start a worker: the cluster has no room for one")
        self.fleet.notify()
        return slot.line()

    # ================================================================== readers
    async def _watch_readers(self) -> None:
        """Every READER_CHECK_S: a reader whose sink died (its process exited, its client shut
        down, its Serve replica went away) aborts the requests it was reading, as an HTTP client
        that disconnects does; its workers drop them at their next call."""
        while not self.recovery.closing:
            await asyncio.sleep(READER_CHECK_S)
            readers = self.table.readers()
            if not readers:
                continue
            pings = await asyncio.gather(*[sink.__ray_ready__.remote() for sink in readers.values()],
                                         return_exceptions=True)
            for key, ping in zip(readers, pings):
                if isinstance(ping, BaseException) and self.recovery.actors.is_death(ping):
                    await self._reader_lost(key)

    async def _reader_lost(self, key: Any) -> None:
        live = self.table.read_by(key)
        log.info("the reader of %d request(s) went away (its sink died); aborting them", len(live))
        for rid in live:
            del self.table.sinks[rid]  # (nothing more is sent to it)
            if await self.abort(rid, forget=True):
                self.counters.readers_lost += 1

    # ================================================================== autoscale
    async def _autoscale_loop(self, cfg: AutoscaleConfig) -> None:
        """Every `interval_s`: one decision of the pure policy, applied in the background (a grow
        or a shrink in flight is part of the next snapshot, so decisions never pile up)."""
        policy = AutoscalePolicy(cfg)
        while not self.recovery.closing:
            await asyncio.sleep(cfg.interval_s)
            decision = policy.decide(self._load())
            if decision.grow:
                self._growing += 1
                detached_task(self._grow())
            elif decision.shrink is not None:
                self._shrinking += 1
                detached_task(self._shrink(decision.shrink))

    def _load(self) -> Load:
        """What the policy sees now."""
        workers = tuple(WorkerLoad(w.index, len(w.view.running), w.draining) for w in self.fleet.alive())
        return Load(time.monotonic(), len(self.table.waiting) + len(self.table.retracted), workers,
                    self._growing + self.recovery.pending_replacements, self._shrinking)

    async def _grow(self) -> None:
        """Ask the cluster for room for one more worker, then start it (counted once it runs)."""
        try:
            await self._request_room(len(self.fleet.alive()) + 1)
            line = await self.add_worker()
            self.counters.autoscale_grows += 1
            log.info("autoscale: added worker %d (%d waiting)", line["worker"], len(self.table.waiting))
        except RuntimeError as err:
            log.warning("autoscale: %s", err)
        finally:
            self._growing -= 1

    async def _shrink(self, index: int) -> None:
        """Drain worker `index`, remove it, and lower the cluster request to the smaller set."""
        try:
            out = await self.remove_worker(index)
            self.counters.autoscale_shrinks += 1
            log.info("autoscale: removed idle worker %d (moved %d)", index, out["moved"])
            await self._request_room(len(self.fleet.alive()))
        except RequestError as err:  # it died, or became the last undrained one, meanwhile
            log.info("autoscale: worker %d stays: %s", index, err)
        finally:
            self._shrinking -= 1

    async def _request_room(self, workers: int) -> None:
        """The cluster request for `workers` workers (`ray_compat.request_resources`, off this
        loop: it talks to the GCS)."""
        bundle = await asyncio.to_thread(worker_bundle, self.config)
        if bundle:
            await asyncio.to_thread(request_resources, [bundle] * workers)

    def _limits(self) -> Limits:
        info = self.fleet.slots[0].info
        return Limits(info.vocab_size, info.max_context, self.fleet.largest_pool_tokens())

    # ================================================================== introspection
    async def stats(self, detail: bool = False) -> dict:
        """Counters, table sizes, per-worker room, faults fired; with `detail`, the scheduler's RSS,
        whether its process has loaded torch, and the object store's spill counters too."""
        d = self.counters.summary(self._table_sizes(), [w.view for w in self.fleet.slots])
        d["gc"] = self.gc_pauses.summary()
        d["snapshot_bytes_held"] = self.ledger.held_bytes()
        d["snapshot_budget_bytes"] = self.ledger.budget_bytes
        d["workers_alive"] = len(self.fleet.alive())
        d["interrupted_calls"] = self.fleet.interrupts
        d["migrations_in_flight"] = sorted(self.migrator.moving)  # ids of requests being moved now
        d.update(self.prefix_cache.stats())
        d["faults_fired"] = list(self.faults.fired)
        d["scheduler_restarted"] = self.restarted
        if detail:
            d["scheduler_rss_bytes"] = rss_bytes()
            d["scheduler_torch_loaded"] = "torch" in sys.modules  # the control plane must stay torch-free
            d.update(object_store_stats())
        return d

    async def timeline(self) -> list[tuple]:
        """(t_s, worker, kv_used_fraction, state_slots_used, new_tokens) per worker call."""
        return self.counters.timeline_rows()

    def _table_sizes(self) -> dict:
        return self.table.sizes(running=sum(len(w.view.running) for w in self.fleet.slots))

    async def check_idle(self) -> dict:
        """Every worker's pool empty and every table empty? (for tests and the run summary)"""
        idle = await asyncio.gather(*[w.handle.is_idle.remote() for w in self.fleet.alive()])
        return {"workers_idle": all(idle), "tables": self._table_sizes()}


def _state_cache(config: ServeConfig) -> StateCache | None:
    cfg = config.state_cache
    if not cfg.enabled:
        return None
    return StateCache(cfg.budget_bytes or 0, cfg.min_tokens, cfg.inline_budget_bytes, inline_return_bytes(),
                      config.scheduler.prefill_chunk_tokens, turn_window=cfg.turn_window if cfg.turn_points else 0)


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _local_object_store_bytes() -> int:
    """Capacity of the object store on this (the scheduler's) node."""
    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here:
            return int(node.get("Resources", {}).get("object_store_memory", 0))
    return int(ray.cluster_resources().get("object_store_memory", 0))
