"""Recovery: starting the workers, retiring a failed one, replacing it, and a restarted scheduler.

A failed call retires its worker and recovers every request it held: those holding a snapshot
resume from it, the others are recomputed from the token history the scheduler keeps. That
history holds every token a client was sent, those the failed call streamed before it failed
included (a request that got any drops its older snapshot first, `Dispatcher.apply`), so nothing
is emitted twice and nothing is skipped. A replacement worker is started
when the cluster has room for one. When no worker is left and none can be started, the request
table fails every reader. While every worker is being replaced, requests queue (they are validated
against the pools the workers had) and start on the replacement.

A worker that fails again and again (each replacement before any successful call of its own, e.g.
a data-plane bug that every worker hits) is not replaced for ever: the `scheduler.max_worker_failures`th
failure in a row stops the scheduler (`stop`): no more replacements, every worker ended, every
request (waiting, running, new) fails with one line naming the worker's error.

Actor operations go through `ActorOps` (Ray's by default), so this part runs without Ray in
tests: `Recovery(..., actors=FakeActors())`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import re
import warnings
from typing import Any, Callable

from raysched.background import detached_task
from raysched.config import ConfigError, ServeConfig
from raysched.messages import WorkerInfo
from raysched.request import State, enqueue
from raysched.scheduler.fleet import Fleet, WorkerSlot
from raysched.scheduler.roles import Role, initial_roles
from raysched.scheduler.table import RequestTable
from raysched.stats import Counters

log = logging.getLogger("raysched.scheduler")

REPLACEMENT_TIMEOUT_S = 180.0  # a loaded machine starts a worker slowly


class ActorOps:
    """The actor operations recovery needs, done with Ray."""

    def spawn(self, config: ServeConfig, index: int) -> Any:
        from raysched.workers import spawn_worker

        return spawn_worker(config, index)

    def kill(self, handle: Any) -> None:
        from raysched.workers import kill_worker

        kill_worker(handle)

    def is_death(self, err: BaseException) -> bool:
        """Did the actor die (rather than fail one call, after which it may still hold its GPU)?"""
        import ray

        return isinstance(err, ray.exceptions.ActorDiedError)


class Recovery:
    def __init__(self, config: ServeConfig, table: RequestTable, fleet: Fleet, counters: Counters,
                 on_added: Callable[[WorkerSlot], None], actors: ActorOps | None = None,
                 on_stopped: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.table = table
        self.fleet = fleet
        self.counters = counters
        self.actors = actors or ActorOps()
        self._on_added = on_added  # the dispatcher starts the new worker's loop
        self._on_stopped = on_stopped  # (the actor releases what it holds, as `shutdown` does)
        self.pending_replacements = 0
        self.closing = False
        self._warned_kernels: tuple[str, ...] = ()  # the last mix of matrix kernels warned about
        self._spawn_index = itertools.count(config.workers)  # a later spawn's index, never reused
        #   (a simulated host keys its workers by it: two spawns at once must not share one)

    async def start_workers(self) -> None:
        """Start `config.workers` workers; a worker that raised in its constructor kills them all
        and raises (see `start_error`)."""
        handles = [self.actors.spawn(self.config, i) for i in range(self.config.workers)]
        infos = await asyncio.gather(*[h.info.remote() for h in handles], return_exceptions=True)
        failed = next((i for i, info in enumerate(infos) if isinstance(info, BaseException)), None)
        if failed is not None:
            for h in handles:
                self.actors.kill(h)
            raise start_error(self.config, failed, infos[failed])
        for h, info, role in zip(handles, infos, initial_roles(self.config)):
            self._add(h, info, role)
        self.fleet.check_same_model()
        self.warn_mixed_kernels()

    def _add(self, handle: Any, info: WorkerInfo, role: Role) -> WorkerSlot:
        slot = self.fleet.add(handle, info, role)
        self._on_added(slot)
        return slot

    def on_worker_failure(self, w: WorkerSlot, err: BaseException) -> None:
        """A call of `w` failed: retire the worker and recover every request it held."""
        if not w.alive:
            return
        dead = self.actors.is_death(err)
        log.error("worker %d %s (%s); recovering its %d requests", w.index,
                  "died" if dead else "failed a call", one_line(err), len(w.view.running))
        log.debug("worker %d's error in full: %r", w.index, err)
        w.alive = False
        self.fleet.note_room(w)
        if not dead:
            self.actors.kill(w.handle)  # its state is unknown after a failed call
        self.counters.worker_failures += 1
        for req in reversed(list(w.view.running)):
            if req.state is not State.RUNNING:
                continue  # aborted while the call was in flight: it stays ended
            self.counters.recovered += 1
            if not req.num_generated and not req.retractions:  # never ran: admit it afresh
                self.table.unrun(req, w.view)  # (and look its prompt up in the turn cache)
                continue
            req.recompute = req.snapshot_ref is None
            req.state = State.RETRACTED
            enqueue(self.table.retracted, req, front=True)
        w.view.running = []
        streak = w.failures + 1
        if streak >= self.config.scheduler.max_worker_failures and not self.closing:
            self.stop(f"worker failed {streak} times in a row ({one_line(err)}); the scheduler stopped")
            return
        if self.config.scheduler.replace_failed_workers and not self.closing:
            self.pending_replacements += 1
            detached_task(self.replace_worker(role=w.view.role, failures=streak))
        self.check_any_alive()

    def note_served(self, w: WorkerSlot) -> None:
        """`w`'s dispatch loop is back to decide (`Dispatcher.before_decide`): every call it sent
        so far succeeded (a failed one retires it), so a failure streak it inherited ends."""
        if w.view.calls:
            w.failures = 0

    def stop(self, message: str) -> None:
        """Stop for good (a crash loop): no more replacements, every worker ended, and every
        request, waiting, running or new, fails with `message` (one line)."""
        log.error("%s", message)
        self.closing = True
        self.table.fail(message)
        for w in self.fleet.alive():
            w.alive = False
            self.fleet.note_room(w)
            w.event.set()
            self.actors.kill(w.handle)
        self._on_stopped()

    async def replace_worker(self, timeout_s: float = REPLACEMENT_TIMEOUT_S, role: Role = Role.BOTH,
                             failures: int = 0) -> None:
        """Start a worker in place of a failed one (one already counted in `pending_replacements`),
        with the role of the one it replaces and its failures in a row (`WorkerSlot.failures`)."""
        slot = await self.start_worker(timeout_s, role)
        self.pending_replacements -= 1
        if slot is not None:
            slot.failures = failures
            self.counters.workers_replaced += 1
        self.check_any_alive()
        self.fleet.notify()

    async def start_worker(self, timeout_s: float = REPLACEMENT_TIMEOUT_S, role: Role = Role.BOTH) -> WorkerSlot | None:
        """Start one more worker and its loop (a replacement, or `add_worker`); None (logged) if
        the cluster has no room for it or it failed to start."""
        handle = self.actors.spawn(self.config, next(self._spawn_index))
        try:
            info = await asyncio.wait_for(handle.info.remote(), timeout_s)
        except Exception as err:  # no room in the cluster, or it failed to start
            log.warning("could not start a worker (%r); carrying on with fewer", err)
            self.actors.kill(handle)
            return None
        if self.closing:  # stopped or shut down meanwhile: this worker is not wanted
            self.actors.kill(handle)
            return None
        info = dataclasses.replace(info, index=len(self.fleet.slots))
        slot = self._add(handle, info, role)
        log.info("worker %d started on node %s", info.index, info.node_id[:12])
        self.warn_mixed_kernels()
        return slot

    def warn_mixed_kernels(self) -> None:
        """One warning per new mix of matrix kernels among the live workers (a node without a C
        compiler takes MKL where the others run rowdot; CPUs of other kinds differ too)."""
        kinds = self.fleet.mixed_kernels()
        if kinds and tuple(kinds) != self._warned_kernels:
            self._warned_kernels = tuple(kinds)
            log.warning("workers compute with different matrix kernels (%s): a request that moves "
                        "between them continues up to rounding (its logits may differ in the last "
                        "bits), not bit for bit", ", ".join(kinds))

    def retire(self, w: WorkerSlot) -> None:
        """End a drained worker's actor (its loop stops; its slot stays, never reused)."""
        w.alive = False
        self.fleet.note_room(w)
        w.event.set()
        self.actors.kill(w.handle)

    def check_any_alive(self) -> None:
        if not self.fleet.any_alive() and not self.pending_replacements and self.table.fatal is None:
            self.table.fail("every worker has failed and none could be replaced")


