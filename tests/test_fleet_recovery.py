"""A fleet that is briefly empty, a worker that fails again and again, and what a refused request
is told (issue 32's fleet part, issue 36's "too long" error).

- While every worker is being replaced, submitted requests are validated against the pools the
  workers had and wait for the replacement (no internal error); they end with the reference
  tokens (Ray, real tiny workers).
- A worker that fails every call is replaced `scheduler.max_worker_failures - 1` times, then the
  scheduler stops: every request, running, waiting or new, fails with one line naming the
  worker's error, and no worker is left (the scheduler's parts without Ray, and Ray end to end).
  The control: one failure fewer, and the next replacement serves everything.
- The "too long" messages: their arithmetic is what the planner asks of a pool, and one about the
  prompt alone names `prompt` (HTTP's `param`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from raysched.config import SchedulerConfig, ServeConfig
from raysched.messages import StepResult
from raysched.openai_api import request_error
from raysched.sampling import RequestError, SamplingParams
from raysched.scheduler.fleet import Fleet
from raysched.scheduler.recovery import Recovery, one_line
from raysched.scheduler.table import Limits, validate_request
from tests.test_scheduler_parts import LIMITS, FakeWorker, expected, parts

DEVICE_ERROR = ("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
                "(when checking argument for argument out in method wrapper_CUDA_index_select_out)")


# ---------------------------------------------------------------------------- an empty fleet


def test_an_empty_fleet_validates_against_the_pools_its_workers_had() -> None:
    """No live worker (all being replaced): the largest pool is the largest any worker had, so a
    request that fits it is accepted and one that does not is refused as before. The control: with
    a live worker its pool counts, not a larger retired one's."""
    fleet = Fleet()
    small, large = fleet.add(None, FakeWorker(0, kv=128).info()), fleet.add(None, FakeWorker(1, kv=512).info())
    small.alive = large.alive = False
    assert fleet.largest_pool_tokens() == 512
    limits = Limits(LIMITS.vocab_size, LIMITS.max_context, fleet.largest_pool_tokens())
    assert validate_request([1] * 300, SamplingParams(max_new_tokens=8), limits) == tuple([1] * 300)
    with pytest.raises(RequestError, match=r"= 600 tokens, more than the largest worker pool \(512 KV tokens\)"):
        validate_request([1] * 300, SamplingParams(max_new_tokens=300), limits)
    small.alive = True
    assert fleet.largest_pool_tokens() == 128


# ---------------------------------------------------------------------------- crash loops (no Ray)


class FailingActors:
    """Spawns `failing` workers that fail every call, then healthy ones (`FakeWorker`)."""

    def __init__(self, failing: int) -> None:
        self.failing, self.spawned, self.killed = failing, [], []

    def spawn(self, config: ServeConfig, index: int) -> Any:
        worker = FakeWorker(index)
        worker.dead = len(self.spawned) < self.failing
        worker.run = self._fail if worker.dead else worker.run
        self.spawned.append(worker)
        return worker.handle()

    @staticmethod
    def _fail(*_: Any) -> StepResult:
        raise RuntimeError(DEVICE_ERROR + "\n  (a second line of the worker's traceback)")

    def kill(self, handle: Any) -> None:
        self.killed.append(handle)

    def is_death(self, err: BaseException) -> bool:
        return False


async def turn(p: dict) -> None:
    """Every live worker's loop turn, as `Dispatcher.run` takes it (`before_decide`, decide,
    call); then a replacement may start."""
    for w in p["fleet"].alive():
        p["recovery"].note_served(w)
        decision = p["dispatch"].decide(w)
        if not decision.is_empty():
            await p["dispatch"].execute(w, decision)
    await asyncio.sleep(0)


async def drive(p: dict, rids: list[str], max_turns: int = 400) -> None:
    """Loop turns until the requests end or the table fails."""
    table = p["table"]
    for _ in range(max_turns):
        if table.fatal or all(table.requests[r].state.is_done for r in rids):
            return
        await turn(p)
    raise AssertionError("requests neither finished nor failed")


