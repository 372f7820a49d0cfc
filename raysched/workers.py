"""Starting worker actors with the right resources (the scheduler owns them).

The scheduler never imports the data plane: the actor class it starts is `Worker` below, a
torch-free shell whose constructor imports `actors.worker` *inside the worker's process* and whose
methods hand each call to the real `actors.worker.Worker` (or, when the config has faults, to
the class `actors.faults.with_faults` derives from it: fault code stays out of the production
worker). Ray pickles this class by reference
(`raysched.workers.Worker`), so the scheduler's process loads neither torch nor model code, and
the actor keeps the class name `Worker` in Ray's actor table.

    handle = spawn_worker(config, index=0)
    info = await handle.info.remote()
    kill_worker(handle)

With `data_plane: sim` the workers are simulated (`actors.sim`), many to a process: a `SimHost`
actor per `sim.workers_per_process` workers, and for each worker a `SimWorkerHandle` that offers
the worker actor's methods (`handle.step.remote(...)`, `.options(num_returns=2)`), so the
scheduler cannot tell the two apart. With `sim.batch_calls` (the default) a host's step calls
travel in batches (`HostChannel`): one Ray call per host carries the steps started in one turn
of the caller's event loop, and one waiting call brings back every reply ready.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import ray

from raysched.config import ServeConfig
from raysched.messages import NOTICE_SEQ, FaultPoint, FinishNotice, StepPlan, StepResult, StepTokens, Usage, WorkerInfo

log = logging.getLogger("raysched.scheduler")

DATA_PLANE_WORKER = "actors.worker"  # the module that defines the real Worker (torch, the model)
CONTROL_GROUP = {"control": 1}  # `Worker.interrupt` runs here, beside a step call; every other
#   method runs in the default group, one at a time, in the order sent


class Worker:
    """The worker actor as the scheduler knows it: each method runs the data-plane method of the
    same name (see `actors.worker.Worker` for what they do). A test checks that the two classes
    have the same public methods."""

    def __init__(self, config: ServeConfig, index: int) -> None:
        self._impl = data_plane_class(config)(config, index)  # imported in the worker's process only

    def info(self) -> WorkerInfo:
        return self._impl.info()

    def usage(self) -> Usage:
        return self._impl.usage()

    def running_ids(self) -> list[str]:
        return self._impl.running_ids()

    def is_idle(self) -> bool:
        return self._impl.is_idle()

    def retract(self, request_id: str) -> Any:
        return self._impl.retract(request_id)

    def retract_pending(self, request_id: str, fault: FaultPoint | None = None) -> tuple[Any, int]:
        return self._impl.retract_pending(request_id, fault)

    def step(self, plan: StepPlan, *snapshots: Any) -> StepResult:
        return self._impl.step(plan, *snapshots)

    def step_stream(self, plan: StepPlan, *snapshots: Any) -> Iterator[StepTokens | StepResult]:
        yield from self._impl.step_stream(plan, *snapshots)

    @ray.method(concurrency_group="control")
    def interrupt(self, call_id: int) -> None:
        self._impl.interrupt(call_id)  # beside a running step call (see `spawn_worker`)

    @ray.method(concurrency_group="control")
    def join(self, call_id: int, items: list) -> None:
        self._impl.join(call_id, items)

    def take_parked(self, keys: list[tuple[str, str, int]]) -> Any:
        return self._impl.take_parked(keys)

    def discard_parked(self, keys: list[tuple[str, str, int]]) -> None:
        return self._impl.discard_parked(keys)

    def migrate_out(self, request_id: str, start: int, block_tokens: int, final: bool,
                    fault: FaultPoint | None = None) -> tuple[Any, tuple[int, int, int]]:
        return self._impl.migrate_out(request_id, start, block_tokens, final, fault)

    def reserve(self, request_id: str, num_tokens: int, fault: FaultPoint | None = None) -> bool:
        return self._impl.reserve(request_id, num_tokens, fault)

    def migrate_in(self, request_id: str, blocks: list, fault: FaultPoint | None = None) -> bool:
        return self._impl.migrate_in(request_id, blocks, fault)

    def commit(self, snapshot: list, fault: FaultPoint | None = None) -> bool:
        return self._impl.commit(snapshot, fault)

    def unreserve(self, request_id: str) -> bool:
        return self._impl.unreserve(request_id)


def data_plane_class(config: ServeConfig) -> type:
    """The data-plane worker class for `config` (imports the data plane: call it in a worker)."""
    cls = importlib.import_module(DATA_PLANE_WORKER).Worker
    faults = importlib.import_module("actors.faults")
    return faults.with_faults(cls) if faults.needs_faults(config) else cls


def worker_options(config: ServeConfig) -> dict:
    """One GPU per worker when the cluster has GPUs (or device: cuda), else one CPU; spread."""
    gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = config.device == "cuda" or (config.device == "auto" and gpus >= 1)
    return {"num_cpus": 1, "num_gpus": 1 if use_gpu else 0, "scheduling_strategy": "SPREAD",
            "max_restarts": 0, "max_task_retries": 0, "enable_task_events": False}


def worker_bundle(config: ServeConfig) -> dict[str, float]:
    """The resources one worker actor asks Ray for (what an autoscaler must find room for);
    empty for simulated workers (they share host actors)."""
    if config.data_plane == "sim":
        return {}
    opts = worker_options(config)
    return {k: v for k, v in (("CPU", opts["num_cpus"]), ("GPU", opts["num_gpus"])) if v}


def room_shortfall(config: ServeConfig, workers: int = 1) -> str | None:
    """None when the cluster has free resources for `workers` more worker actors now, else one
    line saying what a worker asks for and what the cluster has free ("a worker asks for 1 CPU;
    the cluster has 0 of 2 CPU free"). Summed over the nodes, so it can miss a shortfall that
    only the split across nodes makes, never invent one."""
    bundle = worker_bundle(config)
    free, total = ray.available_resources(), ray.cluster_resources()
    if all(free.get(k, 0.0) >= workers * v for k, v in bundle.items()):
        return None
    asks = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
    has = ", ".join(f"{free.get(k, 0.0):g} of {total.get(k, 0.0):g} {k}" for k in bundle)
    return f"{'a worker asks' if workers == 1 else f'{workers} workers ask, each'} for {asks}; the cluster has {has} free"


def spawn_worker(config: ServeConfig, index: int) -> Any:
    """Start worker `index`; returns its actor handle (the caller owns the actor). With no room
    in the cluster now it logs one line: Ray places the actor once room appears (a node an
    autoscaler adds), and the caller's timeout ends the wait."""
    if config.data_plane == "sim":
        return spawn_sim_worker(config, index)
    short = room_shortfall(config)
    if short is not None:
        log.warning("worker %d waits for room in the Ray cluster: %s", index, short)
    return worker_actor_class().options(**worker_options(config)).remote(config, index)


def worker_actor_class() -> Any:
    """`Worker` as a Ray actor class (with the concurrency group `interrupt` runs in)."""
    return ray.remote(concurrency_groups=CONTROL_GROUP)(Worker)


def kill_worker(handle: Any) -> None:
    """End a worker for good: its actor, or a simulated worker alone (its host stays)."""
    if isinstance(handle, SimWorkerHandle):
        handle.host.kill.remote(handle.index)
    else:
        ray.kill(handle, no_restart=True)


def release_workers(handles: list[Any]) -> None:
    """End every worker actor process behind `handles` (simulated workers' hosts included)."""
    hosts = {id(h.host): h.host for h in handles if isinstance(h, SimWorkerHandle)}
    for handle in [h for h in handles if not isinstance(h, SimWorkerHandle)] + list(hosts.values()):
        ray.kill(handle, no_restart=True)


# ---------------------------------------------------------------------------- simulated workers


class SimHost:
    """The host actor of simulated workers as the scheduler knows it: a torch-free shell over
    `actors.sim.SimHost` (imported in the host's process only)."""

    def __init__(self, config: ServeConfig) -> None:
        impl = importlib.import_module("actors.sim").SimHost
        self._impl = impl(config, ray.get_runtime_context().get_node_id())

    async def add(self, index: int) -> None:
        await self._impl.add(index)

    async def call(self, index: int, seq: int, method: str, *args: Any) -> Any:
        return await self._impl.call(index, seq, method, *args)

    async def stream(self, index: int, seq: int, *args: Any) -> AsyncIterator[Any]:
        async for piece in self._impl.stream(index, seq, *args):
            yield piece

    def submit(self, items: list[tuple]) -> None:
        self._impl.submit(items)

    async def collect(self) -> list[tuple[int, int, bool, Any]]:
        return await self._impl.collect()

    def interrupt(self, index: int, call_id: int) -> None:
        self._impl.interrupt(index, call_id)

    def join(self, index: int, call_id: int, items: list) -> None:
        self._impl.join(index, call_id, items)

    def kill(self, index: int) -> None:
        self._impl.kill(index)


BESIDE_CALLS = ("interrupt", "join")  # a worker's methods that act on its call in flight, not after it


class _SimMethod:
    """`handle.<method>` of a simulated worker: `.remote(*args)`, `.options(num_returns=n)`."""

    def __init__(self, handle: SimWorkerHandle, name: str, num_returns: int = 1) -> None:
        self.handle, self.name, self.num_returns = handle, name, num_returns

    def options(self, num_returns: int | str = 1) -> _SimMethod:
        return _SimMethod(self.handle, self.name, num_returns)

    def remote(self, *args: Any) -> Any:
        h = self.handle
        if h.channel is not None and (self.name == "step" or self.name in BESIDE_CALLS) and _in_event_loop():
            if self.name == "step":
                return h.channel.step(h.index, next(h.calls), args)
            return h.channel.post(self.name, h.index, *args)
        if self.name in BESIDE_CALLS:  # beside the call it acts on, not in the worker's order
            return getattr(h.host, self.name).remote(h.index, *args)
        if self.name == "step_stream":  # a streaming generator, as the worker actor's
            return h.host.stream.options(num_returns="streaming").remote(h.index, next(h.calls), *args)
        call = h.host.call.options(num_returns=self.num_returns) if self.num_returns != 1 else h.host.call
        return call.remote(h.index, next(h.calls), self.name, *args)


class SimWorkerHandle:
    """A simulated worker: host actor + index; its methods are those of the worker actor."""

    METHODS = ("info", "usage", "running_ids", "is_idle", "retract", "retract_pending", "step", "step_stream",
               "interrupt", "join", "take_parked", "discard_parked", "migrate_out", "reserve", "migrate_in", "commit", "unreserve")

    def __init__(self, host: Any, index: int, channel: HostChannel | None = None) -> None:
        self.host, self.index, self.channel = host, index, channel
        self.calls = itertools.count()  # each call's place in this worker's order

    def __getattr__(self, name: str) -> _SimMethod:
        if name not in SimWorkerHandle.METHODS:
            raise AttributeError(name)
        return _SimMethod(self, name)


class HostChannel:
    """Step calls and interrupts to one host's simulated workers, batched. Ray's task submission
    was 54% of the scheduler's CPU at 256 simulated workers (benchmarks/README, `scale`); one Ray
    call carrying 16 costs about what one call costs (measured here: 43 against 600 us per call).
    What the event loop starts in one turn leaves in one `SimHost.submit`; one `SimHost.collect`
    at a time waits for replies and brings back all that are ready. A step call gets a future
    with its `StepResult` or the exception it raised (the host's death fails every call waiting
    on it); an interrupt or a join is sent and forgotten, as `Fleet.interrupt` treats it."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.outbox: list[tuple] = []  # ("step", index, seq, args) | ("interrupt", index, call_id)
        #   | ("join", index, call_id, items)
        self.waiting: dict[tuple[int, int], asyncio.Future] = {}  # (index, seq) -> its reply
        self.collector: asyncio.Task | None = None
        self.on_notice: FinishNotice | None = None  # where finish notices go
        #   (`route_notices`): they come back with the replies, `NOTICE_SEQ` for their number

    def step(self, index: int, seq: int, args: tuple) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        reply = self.waiting[(index, seq)] = loop.create_future()
        self._post(("step", index, seq, args))
        if self.collector is None:
            self.collector = loop.create_task(self._collect())
        return reply

    def post(self, kind: str, index: int, *args: Any) -> asyncio.Future:
        """An interrupt or a join (`SimHost.submit`), sent and forgotten: a done future."""
        self._post((kind, index, *args))
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def _post(self, item: tuple) -> None:
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self._send)
        self.outbox.append(item)

    def _send(self) -> None:
        items, self.outbox = self.outbox, []
        self.host.submit.remote(items)  # (a dead host: `collect` fails, and with it these calls)

    async def _collect(self) -> None:
        try:
            while self.waiting:
                try:
                    replies = await self.host.collect.remote()
                except Exception as err:  # the host died
                    replies = [(index, seq, False, err) for index, seq in self.waiting]
                for index, seq, ok, value in replies:
                    if seq == NOTICE_SEQ:
                        if self.on_notice is not None:
                            self.on_notice(index, *value)
                        continue
                    reply = self.waiting.pop((index, seq), None)
                    if reply is not None and not reply.done():
                        reply.set_result(value) if ok else reply.set_exception(value)
        finally:
            self.collector = None


def route_notices(handle: Any, on_notice: FinishNotice) -> None:
    """Finish notices of a simulated worker whose host batches calls come back through its
    channel, to `on_notice` (`Dispatcher.on_finish_notice`); other workers send them to the
    scheduler as Ray calls (`Scheduler.call_finished`)."""
    if isinstance(handle, SimWorkerHandle) and handle.channel is not None:
        handle.channel.on_notice = on_notice


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


_sim_hosts: dict[tuple[int, int], tuple[Any, HostChannel | None]] = {}  # (id of the config, host
#   number) -> (host actor, its channel: None without `sim.batch_calls`)


def spawn_sim_worker(config: ServeConfig, index: int) -> SimWorkerHandle:
    """Simulated worker `index` on host `index // sim.workers_per_process` (started on first use)."""
    key = (id(config), index // config.sim.workers_per_process)
    if key not in _sim_hosts:
        opts = {"num_cpus": 0, "max_restarts": 0, "max_task_retries": 0, "max_concurrency": 100_000,
                "enable_task_events": False}
        host = ray.remote(SimHost).options(**opts).remote(config)
        _sim_hosts[key] = (host, HostChannel(host) if config.sim.batch_calls else None)
    host, channel = _sim_hosts[key]
    host.add.remote(index)
    return SimWorkerHandle(host, index, channel)
