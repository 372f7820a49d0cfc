"""The scheduler actor: the single authority over requests and workers.

One async actor. It owns the worker actors (it starts them), the request table, the waiting
queue and the retracted queue. One asyncio task per worker runs the loop

    plan (pure, `planner.plan_step`)  ->  retract victims + step call  ->  apply the result

so a slow worker never blocks the others, and `submit` / `abort` / `stats` get through between
awaits. A snapshot victim is queued at plan time with the ref of its pending `retract` call: the
scheduler (the caller) owns that object, it outlives the worker process that made it, and any
worker may resume the request as soon as the bytes exist, reading them straight from the node
where they lie (one transfer). If that node is lost with the object, the resume reports the
snapshot lost and the request is recomputed from the token history the scheduler keeps. Torch is
never imported here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray

from raysched.allocator import release_freed_memory, trim_heap
from raysched.config import ConfigError, ServeConfig
from raysched.faults import FaultInjector
from raysched.messages import SNAPSHOT_LOST, FaultPoint, PrefillItem, StepPlan, StepResult, Usage, WorkerInfo
from raysched.planner import Plan, WorkerView, decode_need, plan_step
from raysched.policy import choose_retract_mode
from raysched.ray_compat import inline_return_bytes, object_store_stats
from raysched.request import Request, State, enqueue
from raysched.sampling import RequestError, SamplingParams, check_priority, validate_prompt
from raysched.state_cache import Parked, StateCache
from raysched.stats import Counters
from raysched.tokenizer import require_tokenizer

log = logging.getLogger("raysched.scheduler")

ENDED_RECORDS_KEPT = 4096  # ended requests already read once, still readable by a late reader
TRIM_EVERY_REQUESTS = 200  # hand freed heap memory back to the system after this many requests


@dataclass
class WorkerSlot:
    index: int
    handle: Any
    info: WorkerInfo
    view: WorkerView
    alive: bool = True
    event: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


class Scheduler:
    def __init__(self, config: ServeConfig) -> None:
        release_freed_memory()  # a long-lived process: keep its heap from hoarding freed blocks
        self.restarted = _was_restarted()  # by Ray (max_restarts) after this actor's process died
        if self.restarted:  # a rehearsed fault fires once per deployment, not again after the restart
            config = dataclasses.replace(config, faults=())
        self.config = config
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.retracted: deque[Request] = deque()
        self.workers: list[WorkerSlot] = []
        self.counters = Counters()
        self._progress: dict[str, asyncio.Event] = {}
        self._ended: dict[str, Request] = {}  # read once, out of the live table; oldest first
        self._next_id = 0
        self._forgotten = 0  # ended requests moved out of the live tables
        self._id_prefix = f"req-r{os.getpid()}-" if self.restarted else "req-"  # never an id of before
        self._start_task: asyncio.Task | None = None
        self._closing = False
        self._fatal: str | None = None
        self._pending_replacements = 0
        self._faults = FaultInjector(config.faults)
        self._corrupt_next: set[int] = set()  # workers whose next snapshot gets a flipped byte
        self._inflight_snapshot_bytes = 0  # estimated bytes of retractions not yet fetched
        self._snapshot_budget = config.scheduler.snapshot_budget_bytes or 0
        self._node_id: str | None = None  # the scheduler's node (for bytes-moved accounting)
        cache_cfg = config.state_cache
        self.state_cache = (StateCache(cache_cfg.budget_bytes or 0, cache_cfg.min_tokens, cache_cfg.inline_budget_bytes,
                                       inline_return_bytes()) if cache_cfg.enabled else None)
        self._prefix_of: dict[str, Parked] = {}  # admitted request id -> parked state it restores

    # ================================================================== lifecycle
    async def start(self) -> list[dict]:
        """Start the worker actors and their loops, once (the creator calls it; a restarted
        scheduler calls it itself on its first submit); returns one line of facts per worker."""
        if self._start_task is None:
            self._start_task = asyncio.get_running_loop().create_task(self._start_workers())
        await asyncio.shield(self._start_task)
        return [self._worker_line(w) for w in self.workers]

    async def _start_workers(self) -> None:
        from raysched.workers import spawn_worker

        handles = [spawn_worker(self.config, i) for i in range(self.config.workers)]
        infos = await asyncio.gather(*[h.info.remote() for h in handles], return_exceptions=True)
        failed = next((i for i, info in enumerate(infos) if isinstance(info, BaseException)), None)
        if failed is not None:
            for h in handles:
                ray.kill(h)
            raise _start_error(self.config, failed, infos[failed])
        for h, info in zip(handles, infos):
            self._add_worker(h, info)
        self._check_same_model()
        self._node_id = ray.get_runtime_context().get_node_id()
        if self.state_cache is not None and self.config.state_cache.budget_bytes is None:
            self.state_cache.budget_bytes = _local_object_store_bytes() // 4
        if self.config.scheduler.snapshot_budget_bytes is None:
            self._snapshot_budget = _local_object_store_bytes() // 2

    def _add_worker(self, handle: Any, info: WorkerInfo) -> WorkerSlot:
        u = info.usage
        view = WorkerView(info.index, u.kv_free_tokens, u.mamba_free_slots, u.kv_total_tokens,
                          u.mamba_total_slots, u.page_size)
        slot = WorkerSlot(info.index, handle, info, view)
        self.workers.append(slot)
        slot.task = asyncio.get_running_loop().create_task(self._loop(slot))
        return slot

    def _check_same_model(self) -> None:
        prints = {w.info.fingerprint for w in self.workers}
        if len(prints) > 1:
            raise RuntimeError(f"workers loaded different models: {sorted(prints)}")

    async def describe(self) -> dict:
        """The config this scheduler serves and its live workers (for `raysched.connect`)."""
        return {"config": self.config, "workers": [self._worker_line(w) for w in self.workers if w.alive]}

    @staticmethod
    def _worker_line(w: WorkerSlot) -> dict:
        return {"worker": w.index, "node": w.info.node_id, "device": w.info.device,
                "kv_tokens": w.info.usage.kv_total_tokens, "mamba_slots": w.info.usage.mamba_total_slots,
                "vocab_size": w.info.vocab_size, "max_context": w.info.max_context}

    async def shutdown(self) -> None:
        self._closing = True
        for w in self.workers:
            w.event.set()
            if w.task:
                w.task.cancel()
        for r in self.requests.values():
            r.snapshot_ref = None
        if self.state_cache is not None:
            self.state_cache.clear()
        for w in self.workers:
            ray.kill(w.handle)

    # ================================================================== client API
    async def submit(self, prompt_ids: list[int], sampling: dict | None = None,
                     request_id: str | None = None, priority: int = 0) -> str:
        """Validate and queue a request; returns its id. Bad input raises RequestError at once.
        `priority`: lower is more urgent; the waiting queue is kept in priority order."""
        self._raise_if_fatal()
        priority = check_priority(priority)
        if self.restarted:
            await self.start()
        params = SamplingParams.from_dict(sampling or {})
        prompt = self._validate(prompt_ids, params)
        rid = request_id or f"{self._id_prefix}{self._next_id}"
        self._next_id += 1
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        req = Request(rid, prompt, params, priority)
        if params.stop:  # stop strings are matched here, on the text, as tokens arrive
            req.text_stream = require_tokenizer(self.config.model).text_stream(params.stop, params.min_tokens)
        self.requests[rid] = req
        self._progress[rid] = asyncio.Event()
        enqueue(self.waiting, req)
        self.counters.submitted += 1
        self._notify()
        return rid

    async def resubmit(self, prompt_ids: list[int], sampling: dict, request_id: str,
                       generated: list[int], priority: int = 0) -> str:
        """A request submitted to this scheduler before it died (Ray restarted it), with the
        tokens the client had received. It resumes by recompute from prompt + those tokens, ahead
        of new admissions; the counter-based sampler continues at draw number len(generated), so
        the tokens that follow are the ones the request would have had."""
        if self.restarted:
            await self.start()
        params = SamplingParams.from_dict(sampling or {})
        self._validate_generated(generated, params)
        rid = await self.submit(prompt_ids, sampling, request_id, priority)
        self.counters.resubmitted += 1
        if generated:
            req = self.requests[rid]
            self.waiting.remove(req)
            req.output_ids, req.recompute, req.state = [int(t) for t in generated], True, State.RETRACTED
            if req.text_stream is not None:  # stop strings: the text so far, as the client saw it
                req.text_stream.add(req.output_ids)
            enqueue(self.retracted, req)
            self.counters.resubmitted_tokens += len(generated)
        return rid

    def _validate_generated(self, generated: list[int], params: SamplingParams) -> None:
        vocab = self.workers[0].info.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in generated):
            raise RequestError(f"generated tokens must be token ids in [0, {vocab})")
        if len(generated) >= params.max_new_tokens:
            raise RequestError(f"{len(generated)} tokens were already generated: the request had ended "
                               f"(max_new_tokens {params.max_new_tokens})")

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, ...]:
        info = self.workers[0].info
        validate_prompt(prompt_ids, info.vocab_size)
        params.validate(info.vocab_size)
        total = len(prompt_ids) + params.max_new_tokens
        if total > info.max_context:
            raise RequestError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) = "
                               f"{total} exceeds the model context of {info.max_context} tokens")
        largest = max(w.view.total_tokens for w in self.workers if w.alive)
        if total - 1 > largest:
            raise RequestError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) needs "
                               f"{total - 1} KV tokens, more than the largest worker pool ({largest}); "
                               f"it could never finish")
        return tuple(int(t) for t in prompt_ids)

    async def abort(self, request_id: str, forget: bool = False) -> bool:
        """Abort a request at any stage; False if it had already ended. `forget`: also move it
        out of the live tables (as `wait` would; the record stays readable for a while), for a
        caller that will not read it, such as an HTTP handler whose client went away."""
        req = self.requests.get(request_id)
        aborted = req is not None and not req.state.is_done
        if aborted:
            if req.state is State.WAITING:
                self.waiting.remove(req)
            elif req.state is State.RETRACTED and req in self.retracted:
                self.retracted.remove(req)
            req.snapshot_ref = None  # releases the snapshot from the object store
            self._finish(req, State.ABORTED, "abort")
        if forget and req is not None:
            self._forget(req)
        return aborted

    async def wait(self, request_id: str, timeout: float | None = None) -> dict:
        """Wait for the request to end; returns its record and forgets it (see `_forget`)."""
        req = self._get(request_id)
        progress = self._progress.get(request_id)  # a local: a concurrent reader may forget it
        while not req.state.is_done:
            self._raise_if_fatal()
            await asyncio.wait_for(progress.wait(), timeout)
            progress.clear()
        self._forget(req)
        return req.result()

    async def next_tokens(self, request_id: str, cursor: int) -> tuple[list[int], bool]:
        """Tokens generated after `cursor` (waits for at least one unless the request ended).
        The call that reports the end forgets the request, like `wait`."""
        req = self._get(request_id)
        progress = self._progress.get(request_id)
        while len(req.output_ids) <= cursor and not req.state.is_done:
            self._raise_if_fatal()
            await progress.wait()
            progress.clear()
        if req.state.is_done:
            self._forget(req)
        return req.output_ids[cursor:], req.state.is_done

    def _get(self, request_id: str) -> Request:
        req = self.requests.get(request_id) or self._ended.get(request_id)
        if req is None:
            raise RequestError(f"unknown request id {request_id!r}")
        return req

    def _forget(self, req: Request) -> None:
        """Move an ended request out of the live tables. Its record stays readable for a while
        (the last ENDED_RECORDS_KEPT), so a stream and `result()` of one request both succeed,
        in either order or at once, and a stream-only request does not linger in the tables."""
        rid = req.request_id
        if self.requests.get(rid) is req:
            del self.requests[rid]
            self._progress.pop(rid, None)
        req.snapshot_ref = None
        self._ended.pop(rid, None)
        self._ended[rid] = req
        self._forgotten += 1
        if self._forgotten % TRIM_EVERY_REQUESTS == 0:
            trim_heap()
        while len(self._ended) > ENDED_RECORDS_KEPT:
            del self._ended[next(iter(self._ended))]

    async def stats(self, detail: bool = False) -> dict:
        """Counters, table sizes, per-worker room, faults fired; with `detail`, the scheduler's RSS,
        whether its process has loaded torch, and the object store's spill counters too."""
        d = self.counters.summary(self._table_sizes(), [w.view for w in self.workers])
        d["snapshot_bytes_held"] = self._snapshot_bytes_held()
        d["snapshot_budget_bytes"] = self._snapshot_budget
        d["workers_alive"] = sum(w.alive for w in self.workers)
        cache = self.state_cache
        d["state_cache_bytes"] = cache.bytes if cache else 0
        d["state_cache_entries"] = len(cache) if cache else 0
        d["state_cache_evictions"] = cache.evictions if cache else 0
        d["state_cache_budget_bytes"] = cache.budget_bytes if cache else 0
        d["state_cache_inline_bytes"] = cache.inline_bytes if cache else 0  # in the scheduler's memory
        d["faults_fired"] = list(self._faults.fired)
        d["scheduler_restarted"] = self.restarted
        if detail:
            d["scheduler_rss_bytes"] = _rss_bytes()
            d["scheduler_torch_loaded"] = "torch" in sys.modules  # the control plane must stay torch-free
            d.update(object_store_stats())
        return d

    async def timeline(self) -> list[tuple]:
        """(t_s, worker, kv_used_fraction, mamba_slots_used, new_tokens) per worker call."""
        return self.counters.timeline_rows()

    def _table_sizes(self) -> dict:
        return {"requests": len(self.requests), "waiting": len(self.waiting),
                "retracted": len(self.retracted),
                "snapshots_held": sum(r.snapshot_ref is not None for r in self.requests.values()),
                "running": sum(len(w.view.running) for w in self.workers)}

    async def check_idle(self) -> dict:
        """Every worker's pool empty and every table empty? (for tests and the run summary)"""
        alive = [w for w in self.workers if w.alive]
        idle = await asyncio.gather(*[w.handle.is_idle.remote() for w in alive])
        return {"workers_idle": all(idle), "tables": self._table_sizes()}

    # ================================================================== worker loop
    async def _loop(self, w: WorkerSlot) -> None:
        try:
            while not self._closing and w.alive:
                plan = self._plan(w)
                if plan.is_empty():
                    w.event.clear()
                    await w.event.wait()
                    continue
                await self._execute(w, plan)
        except asyncio.CancelledError:
            pass
        except Exception as err:  # a bug in the scheduler itself: fail loudly, do not hang clients
            log.exception("worker loop %d crashed", w.index)
            self._fatal = f"scheduler loop for worker {w.index} crashed: {err!r}"
            self._notify_all_requests()

    def _plan(self, w: WorkerSlot) -> Plan:
        best_elsewhere = max((o.view.room() for o in self.workers if o is not w and o.alive), default=-1.0)
        reserve = self.config.scheduler.admission == "reserve"
        others = tuple(o.view for o in self.workers if o is not w and o.alive)
        plan = plan_step(w.view, self.waiting, self.retracted, self.config.scheduler, best_elsewhere, reserve, others)
        self.counters.preemptions += plan.preempted
        return plan

    async def _execute(self, w: WorkerSlot, plan: Plan) -> None:
        self._fire_faults(w)
        snap_victims, drop = self._apply_victims(w, plan)
        resume_snap = [r for r in plan.resume if not r.recompute]
        prefill = [_prefill_item(r) for r in plan.resume if r.recompute] + [_prefill_item(r) for r in plan.admit]
        cross_node = self._cross_node(resume_snap[0], w) if resume_snap else None
        self._mark_running(w, plan.resume + plan.admit)
        prefixes = self._prefix_hits(plan.admit)
        cfg = self.config.scheduler
        chunk = dict(prefill_chunk_tokens=cfg.prefill_chunk_tokens, prefill_budget_tokens=cfg.prefill_budget_tokens)
        step = StepPlan(tuple(drop), tuple(r.request_id for r in resume_snap), tuple(prefill), plan.decode_steps,
                        tuple(r.request_id for r, _ in prefixes), self._park_min_tokens(),
                        fault=self._step_fault(w, w.view.calls, plan.decode_steps, cross_node), **chunk)
        retract_refs = [self._retract_call(w, r) for r in snap_victims]  # queued: others may resume them
        step_refs = [w.handle.step.remote(step, *[[r.snapshot_ref] for r in resume_snap],
                                          *[[e.ref] for _, e in prefixes])]
        self._count_resume_bytes(w, resume_snap)
        if self._can_pipeline(w, plan):  # queue the next call now: the worker never waits for us
            fault = self._step_fault(w, w.view.calls + 1, plan.decode_steps, None, pipelined=True)
            step_refs.append(w.handle.step.remote(StepPlan(decode_steps=plan.decode_steps,
                                                           park_min_tokens=self._park_min_tokens(),
                                                           fault=fault, **chunk)))
            self.counters.pipelined_calls += 1
        w.view.calls += len(step_refs)
        results = await asyncio.gather(*step_refs, *[call[1] for call in retract_refs], return_exceptions=True)
        self._on_result(w, plan, results[0], resume_snap)
        if len(step_refs) == 2:
            self._on_result(w, Plan(decode_steps=plan.decode_steps), results[1], [])
        self._on_snapshots(w, snap_victims, retract_refs, results[len(step_refs):])
        self._notify()

    def _retract_call(self, w: WorkerSlot, r: Request) -> tuple[Any, Any, int]:
        """Send `Worker.retract_pending` and queue `r` with the pending snapshot ref now; returns
        (snapshot ref, size ref, estimated bytes): only the small size is awaited, never the
        bytes. (The request may resume elsewhere and grow before the size arrives: the estimate
        counted in flight is the one taken now.)"""
        estimate = self._estimate_bytes(w, r)
        corrupt = w.index in self._corrupt_next
        if corrupt:
            self._corrupt_next.discard(w.index)
            log.warning("fault injection: flipped one byte of the snapshot of %s", r.request_id)
        fault = self._faults.in_retract(w.index, w.view.calls, r.request_id)
        if fault is not None:
            log.warning("fault injection: %s sent to worker %d retracting %s", fault.kind, w.index, r.request_id)
        snap_ref, size_ref = w.handle.retract_pending.options(num_returns=2).remote(r.request_id, corrupt, fault)
        r.snapshot_ref, r.snapshot_bytes, r.snapshot_node = snap_ref, 0, w.info.node_id
        enqueue(self.retracted, r)
        self._notify()
        return snap_ref, size_ref, estimate

    def _can_pipeline(self, w: WorkerSlot, plan: Plan) -> bool:
        """A pure-decode call with nothing waiting and room for twice the steps: the call after
        it needs no decision, so it is sent before this one returns."""
        cfg = self.config.scheduler
        if plan.victims or plan.resume or plan.admit or self.waiting or self.retracted:
            return False
        if cfg.force_retract_every:
            return False
        return decode_need(w.view, w.view.running, 2 * plan.decode_steps) <= w.view.free_tokens

    def _apply_victims(self, w: WorkerSlot, plan: Plan) -> tuple[list[Request], list[str]]:
        """Move victims out of RUNNING; returns (victims to snapshot, ids to drop)."""
        snap, drop = [], [r.request_id for r in w.view.running if r.state.is_done]  # aborted, stop string
        w.view.running = [r for r in w.view.running if r.state is State.RUNNING]
        tokens_gained = 0
        for r in plan.victims:
            if r.state is not State.RUNNING:  # aborted after the plan saw it: already in `drop`
                continue
            w.view.running.remove(r)
            tokens_gained += w.view.held(r)
            r.state, r.retractions = State.RETRACTED, r.retractions + 1
            if self._retract_mode(w, r) == "snapshot":
                r.recompute = False  # a flag left from an earlier recompute would skip this snapshot
                snap.append(r)
            else:
                r.recompute, r.snapshot_ref = True, None
                drop.append(r.request_id)
                enqueue(self.retracted, r)
            self.counters.on_retract(r.recompute)
        if plan.victims:
            log.info("Retract requests on worker %d: #retracted_reqs: %d, #new_tokens_gained: %d, "
                     "#mamba_slots_gained: %d", w.index, len(plan.victims), tokens_gained, len(plan.victims))
        return snap, drop

    def _retract_mode(self, w: WorkerSlot, r: Request) -> str:
        """snapshot | recompute for this victim: the configured mode, the cost model in `auto`
        mode, and recompute whenever the snapshot would overflow the object-store budget."""
        info, mode = w.info, self.config.scheduler.retract
        nbytes = self._estimate_bytes(w, r)
        if mode == "auto":
            mode = choose_retract_mode(r.num_cached + 1, nbytes, info.copy_bytes_per_s, info.prefill_tokens_per_s,
                                       cross_node=self._multi_node())
        if mode == "snapshot" and self._snapshot_bytes_held() + nbytes > self._snapshot_budget:
            self.counters.store_pressure_fallbacks += 1
            return "recompute"
        self._inflight_snapshot_bytes += nbytes if mode == "snapshot" else 0
        return mode

    def _multi_node(self) -> bool:
        """Do live workers sit on more than one node (a resume may cross the network)?"""
        return len({w.info.node_id for w in self.workers if w.alive}) > 1

    def _count_resume_bytes(self, w: WorkerSlot, resumed: list[Request]) -> None:
        """Bytes each snapshot resume moves between nodes: once from the producer's node to
        this worker's, or nothing on the same node; and what the former flow (producer ->
        scheduler node -> destination) would have moved, for comparison."""
        for r in resumed:
            nbytes = r.snapshot_bytes or self._estimate_bytes(w, r)
            here = w.info.node_id
            via = (r.snapshot_node != self._node_id) + (here != self._node_id)
            self.counters.on_resume_bytes(nbytes * (r.snapshot_node != here), nbytes * via)

    @staticmethod
    def _estimate_bytes(w: WorkerSlot, r: Request) -> int:
        return r.num_cached * w.info.kv_bytes_per_token + w.info.mamba_bytes_per_slot

    def _snapshot_bytes_held(self) -> int:
        held = sum(r.snapshot_bytes for r in self.requests.values() if r.snapshot_ref is not None)
        return held + self._inflight_snapshot_bytes

    def _mark_running(self, w: WorkerSlot, reqs: list[Request]) -> None:
        for r in reqs:
            if r.state is State.RETRACTED:
                self.counters.on_resume(r.recompute, migrated=bool(r.workers) and r.workers[-1] != w.index,
                                        cross_node=self._cross_node(r, w))
            r.state, r.worker = State.RUNNING, w.index
            r.workers.append(w.index)
            w.view.running.append(r)

    def _cross_node(self, r: Request, w: WorkerSlot) -> bool:
        if not r.workers:
            return False
        last = self.workers[r.workers[-1]] if r.workers[-1] < len(self.workers) else None
        return last is not None and last.info.node_id != w.info.node_id

    # ================================================================== results
    def _on_result(self, w: WorkerSlot, plan: Plan, result: Any, resumed: list[Request]) -> None:
        if isinstance(result, BaseException):
            self._on_worker_failure(w, result)
            for r in resumed:  # their snapshots were not consumed: resume from them elsewhere
                r.recompute = r.snapshot_ref is None
            for r in plan.admit:  # looked up again when admitted again
                self._prefix_of.pop(r.request_id, None)
            return
        now = time.monotonic()
        assert isinstance(result, StepResult)
        self._update_view(w, result)
        for rid, toks in result.new_tokens.items():
            req = self.requests.get(rid)
            if req is not None and req.state is State.RUNNING:
                toks = _cut_at_stop_string(req, toks)
                req.add_tokens(toks, now)
                self.counters.tokens += len(toks)
                self._progress[rid].set()
                if req.text_stream is not None and req.text_stream.stopped is not None:
                    self._finish(req, State.FINISHED, "stop", worker_holds=True)
        self._on_cache_result(w, plan, result)
        for r in resumed:
            if r.request_id not in result.not_admitted and r.request_id not in result.resume_failed:
                r.snapshot_ref = None  # restored: release the object
        self._requeue(w, result)
        for rid, reason in result.finished.items():
            req = self.requests.get(rid)
            if req is not None and req.state is State.RUNNING:
                self._finish(req, State.FINISHED, reason)
        self.counters.on_step(w.index, result, now)

    # ================================================================== turn cache
    def _park_min_tokens(self) -> int:
        return self.state_cache.min_tokens if self.state_cache is not None else 0

    def _prefix_hits(self, admitted: list[Request]) -> list[tuple[Request, Parked]]:
        """(request, parked state) for each new request whose prompt starts with a parked state."""
        if self.state_cache is None:
            return []
        hits = []
        for r in admitted:
            entry = self.state_cache.lookup(r.prompt_ids) if not r.num_generated else None
            if entry is not None:
                hits.append((r, entry))
                self._prefix_of[r.request_id] = entry
        return hits

    def _on_cache_result(self, w: WorkerSlot, plan: Plan, result: StepResult) -> None:
        """Count hits and misses of the admitted requests, forget parked states that could not
        be used, and take over the states this call parked."""
        cache = self.state_cache
        if cache is None:
            return
        for r in plan.admit:
            entry = self._prefix_of.pop(r.request_id, None)
            if r.request_id in result.not_admitted:
                continue  # looked up again when it is admitted
            r.cached_tokens = result.cached.get(r.request_id, 0)
            r.cache_kind = entry.kind if entry is not None and r.cached_tokens else None
            self.counters.on_cache_lookup(r.cached_tokens, r.cache_kind)
            if r.request_id in result.prefix_failed and entry is not None:
                log.warning("parked state for %s not used on worker %d (%s); prefilled in full",
                            r.request_id, w.index, result.prefix_failed[r.request_id])
                cache.drop(entry.tokens)
                self.counters.state_cache_fallbacks += 1
        if result.parked:
            self._take_parked(w, result.parked)

    def _take_parked(self, w: WorkerSlot, parked: list[tuple[str, str, int, int]]) -> None:
        """`Worker.take_parked` hands the copies over as return values: the scheduler owns them,
        they stay in the worker node's store, and outlive the worker process."""
        keys = [(rid, kind) for rid, kind, _, _ in parked]
        refs = w.handle.take_parked.options(num_returns=len(keys)).remote(keys)
        refs = [refs] if len(keys) == 1 else refs
        for (rid, kind, num_tokens, nbytes), ref in zip(parked, refs):
            req = self.requests.get(rid)
            if req is not None and req.state is State.RUNNING and len(req.token_ids) > num_tokens:
                self.state_cache.park(req.token_ids[:num_tokens], ref, nbytes, kind, w.info.node_id)

    def _update_view(self, w: WorkerSlot, result: StepResult) -> None:
        u: Usage = result.usage
        w.view.free_tokens, w.view.free_slots = u.kv_free_tokens, u.mamba_free_slots
        w.view.allocated = dict(result.allocated)

    def _requeue(self, w: WorkerSlot, result: StepResult) -> None:
        """Resumes/prefills that did not fit go back to the head of their queue."""
        for rid, why in result.resume_failed.items():
            req = self.requests.get(rid)
            if why.startswith(SNAPSHOT_LOST):  # its node died with it, or its retraction failed
                log.warning("%s of %s on worker %d; recomputing it instead", why, rid, w.index)
                self.counters.snapshots_lost += 1
                self.counters.recovered += 1
            else:
                log.warning("snapshot of %s refused on worker %d (%s); recomputing it instead", rid, w.index, why)
                self.counters.snapshots_refused += 1
            if req is not None and req.state is State.RUNNING:  # not aborted while in flight
                req.snapshot_ref, req.recompute = None, True
                self._unrun(w, req, front=True)
        for rid in result.not_admitted:
            req = self.requests.get(rid)
            if req is not None and req.state is State.RUNNING:  # an aborted one stays ended
                self._unrun(w, req, front=True)

    def _unrun(self, w: WorkerSlot, req: Request, front: bool) -> None:
        if req in w.view.running:
            w.view.running.remove(req)
        if req.workers and req.workers[-1] == w.index:
            req.workers.pop()
        fresh = req.num_generated == 0 and not req.retractions
        req.state = State.WAITING if fresh else State.RETRACTED
        queue = self.waiting if fresh else self.retracted
        enqueue(queue, req, front)

    def _on_snapshots(self, w: WorkerSlot, victims: list[Request], calls: list[tuple[Any, Any, int]],
                      sizes: list[Any]) -> None:
        """The sizes of the snapshots `w` took (already queued with their refs), or the errors of
        retractions that failed: those requests are recomputed instead."""
        for req, (ref, _, estimate), size in zip(victims, calls, sizes):
            self._inflight_snapshot_bytes -= estimate
            current = req.snapshot_ref is ref  # not resumed (or retracted again) meanwhile
            if isinstance(size, BaseException):
                log.warning("retraction of %s on worker %d failed (%r); it will be recomputed",
                            req.request_id, w.index, size)
                waiting = current and req.state is State.RETRACTED
                if waiting:  # (one already resuming elsewhere reports the snapshot lost instead)
                    req.snapshot_ref, req.recompute = None, True
                self.counters.recovered += waiting  # recovered by recompute
                continue
            self.counters.snapshot_bytes += size
            if current:
                req.snapshot_bytes = size
                self.counters.note_snapshot_bytes_held(self._snapshot_bytes_held())

    def _on_worker_failure(self, w: WorkerSlot, err: BaseException) -> None:
        """A call failed: retire the worker and recover every request it held.

        Requests holding a snapshot resume from it; the others are recomputed from the token
        history the scheduler holds. Tokens of the failed call never arrived, so nothing is
        emitted twice. A replacement worker is started when the cluster has room for one.
        """
        if not w.alive:
            return
        dead = isinstance(err, ray.exceptions.ActorDiedError)  # "unavailable" may still hold its GPU
        log.error("worker %d %s (%r); recovering its %d requests", w.index,
                  "died" if dead else "failed a call", err, len(w.view.running))
        w.alive = False
        if not dead:
            ray.kill(w.handle, no_restart=True)  # its state is unknown after a failed call
        self.counters.worker_failures += 1
        for req in reversed(list(w.view.running)):
            if req.state is not State.RUNNING:
                continue  # aborted while the call was in flight: it stays ended
            self.counters.recovered += 1
            if not req.num_generated and not req.retractions:  # never ran: admit it afresh
                self._unrun(w, req, front=True)  # (and look its prompt up in the turn cache)
                continue
            req.recompute = req.snapshot_ref is None
            req.state = State.RETRACTED
            enqueue(self.retracted, req, front=True)
        w.view.running = []
        if self.config.scheduler.replace_failed_workers and not self._closing:
            self._pending_replacements += 1
            asyncio.get_running_loop().create_task(self._replace_worker())
        self._check_any_alive()

    async def _replace_worker(self, timeout_s: float = 180.0) -> None:  # a loaded machine starts slowly
        from raysched.workers import spawn_worker

        index = len(self.workers) + self._pending_replacements - 1
        handle = spawn_worker(self.config, index)
        try:
            info = await asyncio.wait_for(handle.info.remote(), timeout_s)
        except Exception as err:  # no room in the cluster, or it failed to start
            log.warning("could not start a replacement worker (%r); carrying on with fewer", err)
            ray.kill(handle)
            info = None
        self._pending_replacements -= 1
        if info is not None and not self._closing:
            info = dataclasses.replace(info, index=len(self.workers))
            self._add_worker(handle, info)
            self.counters.workers_replaced += 1
            log.info("replacement worker %d started on node %s", info.index, info.node_id[:12])
        self._check_any_alive()
        self._notify()

    def _check_any_alive(self) -> None:
        if not any(x.alive for x in self.workers) and not self._pending_replacements:
            self._fatal = "every worker has failed and none could be replaced"
            self._notify_all_requests()

    # ================================================================== fault injection
    def _fire_faults(self, w: WorkerSlot) -> None:
        """Carry out the faults due before this worker's next call (see `raysched.faults`)."""
        scheduler_calls = sum(x.view.calls for x in self.workers)
        for fault in self._faults.due_between_calls(w.index, w.view.calls, scheduler_calls):
            log.warning("fault injection: %s on worker %d after %d calls", fault.kind, w.index, w.view.calls)
            if fault.kind == "kill_worker":
                ray.kill(w.handle, no_restart=True)
            elif fault.kind == "remove_node":
                for other in self.workers:
                    if other.alive and other.info.node_id == w.info.node_id:
                        ray.kill(other.handle, no_restart=True)
            elif fault.kind == "kill_scheduler":
                _exit_scheduler_process()
            else:
                self._corrupt_next.add(w.index)

    def _step_fault(self, w: WorkerSlot, call: int, decode_steps: int, resume_cross_node: bool | None,
                    pipelined: bool = False) -> FaultPoint | None:
        """The fault point a step call carries to the worker (fault injection), logged."""
        point = self._faults.in_step(w.index, call, decode_steps, resume_cross_node, pipelined,
                                     tuple(r.request_id for r in w.view.running))
        if point is not None:
            log.warning("fault injection: %s sent to worker %d in call %d%s", point.kind, w.index, call,
                        " (pipelined)" if pipelined else "")
        return point

    # ================================================================== helpers
    def _finish(self, req: Request, state: State, reason: str, worker_holds: bool = False) -> None:
        """End a request. One the worker still holds (aborted, or stopped by a stop string) stays
        in the worker's view until the next call drops it."""
        req.state, req.finish_reason, req.finish_s = state, reason, time.monotonic()
        if req.worker is not None:
            view = self.workers[req.worker].view
            if req in view.running and state is not State.ABORTED and not worker_holds:
                view.running.remove(req)
        self.counters.on_finish(req)
        self._progress[req.request_id].set()

    def _notify(self) -> None:
        for w in self.workers:
            w.event.set()

    def _notify_all_requests(self) -> None:
        for ev in self._progress.values():
            ev.set()

    def _raise_if_fatal(self) -> None:
        if self._fatal:
            raise RuntimeError(self._fatal)