def crash_loop(failing: int) -> dict:
    """One worker that served a call, then fails; `failing` replacements fail every call."""
    async def scenario() -> dict:
        config = ServeConfig(workers=1, scheduler=SchedulerConfig(max_worker_failures=3))
        first = FakeWorker(0)
        p = parts(config, [first])
        actors = FailingActors(failing)
        stopped = []
        p["recovery"] = p["dispatch"].recovery = Recovery(config, p["table"], p["fleet"], p["counters"],
                                                          on_added=lambda s: None, actors=actors,
                                                          on_stopped=lambda: stopped.append(True))
        early = p["table"].submit([1, 2, 3], {"max_new_tokens": 12}, LIMITS)
        await turn(p)  # worker 0 serves a call
        first.run = FailingActors._fail  # ... and fails from then on
        reqs = [early] + [p["table"].submit([1, 2, i], {"max_new_tokens": 12}, LIMITS) for i in range(4, 8)]
        await drive(p, [r.request_id for r in reqs])
        waits = await asyncio.gather(*[p["table"].wait(r.request_id, 5) for r in reqs], return_exceptions=True)
        return dict(p=p, actors=actors, reqs=reqs, waits=waits, stopped=stopped)

    return asyncio.run(scenario())


def test_a_worker_that_fails_every_call_stops_the_scheduler_after_three_failures_in_a_row() -> None:
    out = crash_loop(failing=2)
    p, line = out["p"], f"worker failed 3 times in a row (RuntimeError: {DEVICE_ERROR}); the scheduler stopped"
    assert p["table"].fatal == line  # one line, the worker's own error (not its traceback)
    assert all(isinstance(e, RuntimeError) and str(e) == line for e in out["waits"]), out["waits"]
    with pytest.raises(RuntimeError, match=r"^worker failed 3 times in a row \(RuntimeError: Expected all"):
        p["table"].submit([1, 2], {"max_new_tokens": 2}, LIMITS)  # a new request: the same line
    assert p["counters"].worker_failures == 3 and p["counters"].workers_replaced == 2
    assert len(out["actors"].spawned) == 2 and out["stopped"] == [True]  # no third replacement
    assert not p["fleet"].alive() and p["recovery"].closing
    assert not any(w.alive for w in p["fleet"].slots)


def test_control_one_failure_fewer_and_the_next_replacement_serves_everything() -> None:
    out = crash_loop(failing=1)
    p = out["p"]
    assert p["table"].fatal is None and out["stopped"] == []
    for r, record in zip(out["reqs"], out["waits"]):
        assert record["token_ids"] == expected(r.request_id, 12)
    assert p["counters"].worker_failures == 2 and p["counters"].workers_replaced == 2
    assert p["fleet"].slots[-1].failures == 0  # it served: its inherited streak ended


def test_a_worker_that_served_in_between_starts_a_new_streak() -> None:
    """Failures separated by successful calls are not a loop: each replacement that served
    a call starts from zero (with max_worker_failures 2, four failures, none stops it)."""
    async def scenario() -> None:
        config = ServeConfig(workers=1, scheduler=SchedulerConfig(max_worker_failures=2))
        p = parts(config, [FakeWorker(0)])
        actors = FailingActors(failing=0)
        p["recovery"] = p["dispatch"].recovery = Recovery(config, p["table"], p["fleet"], p["counters"],
                                                          on_added=lambda s: None, actors=actors)
        for round_ in range(4):
            req = p["table"].submit([1, 2, round_], {"max_new_tokens": 40}, LIMITS)
            while not p["fleet"].alive():  # the last round's replacement
                await asyncio.sleep(0)
            await turn(p)  # it served a call
            w = p["fleet"].alive()[0]
            p["recovery"].note_served(w)
            p["recovery"].on_worker_failure(w, RuntimeError("one bad call"))
            await drive(p, [req.request_id])
            assert req.output_ids == expected(req.request_id, 40)
        assert p["table"].fatal is None and p["counters"].worker_failures == 4

    asyncio.run(scenario())