def start_error(config: ServeConfig, index: int, err: BaseException) -> BaseException:
    """A worker that raised in its constructor (bad model path, foreign checkpoint, no CUDA):
    a ConfigError naming the cause in one line instead of Ray's nested traceback."""
    if not getattr(err, "actor_init_failed", False):
        return err
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(err)).splitlines() if ln.strip()]
    cause = re.sub(r"^[\w.]*\.(\w+: )", r"\1", lines[-1]) if lines else "unknown error"  # drop the module
    return ConfigError(f"serve config: model {config.model!r}: worker {index} could not start: {cause}")


def one_line(err: BaseException, max_chars: int = 240) -> str:
    """A worker's error as `Type: first line of its message` (the exception the worker raised,
    not Ray's wrapper with its traceback), cut at `max_chars`."""
    cause = getattr(err, "cause", None)
    err = cause if isinstance(cause, BaseException) else err
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    first = text.splitlines()[0].strip() if text else ""
    line = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return line if len(line) <= max_chars else line[:max_chars - 3] + "..."


def was_restarted() -> bool:
    """Whether Ray re-created this actor after its process died (False outside Ray)."""
    import ray

    if not ray.is_initialized():  # a Scheduler object in a plain process (tests): do not start Ray
        return False
    try:
        with warnings.catch_warnings():  # Ray 2.60 warns about its own use of a deprecated field here
            warnings.simplefilter("ignore")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:
        return False