def _start_error(config: ServeConfig, index: int, err: BaseException) -> BaseException:
    """A worker that raised in its constructor (bad model path, foreign checkpoint, no CUDA):
    a ConfigError naming the cause in one line instead of Ray's nested traceback."""
    if not getattr(err, "actor_init_failed", False):
        return err
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(err)).splitlines() if ln.strip()]
    cause = re.sub(r"^[\w.]*\.(\w+: )", r"\1", lines[-1]) if lines else "unknown error"  # drop the module
    return ConfigError(f"serve config: model {config.model!r}: worker {index} could not start: {cause}")


def _was_restarted() -> bool:
    """Whether Ray re-created this actor after its process died (False outside Ray)."""
    if not ray.is_initialized():  # a Scheduler object in a plain process (tests): do not start Ray
        return False
    try:
        with warnings.catch_warnings():  # Ray 2.60 warns about its own use of a deprecated field here
            warnings.simplefilter("ignore")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:
        return False


def _exit_scheduler_process() -> None:
    """Fault injection (kill_scheduler): end this process on the spot, as a crash would."""
    log.error("fault injection: kill_scheduler: scheduler process %d exits", os.getpid())
    logging.shutdown()
    os._exit(1)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _local_object_store_bytes() -> int:
    """Capacity of the object store on this (the scheduler's) node."""
    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here:
            return int(node.get("Resources", {}).get("object_store_memory", 0))
    return int(ray.cluster_resources().get("object_store_memory", 0))


def _cut_at_stop_string(req: Request, tokens: list[int]) -> list[int]:
    """The new tokens up to the one that completes a stop string (all of them if none does)."""
    if req.text_stream is None:
        return tokens
    req.text_stream.add(tokens)
    if req.text_stream.stopped is None:
        return tokens
    return tokens[:req.text_stream.num_tokens - req.num_generated]


def _prefill_item(r: Request) -> PrefillItem:
    return PrefillItem(r.request_id, r.token_ids, len(r.prompt_ids), r.sampling.to_dict())