def test_one_line_names_the_workers_own_error() -> None:
    class TaskError(RuntimeError):  # shaped like Ray's RayTaskError: a traceback, and the cause
        cause = ValueError("bad shape\nmore detail")

    assert one_line(TaskError("ray::Worker.step() (pid=1)\n  File x\nValueError: bad shape")) == "ValueError: bad shape"
    assert one_line(RuntimeError("\x1b[31mred\x1b[0m\nsecond")) == "RuntimeError: red"
    assert one_line(KeyError()) == "KeyError"
    assert len(one_line(RuntimeError("x" * 1000))) == 240


# ---------------------------------------------------------------------------- a handled error is read


@pytest.mark.parametrize("read", [True, False], ids=["read", "control-unread"])
def test_a_failed_retraction_reads_its_snapshot_ref_so_nothing_logs_it_as_unhandled(read: bool, caplog) -> None:
    """A retraction that fails (here its worker is gone) is handled: the request is recomputed.
    Its snapshot ref holds the same error; the ledger reads it, so nothing reports the error as
    never retrieved when the ref goes (Ray's "Unhandled error", asyncio's "Future exception was
    never retrieved": the fake worker's refs are asyncio futures). The control: with that read
    taken out, asyncio logs the error."""
    import gc

    from tests.test_scheduler_parts import failing_retraction

    async def scenario() -> None:
        p, w, req, snap, call = failing_retraction()
        calls = [call]
        sizes = await asyncio.gather(calls[0][1], return_exceptions=True)
        if not read:
            p["fleet"].forget = lambda ref: None
        p["ledger"].on_sizes(w, snap, calls, sizes)
        await asyncio.sleep(0.01)
        assert req.recompute and req.snapshot_ref is None
        calls.clear()
        gc.collect()

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(scenario())
        gc.collect()
    unread = [r for r in caplog.records if "exception was never retrieved" in r.getMessage()]
    assert bool(unread) == (not read), [r.getMessage() for r in caplog.records]


# ---------------------------------------------------------------------------- the "too long" error


POOL = Limits(vocab_size=100, max_context=1024, largest_pool_tokens=160)


def refusal(prompt_len: int, max_new: int, limits: Limits = POOL) -> str | None:
    try:
        validate_request([1] * prompt_len, SamplingParams(max_new_tokens=max_new), limits)
    except RequestError as err:
        return str(err)
    return None


@pytest.mark.parametrize("prompt_len, max_new", [(10, 150), (10, 151), (159, 1), (160, 1), (981, 16), (100, 60),
                                                 (100, 61)])
def test_a_pool_refusal_adds_up_to_what_the_planner_asks(prompt_len: int, max_new: int) -> None:
    """The reference: a request fits when prompt + max_new_tokens <= the pool (the most an
    admission or a resume asks of a worker, whatever the steps); the message's numbers add up,
    and it names the prompt alone when even one new token does not fit."""
    message = refusal(prompt_len, max_new)
    fits = prompt_len + max_new <= POOL.largest_pool_tokens
    assert (message is None) == fits, message
    if fits:
        return
    if prompt_len >= POOL.largest_pool_tokens:
        assert message == (f"prompt: {prompt_len} tokens leave no room for a generated token in the largest "
                           "worker pool (160 KV tokens); it could never finish")
    else:
        assert message == (f"prompt ({prompt_len}) + max_new_tokens ({max_new}) = {prompt_len + max_new} tokens, "
                           f"more than the largest worker pool (160 KV tokens); at most {160 - prompt_len} "
                           "new tokens fit after this prompt")
        assert refusal(prompt_len, 160 - prompt_len) is None  # the limit it names is accepted


def test_a_request_at_the_pools_edge_is_admitted_by_the_planner() -> None:
    """What validation accepts the planner can place: prompt + max_new_tokens == the pool, with
    fewer new tokens than a call's steps (the planner asks prompt + min(steps, max_new)).
    The control: one token more is refused at submit."""
    from collections import deque

    from raysched.scheduler.planner import WorkerView, plan_step
    from raysched.request import Request

    assert refusal(158, 2) is None and refusal(158, 3) is not None
    r = Request("edge", tuple([1] * 158), SamplingParams(max_new_tokens=2))
    p = plan_step(WorkerView(0, 160, 4, 160, 4, 1), deque([r]), deque(), SchedulerConfig(), -1.0)
    assert p.admit == [r]


