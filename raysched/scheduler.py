"""The scheduler actor: the single authority over requests and workers.

One async actor. It owns the worker actors (it starts them), the request table, the waiting
queue and the retracted queue. One asyncio task per worker runs the loop

    plan (pure, `planner.plan_step`)  ->  retract victims + step call  ->  apply the result

so a slow worker never blocks the others, and `submit` / `abort` / `stats` get through between
awaits. Snapshots of retracted requests are fetched to the scheduler's node and put back into the
object store by the scheduler itself, so they survive the loss of the worker (or node) that took
them. Torch is never imported here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray

from raysched.config import ConfigError, ServeConfig
from raysched.messages import PrefillItem, StepPlan, StepResult, Usage, WorkerInfo
from raysched.planner import Plan, WorkerView, decode_need, plan_step
from raysched.policy import choose_retract_mode
from raysched.request import Request, State
from raysched.sampling import RequestError, SamplingParams, validate_prompt
from raysched.stats import Counters

log = logging.getLogger("raysched.scheduler")

ENDED_RECORDS_KEPT = 4096  # ended requests already read once, still readable by a late reader


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
        self.config = config
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.retracted: deque[Request] = deque()
        self.workers: list[WorkerSlot] = []
        self.counters = Counters()
        self._progress: dict[str, asyncio.Event] = {}
        self._ended: dict[str, Request] = {}  # read once, out of the live table; oldest first
        self._next_id = 0
        self._closing = False
        self._fatal: str | None = None
        self._pending_replacements = 0
        self._fired: set[int] = set()  # indices of config.faults already fired
        self._corrupt_next: set[int] = set()  # workers whose next snapshot gets a flipped byte
        self._inflight_snapshot_bytes = 0  # estimated bytes of retractions not yet fetched
        self._snapshot_budget = config.scheduler.snapshot_budget_bytes or 0

    # ================================================================== lifecycle
    async def start(self) -> list[dict]:
        """Start the worker actors and their loops; returns one line of facts per worker."""
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
        if self.config.scheduler.snapshot_budget_bytes is None:
            self._snapshot_budget = _local_object_store_bytes() // 2
        return [self._worker_line(w) for w in self.workers]

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
        for w in self.workers:
            ray.kill(w.handle)

    # ================================================================== client API
    async def submit(self, prompt_ids: list[int], sampling: dict | None = None,
                     request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id. Bad input raises RequestError at once."""
        self._raise_if_fatal()
        params = SamplingParams.from_dict(sampling or {})
        prompt = self._validate(prompt_ids, params)
        rid = request_id or f"req-{self._next_id}"
        self._next_id += 1
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        req = Request(rid, prompt, params)
        self.requests[rid] = req
        self._progress[rid] = asyncio.Event()
        self.waiting.append(req)
        self.counters.submitted += 1
        self._notify()
        return rid

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

    async def abort(self, request_id: str) -> bool:
        """Abort a request at any stage; False if it had already ended."""
        req = self.requests.get(request_id)
        if req is None or req.state.is_done:
            return False
        if req.state is State.WAITING:
            self.waiting.remove(req)
        elif req.state is State.RETRACTED and req in self.retracted:
            self.retracted.remove(req)
        req.snapshot_ref = None  # releases the snapshot from the object store
        self._finish(req, State.ABORTED, "abort")
        return True

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
        while len(self._ended) > ENDED_RECORDS_KEPT:
            del self._ended[next(iter(self._ended))]

    async def stats(self, detail: bool = False) -> dict:
        """Counters, table sizes, per-worker room; with `detail`, the scheduler's RSS and the
        object store's spill counters too."""
        d = self.counters.summary(self._table_sizes(), [w.view for w in self.workers])
        d["snapshot_bytes_held"] = self._snapshot_bytes_held()
        d["snapshot_budget_bytes"] = self._snapshot_budget
        d["workers_alive"] = sum(w.alive for w in self.workers)
        if detail:
            d["scheduler_rss_bytes"] = _rss_bytes()
            d.update(_object_store_stats())
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
        return plan_step(w.view, self.waiting, self.retracted, self.config.scheduler, best_elsewhere, reserve)

    async def _execute(self, w: WorkerSlot, plan: Plan) -> None:
        self._fire_faults(w)
        snap_victims, drop = self._apply_victims(w, plan)
        resume_snap = [r for r in plan.resume if not r.recompute]
        prefill = [_prefill_item(r) for r in plan.resume if r.recompute] + [_prefill_item(r) for r in plan.admit]
        self._mark_running(w, plan.resume + plan.admit)
        chunk = self.config.scheduler.prefill_chunk_tokens
        step = StepPlan(tuple(drop), tuple(r.request_id for r in resume_snap), tuple(prefill),
                        plan.decode_steps, chunk)
        retract_refs = [w.handle.retract.remote(r.request_id) for r in snap_victims]
        step_refs = [w.handle.step.remote(step, *[r.snapshot_ref for r in resume_snap])]
        if self._can_pipeline(w, plan):  # queue the next call now: the worker never waits for us
            step_refs.append(w.handle.step.remote(StepPlan(decode_steps=plan.decode_steps,
                                                           prefill_chunk_tokens=chunk)))
            self.counters.pipelined_calls += 1
        w.view.calls += len(step_refs)
        results = await asyncio.gather(*step_refs, *retract_refs, return_exceptions=True)
        self._on_result(w, plan, results[0], resume_snap)
        if len(step_refs) == 2:
            self._on_result(w, Plan(decode_steps=plan.decode_steps), results[1], [])
        await self._on_snapshots(w, snap_victims, results[len(step_refs):])
        self._notify()

    def _can_pipeline(self, w: WorkerSlot, plan: Plan) -> bool:
        """A pure-decode call with nothing waiting and room for twice the steps: the call after
        it needs no decision, so it is sent before this one returns."""
        cfg = self.config.scheduler
        if plan.victims or plan.resume or plan.admit or self.waiting or self.retracted:
            return False
        if cfg.force_retract_every or any(i not in self._fired for i in range(len(self.config.faults))):
            return False
        return decode_need(w.view, w.view.running, 2 * plan.decode_steps) <= w.view.free_tokens

    def _apply_victims(self, w: WorkerSlot, plan: Plan) -> tuple[list[Request], list[str]]:
        """Move victims out of RUNNING; returns (victims to snapshot, ids to drop)."""
        snap, drop = [], [r.request_id for r in w.view.running if r.state is State.ABORTED]
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
                self.retracted.append(r)
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
            mode = choose_retract_mode(r.num_cached + 1, nbytes, info.copy_bytes_per_s, info.prefill_tokens_per_s)
        if mode == "snapshot" and self._snapshot_bytes_held() + nbytes > self._snapshot_budget:
            self.counters.store_pressure_fallbacks += 1
            return "recompute"
        self._inflight_snapshot_bytes += nbytes if mode == "snapshot" else 0
        return mode

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
            return
        now = time.monotonic()
        assert isinstance(result, StepResult)
        self._update_view(w, result)
        for rid, toks in result.new_tokens.items():
            req = self.requests.get(rid)
            if req is not None and req.state is State.RUNNING:
                req.add_tokens(toks, now)
                self.counters.tokens += len(toks)
                self._progress[rid].set()
        for r in resumed:
            if r.request_id not in result.not_admitted and r.request_id not in result.resume_failed:
                r.snapshot_ref = None  # restored: release the object
        self._requeue(w, result)
        for rid, reason in result.finished.items():
            req = self.requests.get(rid)
            if req is not None and req.state is State.RUNNING:
                self._finish(req, State.FINISHED, reason)
        self.counters.on_step(w.index, result, now)

    def _update_view(self, w: WorkerSlot, result: StepResult) -> None:
        u: Usage = result.usage
        w.view.free_tokens, w.view.free_slots = u.kv_free_tokens, u.mamba_free_slots
        w.view.allocated = dict(result.allocated)

    def _requeue(self, w: WorkerSlot, result: StepResult) -> None:
        """Resumes/prefills that did not fit go back to the head of their queue."""
        for rid, why in result.resume_failed.items():
            req = self.requests.get(rid)
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
        queue.appendleft(req) if front else queue.append(req)

    async def _on_snapshots(self, w: WorkerSlot, victims: list[Request], results: list[Any]) -> None:
        for req, snap in zip(victims, results):
            self._inflight_snapshot_bytes -= self._estimate_bytes(w, req)
            if isinstance(snap, BaseException):
                log.warning("retraction of %s on worker %d failed (%r); it will be recomputed",
                            req.request_id, w.index, snap)
                req.recompute = True
                self.counters.recovered += req.state is State.RETRACTED  # recovered by recompute
            elif req.state is State.RETRACTED:  # re-own the bytes on our node: survives worker loss
                snap = self._maybe_corrupt(w, snap)
                req.snapshot_ref, req.snapshot_bytes = ray.put(snap), snap.nbytes
                self.counters.snapshot_bytes += snap.nbytes
            if req.state is State.RETRACTED:
                self.retracted.append(req)

    def _on_worker_failure(self, w: WorkerSlot, err: BaseException) -> None:
        """A call failed: retire the worker and recover every request it held.

        Requests holding a snapshot resume from it; the others are recomputed from the token
        history the scheduler holds. Tokens of the failed call never arrived, so nothing is
        emitted twice. A replacement worker is started when the cluster has room for one.
        """
        if not w.alive:
            return
        dead = isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError))
        log.error("worker %d %s (%r); recovering its %d requests", w.index,
                  "died" if dead else "failed a call", err, len(w.view.running))
        w.alive = False
        if not dead:
            ray.kill(w.handle, no_restart=True)  # its state is unknown after a failed call
        self.counters.worker_failures += 1
        for req in reversed(w.view.running):
            if req.state is not State.RUNNING:
                continue  # aborted while the call was in flight: it stays ended
            req.recompute = req.snapshot_ref is None
            req.state = State.RETRACTED
            self.retracted.appendleft(req)
            self.counters.recovered += 1
        w.view.running = []
        if self.config.scheduler.replace_failed_workers and not self._closing:
            self._pending_replacements += 1
            asyncio.get_running_loop().create_task(self._replace_worker())
        self._check_any_alive()

    async def _replace_worker(self, timeout_s: float = 60.0) -> None:
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
        for i, fault in enumerate(self.config.faults):
            if i in self._fired or fault.worker != w.index or w.view.calls < fault.after_steps:
                continue
            self._fired.add(i)
            log.warning("fault injection: %s on worker %d after %d calls", fault.kind, w.index, w.view.calls)
            if fault.kind == "kill_worker":
                ray.kill(w.handle, no_restart=True)
            elif fault.kind == "remove_node":
                for other in self.workers:
                    if other.alive and other.info.node_id == w.info.node_id:
                        ray.kill(other.handle, no_restart=True)
            else:
                self._corrupt_next.add(w.index)

    def _maybe_corrupt(self, w: WorkerSlot, snap: Any) -> Any:
        if w.index not in self._corrupt_next:
            return snap
        self._corrupt_next.discard(w.index)
        payload = snap.payload.copy()
        payload[len(payload) // 2] ^= 0x01
        log.warning("fault injection: flipped one byte of the snapshot of %s", snap.request_id)
        return dataclasses.replace(snap, payload=payload)

    # ================================================================== helpers
    def _finish(self, req: Request, state: State, reason: str) -> None:
        req.state, req.finish_reason, req.finish_s = state, reason, time.monotonic()
        if req.worker is not None:
            view = self.workers[req.worker].view
            if req in view.running and state is not State.ABORTED:
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _object_store_stats() -> dict:
    """Spilled/restored bytes as Ray reports them (best effort; empty if unavailable)."""
    try:
        from ray._private.internal_api import memory_summary

        # this cluster's GCS: without an address Ray picks the newest cluster on the machine
        text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    except Exception:
        return {}
    out = {}
    for key, pattern in (("object_store_spilled_mib", r"Spilled (\d+) MiB"),
                         ("object_store_restored_mib", r"Restored (\d+) MiB")):
        m = re.search(pattern, text)
        out[key] = int(m.group(1)) if m else 0
    return out


def _local_object_store_bytes() -> int:
    """Capacity of the object store on this (the scheduler's) node."""
    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == here:
            return int(node.get("Resources", {}).get("object_store_memory", 0))
    return int(ray.cluster_resources().get("object_store_memory", 0))


def _prefill_item(r: Request) -> PrefillItem:
    return PrefillItem(r.request_id, r.token_ids, len(r.prompt_ids), r.sampling.to_dict())