def test_the_context_refusal_names_the_prompt_when_it_alone_is_too_long() -> None:
    assert refusal(1024, 1, dataclasses.replace(POOL, largest_pool_tokens=4096)) == \
        "prompt: 1024 tokens leave no room for a generated token in the model context of 1024 tokens"
    assert refusal(1000, 30, dataclasses.replace(POOL, largest_pool_tokens=4096)) == \
        "prompt (1000) + max_new_tokens (30) = 1030 exceeds the model context of 1024 tokens"


def test_http_param_is_prompt_when_the_prompt_alone_is_too_long_else_the_max_tokens_field() -> None:
    alone = request_error(RequestError(refusal(981, 16)), "max_tokens")
    both = request_error(RequestError(refusal(100, 61)), "max_completion_tokens")
    assert (alone.status, alone.param) == (400, "prompt") and alone.message.startswith("prompt: 981 tokens")
    assert both.param == "max_completion_tokens" and both.message.startswith(
        "prompt (100) + max_completion_tokens (61) = 161 tokens")
    assert request_error(RequestError("prompt: must not be empty")).param == "prompt"


# ---------------------------------------------------------------------------- Ray, end to end


SIM_CONFIG = {"data_plane": "sim", "workers": 1, "pool": {"kv_tokens": 512, "state_slots": 8},
              "sim": {"decode_ms": 1.0, "vocab_size": 512, "max_context": 4096}, "object_store_memory": 80 << 20}


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    import sys

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, object_store_memory=80 << 20, include_dashboard=False,
             logging_level="WARNING")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # what runs in the scheduler
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()


def in_scheduler(client: Any, fn: Any, timeout_s: float = 60) -> Any:
    """Run `fn(scheduler)` on the scheduler actor's event loop (test-only, via `__ray_call__`).
    (`tests.test_cluster_serving.in_scheduler` as well, but defined here: this module is pickled
    by value, and the classes its `fn`s build find their globals only through functions pickled
    with them.)"""
    def call(sched: Any) -> Any:
        async def run() -> Any:
            out = fn(sched)
            return await out if asyncio.iscoroutine(out) else out

        loop = sched.workers[0].task.get_loop()
        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout_s)

    return ray.get(client.scheduler.__ray_call__.remote(call), timeout=timeout_s)


async def kill_worker_0(sched: Any) -> None:
    """Kill simulated worker 0 (`raysched.workers.kill_worker`'s way), and wait until it is dead:
    every later call of it fails."""
    h = sched.workers[0].handle
    await h.host.kill.remote(h.index)


def gated_spawns() -> Any:
    """An `ActorOps` (installed in the scheduler) whose workers start as usual but report ready
    (`info`) only once `gate` is set: the time a replacement takes to start, held open."""
    from raysched.scheduler.recovery import ActorOps

    class Gated:
        def __init__(self, gate: asyncio.Event, info: Any) -> None:
            self.gate, self.info = gate, info

        def remote(self) -> Any:
            async def ready() -> Any:
                await self.gate.wait()
                return await self.info.remote()
            return ready()

    class Ops(ActorOps):
        gate = asyncio.Event()

        def spawn(self, config: Any, index: int) -> Any:
            handle = super().spawn(config, index)
            handle.info = Gated(self.gate, handle.info)  # (a simulated worker's handle takes it)
            return handle

    return Ops()


def test_requests_submitted_while_the_only_worker_is_replaced_wait_for_it(local_ray) -> None:
    """One simulated worker, killed; while its replacement starts (held open), 40 requests are
    submitted with no worker alive: all are accepted, and end with the reference tokens (a run
    alone on a fresh worker). The kill really happened: one failure, one replacement, and every
    request ran on the replacement."""
    import raysched
    from tests.conftest import wait_until
    from tests.test_sim import run_alone

    client = raysched.launch(SIM_CONFIG)
    try:
        in_scheduler(client, lambda s: setattr(s.recovery, "actors", gated_spawns()))
        in_scheduler(client, kill_worker_0)
        handles = [client.submit([5, 17, 0], {"max_new_tokens": 8}, request_id="r0")]  # its call finds it dead
        wait_until(lambda: client.stats()["worker_failures"] == 1, 60, "the scheduler to retire the killed worker")
        assert client.stats()["workers_alive"] == 0
        handles += [client.submit([5, 17, i], {"max_new_tokens": 8}, request_id=f"r{i}") for i in range(1, 41)]
        assert client.stats()["workers_alive"] == 0  # all of them came while no worker was alive
        in_scheduler(client, lambda s: s.recovery.actors.gate.set())
        records = [h.result(timeout=120) for h in handles]
        stats = client.stats()
    finally:
        client.shutdown()
    for i, r in enumerate(records):
        assert r["token_ids"] == run_alone(f"r{i}", [5, 17, i], 8), r
        assert r["workers"] == [1] or r["workers"] == [0, 1], r
    assert stats["worker_failures"] == 1 and stats["workers_replaced"] == 1


def broken_spawns(count: int, info: Any) -> Any:
    """An `ActorOps` (installed in the scheduler) whose first `count` spawns are actors that start
    but fail every call with DEVICE_ERROR, as a worker with a device bug does; then real workers."""
    from raysched.scheduler.recovery import ActorOps

    @ray.remote(num_cpus=0)
    class BrokenWorker:
        def info(self) -> Any:
            return info

        def is_idle(self) -> bool:
            return True

        def step(self, *_: Any) -> Any:
            raise RuntimeError(DEVICE_ERROR)

        def step_stream(self, *_: Any) -> Any:
            raise RuntimeError(DEVICE_ERROR)
            yield  # (a generator, as the real one)

        def interrupt(self, *_: Any) -> None:
            pass

    class Ops(ActorOps):
        left = count

        def spawn(self, config: Any, index: int) -> Any:
            if self.left <= 0:
                return super().spawn(config, index)
            self.left -= 1
            return BrokenWorker.remote()

    return Ops()


@pytest.mark.parametrize("broken", [2, 1], ids=["crash-loop-stops", "control-one-failure-fewer-serves"])
def test_a_crash_loop_fails_every_request_with_one_line_and_leaves_no_worker(local_ray, broken: int) -> None:
    """The only worker dies, and each of its `broken` replacements fails every call. With 2, that
    is 3 failures in a row: `result()` of the request that was waiting, and of a new one, raise the
    one line, and no worker is left. The control, 1: the second replacement serves the request
    with the reference tokens."""
    import raysched
    from tests.conftest import alive_actors, wait_until
    from tests.test_sim import run_alone

    client = raysched.launch(SIM_CONFIG)
    try:
        in_scheduler(client, lambda s: setattr(s.recovery, "actors", broken_spawns(broken, s.workers[0].info)))
        in_scheduler(client, kill_worker_0)
        handle = client.submit([5, 17, 42], {"max_new_tokens": 6}, request_id="r")
        if broken == 1:
            assert handle.result(timeout=120)["token_ids"] == run_alone("r", [5, 17, 42], 6)
            assert client.stats()["worker_failures"] == 2
            return
        line = f"worker failed 3 times in a row (RuntimeError: {DEVICE_ERROR}); the scheduler stopped"
        with pytest.raises(RuntimeError, match="worker failed 3 times") as info:
            handle.result(timeout=120)
        assert line in str(info.value)
        with pytest.raises(RuntimeError, match="worker failed 3 times") as info:
            client.submit([1, 2, 3], {"max_new_tokens": 2}).result(timeout=30)
        assert line in str(info.value)
        stats = client.stats()
        assert (stats["worker_failures"], stats["workers_replaced"], stats["workers_alive"]) == (3, 2, 0)
        wait_until(lambda: not alive_actors("SimHost", "BrokenWorker"), 60, "every worker actor to end")
    finally:
        client.shutdown()
