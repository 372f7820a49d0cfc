"""Each part of `raysched.scheduler`, built directly, without Ray (fake worker handles).

The fake worker below follows step plans the way a real one does for the bookkeeping that
matters here (KV tokens and state slots held per request, one token per decode step, finishing
at max_new_tokens), and emits token = (hash of request id + position) so a test can tell
whether tokens arrived once, in order, for the right request.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from collections import deque
from typing import Any

import pytest

from raysched.config import FaultSpec, MigrationConfig, SchedulerConfig, ServeConfig
from raysched.messages import SNAPSHOT_LOST, FaultPoint, StepPlan, StepResult, StepTokens, Usage, WorkerInfo
from raysched.request import Request, State
from raysched.sampling import RequestError, SamplingParams
from raysched.scheduler.dispatch import Dispatcher
from raysched.scheduler.faults import FaultSeam
from raysched.scheduler.fleet import Fleet
from raysched.scheduler.joins import OpenCall
from raysched.scheduler.migration import Abandoned, Migrator
from raysched.scheduler.planner import Decision, WorkerView, decode_need
from raysched.scheduler.recovery import Recovery
from raysched.scheduler.retraction import RetractionLedger
from raysched.scheduler.prefix_cache import PrefixCache
from raysched.scheduler.state_cache import BlockRef, Place, StateCache
from raysched.scheduler.table import Limits, RequestTable, validate_generated
from raysched.stats import Counters

VOCAB = 100
LIMITS = Limits(vocab_size=VOCAB, max_context=4096, largest_pool_tokens=256)


def token(rid: str, position: int) -> int:
    return sum(map(ord, rid)) * 31 + position * 7 % VOCAB


# ---------------------------------------------------------------------------- fakes


class Call:
    """A fake remote method: `.remote(...)` runs the method now and returns an awaitable."""

    def __init__(self, fn: Any, num_returns: int = 1) -> None:
        self.fn, self.num_returns = fn, num_returns

    def options(self, num_returns: int | str = 1) -> Call:
        return Call(self.fn, num_returns)

    def remote(self, *args: Any) -> Any:
        if self.num_returns == "streaming":
            return _stream(self.fn(*args))
        try:
            out = self.fn(*args)
        except BaseException as err:  # the call fails: each return raises
            out = tuple(err for _ in range(self.num_returns)) if self.num_returns > 1 else err
        if self.num_returns > 1:
            return [_ready(o) for o in out]
        return _ready(out)


async def _stream(pieces: Any) -> Any:
    """A fake streaming generator: a ready future per piece; a failure is the last one."""
    try:
        for piece in pieces:
            yield _ready(piece)
    except Exception as err:
        yield _ready(err)


def _ready(value: Any) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)
    return fut


class FakeWorker:
    """Pools of `kv` tokens and `slots` state slots; follows step plans (see the module doc)."""

    def __init__(self, index: int, kv: int = 256, slots: int = 4, node: str | None = None) -> None:
        self.index, self.kv, self.slots = index, kv, slots
        self.node = node or f"node-{index}"
        self.held: dict[str, list] = {}  # id -> [token_ids, max_new, prompt_len]
        self.snapshots: dict[str, list] = {}
        self.calls: list[StepPlan] = []
        self.interrupts: list[int] = []
        self.joins: list[tuple[int, list[str]]] = []  # (call id, request ids) sent by `Worker.join`
        self.dead = False
        self.die_after_pieces: int | None = None  # a streamed call fails after this many pieces

    def handle(self) -> Any:
        return type("Handle", (), {name: Call(getattr(self, name)) for name in
                                   ("info", "step", "step_stream", "retract_pending", "take_parked", "is_idle",
                                    "interrupt", "join")})()

    def interrupt(self, call_id: int) -> None:
        """Recorded only: a fake call runs to its end when it is sent."""
        self.interrupts.append(call_id)

    def join(self, call_id: int, items: list) -> None:
        """Recorded only, as `interrupt`."""
        self.joins.append((call_id, [item.request_id for item in items]))

    def usage(self) -> Usage:
        used = sum(len(h[0]) - 1 for h in self.held.values())
        return Usage(self.kv - used, self.kv, self.slots - len(self.held), self.slots, 1)

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.index, self.node, "cpu", "fake", VOCAB, 4096, self.usage(), 8, 64)

    def is_idle(self) -> bool:
        return not self.held

    def retract_pending(self, rid: str, fault: FaultPoint | None = None) -> tuple[Any, int]:
        if self.dead:
            raise RuntimeError("dead")
        tokens, max_new, prompt_len = self.held.pop(rid)
        return ("snap", rid, list(tokens), max_new, prompt_len, fault), 8 * len(tokens)

    def take_parked(self, keys: list) -> Any:
        return tuple(keys) if len(keys) > 1 else keys[0]

    def step_stream(self, plan: StepPlan, *snapshots: Any) -> Any:
        """`step`, its tokens sent one position at a time ahead of its result (with
        `die_after_pieces`, the call fails after sending that many)."""
        result = self.run(plan, *snapshots)
        for k in range(max(map(len, result.new_tokens.values()), default=0)):
            if k == self.die_after_pieces:
                self.dead = True
                raise RuntimeError("worker died mid-call")
            yield StepTokens({rid: toks[k:k + 1] for rid, toks in result.new_tokens.items() if len(toks) > k})
        if self.die_after_pieces is not None:
            self.dead = True
            raise RuntimeError("worker died at the end of its call")
        yield result

    def step(self, plan: StepPlan, *snapshots: Any) -> StepResult:
        result = self.run(plan, *snapshots)
        if self.die_after_pieces is not None:  # one reply per call: nothing was sent
            self.dead = True
            raise RuntimeError("worker died mid-call")
        return result

    def run(self, plan: StepPlan, *snapshots: Any) -> StepResult:
        if self.dead:
            raise RuntimeError("worker died")
        self.calls.append(plan)
        result = StepResult()
        for rid in plan.drop:
            self.held.pop(rid, None)
        for rid, snap in zip(plan.resume, snapshots):
            fut = snap[0]  # a nested ref, read by the worker itself (here: a finished future)
            if fut.exception() is not None:
                result.resume_failed[rid] = f"{SNAPSHOT_LOST}: {fut.exception()!r}"
                continue
            _, _, tokens, max_new, prompt_len, _ = fut.result()
            self.held[rid] = [list(tokens), max_new, prompt_len]  # the snapshot stays as it was
        for item in plan.prefill:
            max_new = SamplingParams.from_dict(item.sampling).max_new_tokens
            tokens = list(item.token_ids)
            generated = len(tokens) - item.prompt_len
            self.held[item.request_id] = [tokens, max_new, item.prompt_len]
            tok = token(item.request_id, generated)
            tokens.append(tok)
            result.new_tokens.setdefault(item.request_id, []).append(tok)
        for _ in range(plan.decode_steps):
            for rid, (tokens, max_new, prompt_len) in list(self.held.items()):
                if len(tokens) - prompt_len >= max_new:
                    continue  # done: it leaves at the end of the call
                tok = token(rid, len(tokens) - prompt_len)
                tokens.append(tok)
                result.new_tokens.setdefault(rid, []).append(tok)
        for rid, (tokens, max_new, prompt_len) in list(self.held.items()):
            if max_new is not None and len(tokens) - prompt_len >= max_new:
                result.finished[rid] = "length"
                del self.held[rid]
        result.usage = self.usage()
        result.allocated = {rid: len(h[0]) - 1 for rid, h in self.held.items()}
        return result


def parts(config: ServeConfig, workers: list[FakeWorker], kills: list | None = None) -> dict:
    """Every part wired as `Scheduler.__init__` wires them, over fake workers (no loops run)."""
    counters = Counters()
    table = RequestTable(counters)
    fleet = Fleet()
    faults = FaultSeam(config.faults, kill=(kills.append if kills is not None else lambda h: None),
                       exit_process=lambda: None)
    ledger = RetractionLedger(config.scheduler, table, fleet, counters, faults)
    ledger.budget_bytes = 1 << 30
    cache = PrefixCache(None, table, counters)
    recovery = Recovery(config, table, fleet, counters, on_added=lambda slot: None, actors=FakeActors(None))
    dispatch = Dispatcher(config, table, fleet, counters, ledger, cache, recovery, faults)
    for w in workers:
        fleet.add(w.handle(), w.info())
    return dict(counters=counters, table=table, fleet=fleet, faults=faults, ledger=ledger, cache=cache,
                recovery=recovery, dispatch=dispatch)


async def run_until_done(p: dict, rids: list[str], max_calls: int = 500) -> None:
    """Drive every worker's decide -> execute until the requests end (a loop without tasks)."""
    table, dispatch = p["table"], p["dispatch"]
    for _ in range(max_calls):
        if all(table.requests[r].state.is_done for r in rids):
            return
        for w in p["fleet"].alive():
            decision = dispatch.decide(w)
            if not decision.is_empty():
                await dispatch.execute(w, decision)
    raise AssertionError("requests did not finish")


def expected(rid: str, max_new: int) -> list[int]:
    return [token(rid, i) for i in range(max_new)]


# ---------------------------------------------------------------------------- table


def test_reading_a_request_as_it_comes_marks_it_streamed() -> None:
    """`next_tokens` (a streaming reader) marks its request, so its worker's next calls stream
    each decode step's tokens. Control: a request nobody reads that way stays unmarked."""
    async def scenario() -> None:
        table = RequestTable(Counters())
        a, b = (table.submit([1, 2], {"max_new_tokens": 4}, LIMITS) for _ in range(2))
        a.output_ids, b.output_ids = [5], [5]
        assert not a.streaming and not b.streaming
        assert await table.next_tokens(a.request_id, 0) == ([5], False)
        assert a.streaming and not b.streaming

    asyncio.run(scenario())


def test_table_validates_and_queues_in_priority_order() -> None:
    table = RequestTable(Counters())
    a = table.submit([1, 2], {"max_new_tokens": 4}, LIMITS)
    b = table.submit([1, 2], {"max_new_tokens": 4}, LIMITS, priority=-1)
    assert [r.request_id for r in table.waiting] == [b.request_id, a.request_id]
    with pytest.raises(RequestError, match="already in use"):
        table.submit([1], {}, LIMITS, request_id=a.request_id)
    with pytest.raises(RequestError, match="more than the largest worker pool"):
        table.submit([1] * 200, {"max_new_tokens": 100}, LIMITS)
    with pytest.raises(RequestError):
        table.submit([VOCAB], {}, LIMITS)  # not a token id
    assert table.counters.submitted == 2


def test_table_wait_and_stream_read_one_record_then_forget_it() -> None:
    async def scenario() -> None:
        table = RequestTable(Counters())
        req = table.submit([1, 2], {"max_new_tokens": 2}, LIMITS)
        reader = asyncio.ensure_future(table.next_tokens(req.request_id, 0))
        await asyncio.sleep(0)
        req.state = State.RUNNING
        req.add_tokens([5], 0.0)
        table.notify(req.request_id)
        assert await reader == ([5], False)
        table.finish(req, State.FINISHED, "length")
        record = await table.wait(req.request_id)
        assert record["token_ids"] == [5] and record["state"] == "finished"
        assert req.request_id not in table.requests  # forgotten, still readable:
        assert await table.next_tokens(req.request_id, 1) == ([], True)

    asyncio.run(scenario())


def test_a_resubmission_that_already_has_its_last_token_ends_at_once() -> None:
    """A streaming client can receive a request's last token and lose the scheduler before it
    reads the end (CI saw it). Resubmitted with every token, the request ends with the reason its
    last token gives, instead of being refused; one a token short resumes. The control: more
    tokens than the budget are still refused."""
    async def scenario() -> None:
        table = RequestTable(Counters())
        cases = {"length": ([7, 8, 9], {}), "stop": ([7, 3], {"stop_token_ids": [3]}), None: ([7, 8], {})}
        for reason, (generated, extra) in cases.items():
            req = table.submit([1, 2], {"max_new_tokens": 3, **extra}, LIMITS)
            validate_generated(generated, req.sampling, VOCAB)
            table.continue_from(req, generated)
            if reason is None:
                assert req.state is State.RETRACTED and list(table.retracted) == [req]
                continue
            assert req.state is State.FINISHED and req not in table.retracted  # (else `wait` would block)
            record = await asyncio.wait_for(table.wait(req.request_id), 5)
            assert (record["state"], record["finish_reason"], record["token_ids"]) == ("finished", reason, generated)
        with pytest.raises(RequestError, match="more than max_new_tokens"):
            validate_generated([7, 8, 9, 10], SamplingParams(max_new_tokens=3), VOCAB)

    asyncio.run(scenario())


def test_table_abort_takes_a_waiting_request_off_its_queue_and_fail_wakes_every_reader() -> None:
    async def scenario() -> None:
        table = RequestTable(Counters())
        a = table.submit([1], {}, LIMITS)
        b = table.submit([2], {}, LIMITS)
        assert table.abort(a.request_id) is a and table.abort(a.request_id) is None
        assert list(table.waiting) == [b] and a.state is State.ABORTED
        reader = asyncio.ensure_future(table.wait(b.request_id))
        await asyncio.sleep(0)
        table.fail("every worker has failed")
        with pytest.raises(RuntimeError, match="every worker has failed"):
            await reader

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- fleet


def test_fleet_knows_nodes_and_room() -> None:
    fleet = Fleet()
    w0, w1 = FakeWorker(0, node="n"), FakeWorker(1, kv=512, node="n")
    s0, s1 = fleet.add(None, w0.info()), fleet.add(None, w1.info())
    assert not fleet.multi_node() and fleet.largest_pool_tokens() == 512
    r = Request("r", (1,), SamplingParams())
    r.workers = [0]
    assert not fleet.cross_node(r, s1)
    s1.info = FakeWorker(1, node="m").info()
    assert fleet.multi_node() and fleet.cross_node(r, s1)
    s1.alive = False
    assert fleet.others(s0) == [] and fleet.largest_pool_tokens() == 256


def test_workers_with_different_matrix_kernels_are_named_in_one_warning(caplog) -> None:
    """A worker whose matrix kernel differs from the others' (a node without a C compiler runs
    MKL where the others run rowdot) is warned about once per mix: a request moved between them
    would not continue bit for bit. Control: the same kernel everywhere, or a retired odd one
    out, warns of nothing."""
    import dataclasses
    import logging

    fleet = Fleet()
    infos = [dataclasses.replace(FakeWorker(i).info(), kernel=k)
             for i, k in enumerate(("rowdot avx2+fma", "rowdot avx2+fma", "mkl 930887e8e594"))]
    slots = [fleet.add(None, info) for info in infos[:2]]
    recovery = Recovery(ServeConfig(), RequestTable(Counters()), fleet, Counters(), on_added=lambda s: None)
    with caplog.at_level(logging.WARNING, logger="raysched.scheduler"):
        recovery.warn_mixed_kernels()
        assert fleet.mixed_kernels() == [] and not caplog.records  # control: one kernel
        slots.append(fleet.add(None, infos[2]))
        recovery.warn_mixed_kernels()
        recovery.warn_mixed_kernels()  # the same mix again: no second line
    assert fleet.mixed_kernels() == ["mkl 930887e8e594", "rowdot avx2+fma"]
    assert [r.getMessage() for r in caplog.records] == [
        "workers compute with different matrix kernels (mkl 930887e8e594, rowdot avx2+fma): a request "
        "that moves between them continues up to rounding (its logits may differ in the last bits), "
        "not bit for bit"]
    slots[2].alive = False
    assert fleet.mixed_kernels() == []  # control: the odd one out retired


def test_a_draining_or_retired_worker_never_looks_roomiest() -> None:
    """Admission compares a worker's room with the best elsewhere: a drained worker (it admits
    nothing) or a removed one must not count, or every other worker holds back its admissions
    while the drain runs. Control: the same worker, taking work again, counts with its room."""
    fleet = Fleet()
    s0, s1 = fleet.add(None, FakeWorker(0, kv=256).info()), fleet.add(None, FakeWorker(1, kv=512).info())
    roomy = fleet.best_room_except(s0)
    assert roomy == s1.view.room() > 0
    fleet.set_draining(s1, True)
    assert fleet.best_room_except(s0) == -1.0
    fleet.set_draining(s1, False)
    assert fleet.best_room_except(s0) == roomy  # control
    s1.alive = False
    fleet.note_room(s1)  # what Recovery.retire and on_worker_failure do
    assert fleet.best_room_except(s0) == -1.0


# ---------------------------------------------------------------------------- dispatcher


def test_a_draining_workers_room_does_not_hold_new_requests_back_elsewhere() -> None:
    """While worker 1 drains (empty, so the roomiest), a busy worker 0 still admits new
    requests: the draining worker takes none, so its room is nobody's (issue 18: they used to
    wait until worker 0 was empty too)."""
    async def scenario() -> None:
        p = parts(ServeConfig(workers=2), [FakeWorker(0), FakeWorker(1)])
        w0, w1 = p["fleet"].slots
        p["fleet"].set_draining(w1, True)
        first = p["table"].submit([1, 2, 3], {"max_new_tokens": 50}, LIMITS)
        await p["dispatch"].execute(w0, p["dispatch"].decide(w0))
        assert w0.view.room() < w1.view.room()
        second = p["table"].submit([4, 5, 6], {"max_new_tokens": 4}, LIMITS)
        assert p["dispatch"].decide(w1).admit == []
        assert p["dispatch"].decide(w0).admit == [second] and first.state.name == "RUNNING"
        p["fleet"].set_draining(w1, False)
        assert p["fleet"].best_room_except(w0) == w1.view.room()

    asyncio.run(scenario())


def successors(counters, fold: bool) -> int:
    """Successor calls the dispatcher planned without a decision: folded into their call
    (`fold_successor`) or pipelined as a second call; the other kind must be 0."""
    made, other = ((counters.folded_calls, counters.pipelined_calls) if fold
                   else (counters.pipelined_calls, counters.folded_calls))
    assert other == 0, (counters.folded_calls, counters.pipelined_calls)
    return made


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "pipelined"])
def test_dispatcher_runs_requests_to_the_end_with_the_right_tokens(fold: bool) -> None:
    async def scenario() -> None:
        config = ServeConfig(workers=2, scheduler=SchedulerConfig(decode_steps_per_call=4, fold_successor=fold))
        p = parts(config, [FakeWorker(0), FakeWorker(1)])
        reqs = [p["table"].submit([1, 2, i + 3], {"max_new_tokens": 9}, LIMITS) for i in range(6)]
        await run_until_done(p, [r.request_id for r in reqs])
        for r in reqs:
            assert r.output_ids == expected(r.request_id, 9) and r.finish_reason == "length"
        assert successors(p["counters"], fold) > 0  # nothing waiting at the end: successors planned

    asyncio.run(scenario())


def fold_scenario(fold: bool, fold_calls: int = 2, waiting: int = 0, max_new: int = 40, ends: bool = False,
                  kv: int = 256) -> list:
    """The decode steps of each call after one request's admission (1 worker, 3 steps a call),
    with `waiting` more requests queued that cannot start (no free slot)."""
    async def scenario() -> list[int]:
        config = ServeConfig(workers=1, scheduler=SchedulerConfig(decode_steps_per_call=3, fold_successor=fold,
                                                                  fold_calls=fold_calls, max_batch_size=1))
        worker = FakeWorker(0, kv=kv, slots=1)
        p = parts(config, [worker])
        req = p["table"].submit([1, 2, 3], {"max_new_tokens": max_new}, LIMITS)
        w = p["fleet"].slots[0]
        await p["dispatch"].execute(w, p["dispatch"].decide(w))  # the admission: no successor
        for i in range(waiting):
            p["table"].submit([9, 9, i], {"max_new_tokens": 4}, LIMITS)
        await p["dispatch"].execute(w, p["dispatch"].decide(w))
        assert req.output_ids == expected(req.request_id, len(req.output_ids))
        return [(plan.decode_steps, plan.end_at_finish) if ends else plan.decode_steps for plan in worker.calls[1:]]

    return asyncio.run(scenario())


def test_a_folded_call_runs_its_successors_steps_in_one_call() -> None:
    """With nothing waiting and room for twice the steps, one call carries both calls' decode
    steps (and no second call is sent); control: `fold_successor: false` sends the same steps
    as two calls, the second before the first returned."""
    assert fold_scenario(True) == [6]
    assert fold_scenario(False) == [3, 3]


def test_a_long_call_folds_up_to_fold_calls_and_ends_at_a_finish() -> None:
    """`fold_calls: 8`: one call runs 8 calls' steps (24), and ends after the step in which a
    request finishes (`end_at_finish`), also while a request waits (the call ends where the
    running request's slot frees). The room bounds it: a pool that holds 4 calls' steps more
    gets 4. Controls: `fold_calls: 2` folds one successor and sets no end; with a request
    waiting and the running one ending inside the next call, nothing is folded."""
    assert fold_scenario(True, fold_calls=8, ends=True) == [(24, True)]
    assert fold_scenario(True, fold_calls=8, waiting=1, max_new=30, ends=True) == [(24, True)]
    assert fold_scenario(True, fold_calls=8, kv=4 + 4 + 12, ends=True) == [(12, True)]
    assert fold_scenario(True, fold_calls=2, waiting=1, max_new=30, ends=True) == [(6, False)]
    assert fold_scenario(True, fold_calls=8, waiting=1, max_new=6) == [3]


def test_the_fold_factor_is_the_most_calls_whose_steps_fit() -> None:
    """`fold_factor` bisects; the reference is a scan from 2 up, over random running requests
    and room. The control: an empty pool still folds 2 (as without room checks)."""
    rng = random.Random(3)
    p = parts(ServeConfig(workers=1, scheduler=SchedulerConfig(fold_calls=8)), [FakeWorker(0, kv=4096)])
    w = p["fleet"].slots[0]
    for _ in range(300):
        w.view.running = [Request(f"r{i}", tuple(range(1, rng.randint(2, 40))), SamplingParams(max_new_tokens=rng.randint(1, 60)))
                          for i in range(rng.randint(0, 6))]
        w.view.free_tokens, steps = rng.randint(0, 600), rng.randint(1, 8)
        scan = 2
        while scan < 8 and decode_need(w.view, w.view.running, (scan + 1) * steps) <= w.view.free_tokens:
            scan += 1
        assert p["dispatch"].fold_factor(w, steps) == scan
    w.view.running, w.view.free_tokens = [Request("r", (1, 2), SamplingParams(max_new_tokens=40))], 0
    assert p["dispatch"].fold_factor(w, 4) == 2


def test_no_call_is_folded_while_a_prompt_on_the_worker_waits_to_be_fed() -> None:
    """A worker prefills only at a call's start: folding a call while a request there is still
    prefilling would leave it unfed for the whole long call. With an unfed request (or a prompt
    longer than a chunk, no token yet) `fold` declines; the control, the same worker once the
    prompt has its token, folds up to `fold_calls`."""
    p = parts(ServeConfig(workers=1, scheduler=SchedulerConfig(fold_calls=8)), [FakeWorker(0, kv=4096)])
    w = p["fleet"].slots[0]
    decoding = Request("a", (1, 2, 3), SamplingParams(max_new_tokens=200))
    decoding.output_ids = [5]
    long = Request("b", tuple(range(1, 1201)), SamplingParams(max_new_tokens=200))
    w.view.running, w.view.free_tokens = [decoding, long], 4000
    w.view.prefilling = {"b": 1200}
    assert p["dispatch"].fold(w, Decision(decode_steps=1)) == 0
    w.view.prefilling, w.view.unfed = {"b": 300}, {"b"}
    assert p["dispatch"].fold(w, Decision(decode_steps=1)) == 0
    long.output_ids, w.view.prefilling, w.view.unfed = [5], {}, set()
    assert p["dispatch"].fold(w, Decision(decode_steps=1)) == 8


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "pipelined"])
def test_forced_retraction_keeps_successors_on_and_loses_no_token(fold: bool) -> None:
    """Before the split, `force_retract_every` switched pipelining off, so the fault tests that
    force retractions never exercised a pipelined call (nor, now, a folded one)."""
    async def scenario() -> None:
        config = ServeConfig(workers=2, scheduler=SchedulerConfig(decode_steps_per_call=2, force_retract_every=1,
                                                                  fold_successor=fold))
        p = parts(config, [FakeWorker(0), FakeWorker(1)])
        reqs = [p["table"].submit([1, 2, i + 3], {"max_new_tokens": 24}, LIMITS) for i in range(3)]
        await run_until_done(p, [r.request_id for r in reqs])
        for r in reqs:
            assert r.output_ids == expected(r.request_id, 24)
        assert p["counters"].retractions > 0 and successors(p["counters"], fold) > 0
        assert sum(r.retractions for r in reqs) == p["counters"].retractions

    asyncio.run(scenario())


def test_a_failed_call_hands_its_requests_to_recovery_and_they_finish_elsewhere() -> None:
    async def scenario() -> None:
        config = ServeConfig(workers=2, scheduler=SchedulerConfig(replace_failed_workers=False))
        workers = [FakeWorker(0), FakeWorker(1)]
        p = parts(config, workers)
        reqs = [p["table"].submit([1, 2, i + 3], {"max_new_tokens": 12}, LIMITS) for i in range(4)]
        w0 = p["fleet"].slots[0]
        await p["dispatch"].execute(w0, p["dispatch"].decide(w0))  # prefill + decode on worker 0
        workers[0].dead = True
        await run_until_done(p, [r.request_id for r in reqs])
        for r in reqs:
            assert r.output_ids == expected(r.request_id, 12)
        assert p["counters"].worker_failures == 1 and not w0.alive

    asyncio.run(scenario())


@pytest.mark.parametrize("stream_each_step, reader", [(True, True), (False, True), (True, False)],
                         ids=["streamed", "control-one-reply-per-call", "control-nobody-streams-it"])
def test_each_decode_steps_tokens_reach_the_client_as_that_step_completes(stream_each_step: bool, reader: bool) -> None:
    """With `stream_each_step`, a streamed request's call of 4 decode steps delivers its tokens
    one step at a time (what a streaming client sees: one token per chunk, the first right after
    its prefill). The controls deliver a call's 5 tokens (prefill + 4 steps) at once: one reply
    per call, and a request nobody streams (a message per step would cost the scheduler for
    nothing)."""
    async def scenario() -> list[int]:
        config = ServeConfig(scheduler=SchedulerConfig(decode_steps_per_call=4, stream_each_step=stream_each_step))
        p = parts(config, [FakeWorker(0)])
        req = p["table"].submit([1, 2, 3], {"max_new_tokens": 9}, LIMITS)
        req.streaming = reader  # (`Scheduler.submit(stream=True)`, or a first `next_tokens`)
        seen, notify = [], p["table"].notify
        p["table"].notify = lambda rid: (seen.append(len(req.output_ids)), notify(rid))
        await run_until_done(p, [req.request_id])
        assert req.output_ids == expected(req.request_id, 9)
        return [b - a for a, b in zip([0] + seen, seen) if b > a]

    arrivals = asyncio.run(scenario())
    assert arrivals == ([1] * 9 if stream_each_step and reader else [5, 4])


@pytest.mark.parametrize("stream_each_step", [True, False], ids=["streamed", "control-one-reply-per-call"])
def test_a_call_that_dies_after_streaming_tokens_repeats_none_of_them(stream_each_step: bool) -> None:
    """A request resumed from a snapshot streams 2 tokens, then its worker dies: the snapshot
    is older than the tokens the client has, so the request is recomputed from its history
    (resuming from the snapshot would send those 2 tokens again). The control: a call that
    dies before sending any token keeps the snapshot and resumes from it."""
    async def scenario() -> None:
        sched = SchedulerConfig(decode_steps_per_call=4, replace_failed_workers=False, stream_each_step=stream_each_step)
        workers = [FakeWorker(0), FakeWorker(1)]
        p = parts(ServeConfig(workers=2, scheduler=sched), workers)
        w0, w1 = p["fleet"].slots
        req = p["table"].submit([1, 2, 3], {"max_new_tokens": 12}, LIMITS)
        req.streaming = True  # a client reads it as it comes
        await p["dispatch"].execute(w0, p["dispatch"].decide(w0))  # prefill + 4 steps: 5 tokens
        snap, _ = workers[0].retract_pending(req.request_id)  # retracted with a snapshot
        w0.view.running.remove(req)
        req.state, req.snapshot_ref, req.recompute = State.RETRACTED, _ready(snap), False
        p["table"].retracted.append(req)
        workers[1].die_after_pieces = 2
        await p["dispatch"].execute(w1, p["dispatch"].decide(w1))  # resumes it, dies mid-call
        assert not w1.alive and req.state is State.RETRACTED
        assert len(req.output_ids) == (7 if stream_each_step else 5)
        assert req.recompute is stream_each_step and (req.snapshot_ref is None) is stream_each_step
        await run_until_done(p, [req.request_id])
        assert req.output_ids == expected(req.request_id, 12)

    asyncio.run(scenario())


@pytest.mark.parametrize("targeted", [True, False], ids=["targeted", "control-no-target"])
def test_a_recompute_migration_waits_for_its_destination_and_the_fleet_goes_on_admitting(targeted: bool) -> None:
    """`migrate(mode="recompute")` to worker 2 queues the request for worker 2 alone
    (`Request.target_worker`): worker 1 admits new work meanwhile but does not take it, and no
    worker is marked draining (the recompute baseline once marked every other worker draining,
    which held back admissions fleet-wide and ended a real drain when it finished). The control:
    a request queued without a target is taken by the first worker that decides."""
    async def scenario() -> None:
        workers = [FakeWorker(i) for i in range(3)]
        p = parts(ServeConfig(workers=3), workers)
        w0, w1, w2 = p["fleet"].slots
        req = p["table"].submit([1, 2, 3], {"max_new_tokens": 12}, LIMITS)
        await p["dispatch"].execute(w0, p["dispatch"].decide(w0))
        mig = Migrator(MigrationConfig(), p["table"], p["fleet"], p["counters"], p["recovery"], p["faults"], p["ledger"])

        async def stop(r: Request, recompute: bool = False) -> str:  # what the source's loop does
            w0.view.running.remove(r)
            workers[0].held.pop(r.request_id)
            r.state, r.recompute, r.snapshot_ref = State.RETRACTED, True, None
            p["table"].retracted.append(r)
            return "snapshot"

        mig.retract_by_snapshot = stop
        if targeted:
            moving = asyncio.create_task(mig.migrate(req.request_id, worker=2, mode="recompute"))
        else:
            await stop(req)
        while req.state is not State.RETRACTED:
            await asyncio.sleep(0)
        other = p["table"].submit([4, 5, 6], {"max_new_tokens": 4}, LIMITS)
        d1 = p["dispatch"].decide(w1)
        assert not any(w.draining for w in p["fleet"].slots) and d1.admit == [other]
        assert d1.resume == ([] if targeted else [req])
        if targeted:
            d2 = p["dispatch"].decide(w2)
            assert d2.resume == [req] and list(p["table"].retracted) == []
            await p["dispatch"].execute(w2, d2)
            out = await moving
            assert out["mode"] == "recompute" and req.workers[-1] == 2 and req.target_worker is None
        await p["dispatch"].execute(w1, d1)
        await run_until_done(p, [req.request_id, other.request_id])
        assert req.output_ids == expected(req.request_id, 12)

    asyncio.run(scenario())


def test_a_retraction_by_snapshot_interrupts_the_long_call_of_its_worker() -> None:
    """A drain's or a recompute move's stop-and-copy (`Migrator.retract_by_snapshot`) is sent by
    the source's loop between two of its calls, so a long call there is interrupted at once (else
    the request waits for up to `fold_calls` calls' steps), and the Final is queued for that
    worker. Control: a worker in no long call gets no interrupt, its Final is queued alike."""
    async def scenario() -> None:
        workers = [FakeWorker(0), FakeWorker(1)]
        p = parts(ServeConfig(workers=2), workers)
        w0, w1 = p["fleet"].slots
        mig = Migrator(MigrationConfig(), p["table"], p["fleet"], p["counters"], p["recovery"], p["faults"], p["ledger"])
        reqs = [running_request(p, w) for w in (w0, w1)]
        p["fleet"].start_long_call(w0, 11)
        tasks = [asyncio.create_task(mig.retract_by_snapshot(r)) for r in reqs]
        await asyncio.sleep(0)
        assert workers[0].interrupts == [11] and workers[1].interrupts == []
        assert not p["fleet"].long_calls and p["fleet"].interrupts == 1
        assert {i: [f.req for f in finals] for i, finals in mig.finals.items()} == {0: reqs[:1], 1: reqs[1:]}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert mig.moving == {}

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- retraction ledger


def running_request(p: dict, w: Any, generated: int = 3) -> Request:
    req = p["table"].submit([1, 2, 3], {"max_new_tokens": 8}, LIMITS)
    p["table"].waiting.remove(req)
    p["dispatch"].mark_running(w, [req])
    req.output_ids = [7] * generated
    return req


def test_ledger_falls_back_to_recompute_past_the_snapshot_budget() -> None:
    p = parts(ServeConfig(), [FakeWorker(0)])
    w = p["fleet"].slots[0]
    a, b = running_request(p, w), running_request(p, w)
    p["ledger"].budget_bytes = 8 * a.num_cached + 64  # room for exactly one snapshot
    snap, drop = p["ledger"].take_victims(w, Decision(victims=[a, b]))
    assert snap == [a] and drop == [b.request_id]
    assert (a.recompute, b.recompute) == (False, True) and p["counters"].store_pressure_fallbacks == 1
    assert p["ledger"].held_bytes() == 8 * a.num_cached + 64  # a's estimate is in flight
    assert list(p["table"].retracted) == [b]  # a is queued once its retract call is sent


def failing_retraction() -> tuple[dict, Any, Request, list[Request], tuple]:
    """A request chosen as a snapshot victim on a worker that is gone by the time its retract
    call is sent: (parts, worker slot, request, snapshot victims, the retract call)."""
    workers = [FakeWorker(0)]
    p = parts(ServeConfig(), workers)
    w = p["fleet"].slots[0]
    req = running_request(p, w)
    workers[0].held[req.request_id] = [list(req.token_ids), 8, 3]
    snap, _ = p["ledger"].take_victims(w, Decision(victims=[req]))
    workers[0].dead = True  # the retract call fails
    return p, w, req, snap, p["ledger"].send(w, req)


def test_ledger_send_queues_the_pending_snapshot_and_a_failed_retraction_recomputes() -> None:
    async def scenario() -> None:
        p, w, req, snap, call = failing_retraction()
        assert list(p["table"].retracted) == [req] and req.snapshot_ref is call[0]
        sizes = await asyncio.gather(call[1], return_exceptions=True)
        p["ledger"].on_sizes(w, snap, [call], sizes)
        assert req.recompute and req.snapshot_ref is None and p["ledger"].held_bytes() == 0
        for fut in call[:2]:
            fut.exception()  # retrieved

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- recovery


class FakeActors:
    def __init__(self, worker: FakeWorker | None) -> None:
        self.worker, self.killed = worker, []

    def spawn(self, config: ServeConfig, index: int) -> Any:
        if self.worker is None:
            return type("H", (), {"info": Call(lambda: (_ for _ in ()).throw(RuntimeError("no room")))})()
        self.worker.index = index
        return self.worker.handle()

    def kill(self, handle: Any) -> None:
        self.killed.append(handle)

    def is_death(self, err: BaseException) -> bool:
        return False


class Died(Exception):
    """A worker's death, as `DeathActors.is_death` tells it."""


class DeathActors(FakeActors):
    def is_death(self, err: BaseException) -> bool:
        return isinstance(err, Died)


@pytest.mark.parametrize("failed", ["source", "destination"])
def test_a_migration_call_failing_after_recovery_already_moved_the_request_says_recovered(failed: str) -> None:
    """The source dies in a pre-copy stage, and its dispatch loop sees the death first: recovery
    requeues the request and it is resumed on another worker before the migration's own call
    fails. The migration once answered "stayed" (the request was RUNNING again); the source's
    death recovers it, so it says "recovered". Control: the destination failing its call leaves
    the request where it runs ("stayed")."""
    async def scenario() -> dict:
        workers = [FakeWorker(i) for i in range(3)]
        p = parts(ServeConfig(workers=3), workers)
        p["recovery"].actors = DeathActors(None)
        w0, w1, w2 = p["fleet"].slots
        mig = Migrator(MigrationConfig(), p["table"], p["fleet"], p["counters"], p["recovery"], p["faults"], p["ledger"])
        req = running_request(p, w0)
        out = {"from": 0, "to": 1, "mode": "stayed"}
        if failed == "source":  # the dispatch loop's recovery ran first, and w2 resumed it
            p["recovery"].on_worker_failure(w0, Died("source"))
            assert req.state is State.RETRACTED
            p["table"].retracted.remove(req)
            p["dispatch"].mark_running(w2, [req])
        dead = w0 if failed == "source" else w1
        failing = asyncio.get_running_loop().create_future()
        failing.set_exception(Died(failed))
        with pytest.raises(Abandoned):
            await mig._call(dead, failing, req, out)
        assert req.state is State.RUNNING
        return out

    out = asyncio.run(scenario())
    assert out["mode"] == ("recovered" if failed == "source" else "stayed")


def test_workers_started_at_once_never_share_a_spawn_index() -> None:
    """Two workers started at once (a replacement and `add_worker`, or two scale-ups) once got
    the same provisional index, which on a simulated host is the key of the worker it runs: the
    second replaced the first. Each spawn now gets an index never used before."""
    async def scenario() -> list[int]:
        config = ServeConfig(workers=2)
        p = parts(config, [FakeWorker(0), FakeWorker(1)])
        spawned: list[int] = []

        class Recording(FakeActors):
            def spawn(self, config: ServeConfig, index: int) -> Any:
                spawned.append(index)
                return FakeWorker(index).handle()

        recovery = Recovery(config, p["table"], p["fleet"], p["counters"], on_added=lambda s: None,
                            actors=Recording(None))
        slots = await asyncio.gather(recovery.start_worker(), recovery.start_worker(), recovery.start_worker())
        assert sorted(s.index for s in slots) == [2, 3, 4]  # the fleet's own slot numbers
        return spawned

    spawned = asyncio.run(scenario())
    assert len(set(spawned)) == 3 and min(spawned) >= 2  # none shared, none of the first workers'


def test_recovery_requeues_what_a_failed_worker_held_and_replaces_it() -> None:
    async def scenario() -> None:
        config = ServeConfig(workers=1)
        p = parts(config, [FakeWorker(0)])
        actors = FakeActors(FakeWorker(9))
        recovery = Recovery(config, p["table"], p["fleet"], p["counters"], on_added=lambda s: None, actors=actors)
        w = p["fleet"].slots[0]
        fresh, started = running_request(p, w, generated=0), running_request(p, w, generated=3)
        recovery.on_worker_failure(w, RuntimeError("boom"))
        assert not w.alive and actors.killed == [w.handle]  # a failed call: killed, its state unknown
        assert list(p["table"].waiting) == [fresh] and fresh.workers == []
        assert list(p["table"].retracted) == [started] and started.recompute
        assert p["table"].fatal is None  # a replacement is on its way
        await asyncio.sleep(0.01)
        assert len(p["fleet"].alive()) == 1 and p["counters"].workers_replaced == 1

    asyncio.run(scenario())


def test_recovery_fails_the_table_when_no_worker_is_left() -> None:
    async def scenario() -> None:
        config = ServeConfig(workers=1)
        p = parts(config, [FakeWorker(0)])
        recovery = Recovery(config, p["table"], p["fleet"], p["counters"], on_added=lambda s: None,
                            actors=FakeActors(None))
        recovery.on_worker_failure(p["fleet"].slots[0], RuntimeError("boom"))
        await asyncio.sleep(0.01)
        assert p["table"].fatal == "every worker has failed and none could be replaced"

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- prefix-reuse glue


def test_prefix_glue_finds_prefixes_counts_hits_and_drops_unusable_states() -> None:
    counters = Counters()
    table = RequestTable(counters)
    cache = StateCache(budget_bytes=1 << 20, min_tokens=2)
    glue = PrefixCache(cache, table, counters)
    cache.park((1, 2, 3), "ref", 100, "finished")
    hit = table.submit([1, 2, 3, 4], {}, LIMITS)
    miss = table.submit([5, 6, 7], {}, LIMITS)
    hits, back = glue.admit([hit, miss], worker=0)
    assert [(r, m.num_tokens, m.refs) for r, m in hits] == [(hit, 3, ["ref"])] and back == []
    w = parts(ServeConfig(), [FakeWorker(0)])["fleet"].slots[0]
    glue.on_result(w, Decision(admit=[hit, miss]), StepResult(cached={hit.request_id: 3}))
    assert (hit.cached_tokens, hit.cache_kind, counters.state_cache_hits, counters.state_cache_misses) == \
        (3, "finished", 1, 1)
    again = table.submit([1, 2, 3, 9], {}, LIMITS)
    glue.admit([again], worker=0)
    glue.on_result(w, Decision(admit=[again]), StepResult(prefix_failed={again.request_id: "refused"}))
    assert len(cache) == 0 and counters.state_cache_fallbacks == 1
    assert PrefixCache(None, table, counters).admit([hit], worker=0) == ([], [])


def _shared_prefix_requests(p: dict, n: int, shared: int = 64) -> list:
    return [p["table"].submit([t % 80 + 1 for t in range(shared)] + [90 + i] * (10 + i), {"max_new_tokens": 2}, LIMITS)
            for i in range(n)]


def test_placement_sends_a_request_to_the_worker_holding_its_match_when_loads_are_close() -> None:
    """Worker 1 holds the point; both workers are idle: worker 0 (asked first) leaves the request
    to worker 1. With worker 1 much fuller than worker 0 (beyond the slack), worker 0 takes it;
    so it does while worker 1 is being drained (before, the request waited for the drain's end)."""
    p = parts(ServeConfig(), [FakeWorker(0), FakeWorker(1)])
    index = StateCache(budget_bytes=1 << 20, min_tokens=2, block_tokens=32)
    p["cache"] = p["dispatch"].cache = PrefixCache(index, p["table"], p["counters"], slack=0.25)
    index.park(tuple(t % 80 + 1 for t in range(64)), "pt", 10, "chunk", kv_from=64, exact=True,
               blocks={0: BlockRef("b0", 100), 1: BlockRef("b1", 100)}, place=Place("node-1", 1))
    w0, w1 = p["fleet"].slots
    r = _shared_prefix_requests(p, 1)[0]
    assert p["dispatch"].decide(w0).admit == []  # left to worker 1, where its state lies
    assert p["dispatch"].decide(w1).admit == [r]
    s = _shared_prefix_requests(p, 1)[0]
    w1.view.free_slots = 1  # worker 1: a quarter of its slots free, worker 0: all of them
    assert p["dispatch"].decide(w1).admit == [] and p["dispatch"].decide(w0).admit == [s]
    w1.view.free_slots = 4
    p["fleet"].set_draining(w1, True)  # its home is being drained: worker 0 takes it at once
    t = _shared_prefix_requests(p, 1)[0]
    assert p["dispatch"].decide(w0).admit == [t]


def test_a_request_waiting_for_its_home_worker_does_not_hold_back_the_ones_behind_it() -> None:
    """Two groups' points: A's on worker 1, B's on worker 0; the queue alternates A, B, A. Worker
    0 passes the A requests over (worker 1, as roomy, takes them) and admits B's; worker 1 admits
    both A's. Controls: a less urgent request never passes a more urgent one; a request blocked
    for another reason (no home, and this worker is not the roomiest) still stops the scan."""
    p = parts(ServeConfig(), [FakeWorker(0, kv=1024, slots=8), FakeWorker(1, kv=1024, slots=8)])
    index = StateCache(budget_bytes=1 << 20, min_tokens=2, block_tokens=32)
    p["cache"] = p["dispatch"].cache = PrefixCache(index, p["table"], p["counters"], slack=0.25)
    a, b = [t % 80 + 1 for t in range(64)], [79 - t % 70 for t in range(64)]
    for prefix, worker in ((a, 1), (b, 0)):
        index.park(tuple(prefix), f"pt{worker}", 10, "chunk", kv_from=64, exact=True,
                   blocks={0: BlockRef(f"b0-{worker}", 100), 1: BlockRef(f"b1-{worker}", 100)},
                   place=Place(f"node-{worker}", worker))
    submit = lambda prefix, i, priority=0: p["table"].submit(prefix + [90 + i] * 3, {"max_new_tokens": 2},  # noqa: E731
                                                             LIMITS, priority=priority)
    a1, b1, a2 = submit(a, 1), submit(b, 2), submit(a, 3)
    w0, w1 = p["fleet"].slots
    assert p["dispatch"].decide(w0).admit == [b1]  # passes a1 over, and a2 after b1
    assert list(p["table"].waiting) == [a1, a2]
    assert p["dispatch"].decide(w1).admit == [a1, a2]
    a3, b2 = submit(a, 4), submit(b, 5, priority=1)
    assert p["dispatch"].decide(w0).admit == []  # b2 is less urgent than a3: it waits behind it
    assert p["dispatch"].decide(w1).admit == [a3]
    assert p["dispatch"].decide(w0).admit == [b2]
    c, d = submit([50] * 40, 6), submit(b, 7)  # c: no match, no home
    w0.view.free_slots = 2  # worker 0 is not the roomiest: c is worker 1's, and d waits behind it
    p["fleet"].note_room(w0)
    assert p["dispatch"].decide(w0).admit == []
    assert p["dispatch"].decide(w1).admit == [c, d]  # (d's home is beyond the slack fuller)


def test_long_prompts_with_no_match_go_where_the_fewest_blocks_wait_to_be_prefilled() -> None:
    """A burst of four long prompts (three whole blocks each, nothing parked) on two equally
    roomy workers: a worker takes one while it has fewer blocks still to prefill than the
    other, and on a tie goes by room: 1, 2, 1 (2:2; by room alone, worker 0, deciding first,
    takes all four and prefills them one after another while worker 1 idles). Controls: a
    burst of short prompts (no whole block) still goes by room, all to the worker deciding
    first; a worker with no room, or one being drained, is not one to leave a long prompt to."""
    p = parts(ServeConfig(), [FakeWorker(0, kv=4096, slots=8), FakeWorker(1, kv=4096, slots=8)])
    index = StateCache(budget_bytes=1 << 20, min_tokens=2, block_tokens=32)
    p["cache"] = p["dispatch"].cache = PrefixCache(index, p["table"], p["counters"])
    w0, w1 = p["fleet"].slots

    def start(w) -> list:
        decision = p["dispatch"].decide(w)
        p["cache"].admit(decision.admit, w.index)  # long prompts become their blocks' producers
        p["dispatch"].mark_running(w, decision.admit)
        return decision.admit

    submit = lambda g, n: p["table"].submit([(g * 13 + t) % 97 + 1 for t in range(n)],  # noqa: E731
                                            {"max_new_tokens": 2}, LIMITS)
    heads = [submit(g, 96) for g in range(4)]
    assert [start(w0), start(w1), start(w0)] == [heads[:1], heads[1:3], heads[3:]]
    heads[1].add_tokens([5], 0.0)  # its prefill is over: worker 1 has fewer blocks waiting
    short = [submit(g, 24) for g in range(4, 8)]
    assert start(w0) == short  # no whole block: by room (a tie), as without reuse
    late = submit(9, 96)
    w1.view.free_slots = 0  # worker 1 has no room: worker 0 takes it
    p["fleet"].note_room(w1)
    assert start(w0) == [late]
    w1.view.free_slots = 8
    p["fleet"].set_draining(w1, True)  # nor is a worker being drained (it takes nothing new)
    drained = submit(10, 96)
    assert start(w0) == [drained]


def test_requests_sharing_blocks_with_one_being_prefilled_wait_for_its_points() -> None:
    """Three requests share two whole blocks, none parked yet: the first admitted is their
    producer; the other two go back to the queue (and stay held back) until its points exist."""
    p = parts(ServeConfig(), [FakeWorker(0, kv=1024)])
    index = StateCache(budget_bytes=1 << 20, min_tokens=2, block_tokens=32)
    p["dispatch"].cache = PrefixCache(index, p["table"], p["counters"])
    reqs = _shared_prefix_requests(p, 3)
    w = p["fleet"].slots[0]
    decision = p["dispatch"].decide(w)
    assert decision.admit == reqs  # the planner admits all three ...
    hits, back = p["dispatch"].cache.admit(decision.admit, w.index)
    assert hits == [] and back == reqs[1:]  # ... the glue keeps the producer and puts back the others
    for r in reqs[1:]:
        p["table"].waiting.append(r)
    p["dispatch"].mark_running(w, reqs[:1])
    assert p["dispatch"].decide(w).admit == []  # held back while the producer prefills
    index.park(tuple(t % 80 + 1 for t in range(64)), "pt", 10, "chunk", kv_from=64, exact=True,
               blocks={0: BlockRef("b0", 100), 1: BlockRef("b1", 100)})
    assert p["dispatch"].decide(w).admit == reqs[1:]  # its points exist: they restore them


# ---------------------------------------------------------------------------- fault seam


def test_fault_seam_kills_between_calls_and_marks_the_next_snapshot() -> None:
    faults = (FaultSpec("kill_worker", 0, 2), FaultSpec("corrupt_snapshot", 1, 0),
              FaultSpec("kill_in_step", 1, 3, after_decode_steps=1))
    killed: list = []
    p = parts(ServeConfig(faults=faults), [FakeWorker(0), FakeWorker(1)], kills=killed)
    seam, (w0, w1) = p["faults"], p["fleet"].slots
    seam.before_call(w0, p["fleet"])
    assert killed == []  # not due before call 2
    w0.view.calls = 2
    seam.before_call(w0, p["fleet"])
    assert killed == [w0.handle]
    seam.before_call(w1, p["fleet"])
    assert seam.retract_point(w1, "r") == FaultPoint("corrupt_snapshot")
    assert seam.retract_point(w1, "r") is None  # once
    assert seam.step_point(w1, 2, 4, None) is None
    assert seam.step_point(w1, 3, 4, None) == FaultPoint("kill_in_step", 1)
    assert [f["kind"] for f in seam.fired] == ["kill_worker", "corrupt_snapshot", "kill_in_step"]


def test_without_faults_the_seam_answers_nothing() -> None:
    p = parts(ServeConfig(), [FakeWorker(0)])
    w = p["fleet"].slots[0]
    for calls in range(20):
        w.view.calls = calls
        p["faults"].before_call(w, p["fleet"])
        assert p["faults"].step_point(w, calls, 4, True) is None and p["faults"].retract_point(w, "r") is None


def test_data_plane_worker_has_no_fault_code_and_the_faulty_class_adds_it() -> None:
    import inspect

    from actors.faults import FaultHooks, needs_faults, with_faults
    from actors.worker import Worker

    source = inspect.getsource(Worker)
    for word in ("_exit", "corrupt", "drop_state", "die_at"):
        assert word not in source, word
    faulty = with_faults(Worker)
    assert issubclass(faulty, FaultHooks) and issubclass(faulty, Worker) and with_faults(Worker) is faulty
    assert not needs_faults(ServeConfig())
    assert needs_faults(ServeConfig(scheduler=SchedulerConfig(debug_drop_state=True)))
    assert needs_faults(ServeConfig(faults=(FaultSpec("kill_worker", 0, 1),)))


def test_queues_are_plain_deques() -> None:
    table = RequestTable(Counters())
    assert isinstance(table.waiting, deque) and isinstance(table.retracted, deque)


def test_former_module_paths_import_the_moved_modules() -> None:
    import importlib

    import raysched.scheduler.heap
    import raysched.scheduler.planner
    import raysched.scheduler.state_cache

    assert importlib.import_module("raysched.planner") is raysched.scheduler.planner
    assert importlib.import_module("raysched.state_cache") is raysched.scheduler.state_cache
    assert importlib.import_module("raysched.allocator") is raysched.scheduler.heap
    from raysched.planner import Plan
    assert Plan is Decision


def test_a_waiting_request_interrupts_the_long_call_of_a_worker_that_could_start_it() -> None:
    """A request arrives while both workers are in long calls: the one with a free slot is
    interrupted (its call id), once; the full one is not. Controls: nothing waiting interrupts
    nothing; an urgent request with no free slot anywhere interrupts the worker running the
    least urgent request (its next decision may preempt it), and one no more urgent does not."""
    async def scenario() -> None:
        config = ServeConfig(workers=2, scheduler=SchedulerConfig(interrupt_after_ms=0))
        p = parts(config, [FakeWorker(0), FakeWorker(1)])
        fleet, table = p["fleet"], p["table"]
        w0, w1 = fleet.slots
        fakes = [w.handle.interrupt.fn.__self__ for w in (w0, w1)]
        w1.view.free_slots = 0
        fleet.start_long_call(w0, 7)
        fleet.start_long_call(w1, 9)
        fleet.notify()
        assert [f.interrupts for f in fakes] == [[], []]  # nothing waits
        table.submit([1, 2, 3], {"max_new_tokens": 4}, LIMITS)
        fleet.notify()
        fleet.notify()
        assert [f.interrupts for f in fakes] == [[7], []] and fleet.interrupts == 1
        assert w0.long_call == 0 and list(fleet.long_calls) == [1]

        w0.view.free_slots = 0  # now no room anywhere: only preemption could start it
        fleet.start_long_call(w0, 8)
        w0.view.running.append(table.submit([4], {"max_new_tokens": 4}, LIMITS, priority=0))
        w1.view.running.append(table.submit([5], {"max_new_tokens": 4}, LIMITS, priority=3))
        for r in w0.view.running + w1.view.running:
            table.waiting.remove(r)
        fleet.notify()  # the waiting request (priority 0) outranks worker 1's (3), not worker 0's
        assert [f.interrupts for f in fakes] == [[7], [9]]
        fleet.notify()
        assert fleet.interrupts == 2 and list(fleet.long_calls) == [0]

    asyncio.run(scenario())


def test_a_request_interrupts_long_calls_only_after_interrupt_after_ms() -> None:
    """`interrupt_after_ms: 400`: a request that arrives while every worker (1 free slot each) is
    in a long call interrupts none at once; still waiting 400 ms later, one; a second arrival
    200 ms after it gets its own round 400 ms after it. A call that ends meanwhile and starts
    the first (here: it leaves the queue) spares its interrupt. Control: `interrupt_after_ms: 0`
    interrupts at each arrival. (Checked 100 ms from each due time.)"""
    async def scenario(after_ms: float, taken: bool = False) -> list[int]:
        config = ServeConfig(workers=3, scheduler=SchedulerConfig(interrupt_after_ms=after_ms))
        fakes = [FakeWorker(i, slots=1) for i in range(3)]
        p = parts(config, fakes)
        fleet, table = p["fleet"], p["table"]
        for i, w in enumerate(fleet.slots):
            fleet.start_long_call(w, 10 + i)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        count = lambda: sum(len(f.interrupts) for f in fakes)  # noqa: E731
        first = table.submit([1], {"max_new_tokens": 4}, LIMITS)
        fleet.notify()
        seen = [count()]
        await asyncio.sleep(t0 + 0.2 - loop.time())
        table.submit([2], {"max_new_tokens": 4}, LIMITS)
        fleet.notify()
        seen.append(count())
        if taken:
            table.waiting.remove(first)
        for at in (0.5, 0.7):
            await asyncio.sleep(t0 + at - loop.time())
            seen.append(count())
        return seen

    assert asyncio.run(scenario(400.0)) == [0, 0, 1, 2]
    assert asyncio.run(scenario(400.0, taken=True)) == [0, 0, 0, 1]
    assert asyncio.run(scenario(0.0)) == [1, 2, 2, 2]


def test_an_open_call_keeps_its_own_requests_room_and_takes_the_head_of_the_queue_that_fits() -> None:
    """`OpenCall.of`: a long call's room for joins is the pools its worker reported, less what its
    own requests need for all of its steps (page-rounded; one it starts holds nothing yet and
    takes a slot). `take` hands out that room first come, first served: it stops at the first
    request that does not fit, even when a later one would. The reference is worked out by hand
    below. Under `admission: reserve` every request's room is its whole budget, as the planner
    keeps it. Controls: a cap of 0 takes nothing; `settle` names only what the reply lists nowhere."""
    def req(rid: str, prompt: int, max_new: int) -> Request:
        return Request(rid, tuple(range(1, prompt + 1)), SamplingParams(max_new_tokens=max_new))

    running, starting = req("run", 10, 100), req("new", 4, 8)
    view = WorkerView(0, free_tokens=200, free_slots=3, total_tokens=256, total_slots=4, page_size=8,
                      running=[running, starting], allocated={"run": 16})
    call = OpenCall.of(view, call_id=5, steps=24)
    # run: 10 + 24 tokens = 5 pages (40), holds 16 -> 24 more; new: 4 + 8 = 2 pages (16), and a slot
    assert (call.free_tokens, call.free_slots) == (200 - 24 - 16, 2)
    queue = [req("a", 100, 200), req("b", 60, 200), req("c", 2, 2)]  # need 128, 88, 8 tokens
    assert call.take(queue, 8, cap=0) == []
    assert [r.request_id for r in call.take(queue, 8, cap=4)] == ["a"]  # b does not fit: c waits too
    assert (call.free_tokens, call.free_slots) == (160 - 128, 1)
    assert [r.request_id for r in call.take(queue[2:], 8, cap=4)] == ["c"]
    assert call.free_slots == 0 and call.take([req("d", 1, 1)], 8, cap=4) == []
    assert call.settle(joined=["a"], not_admitted=[]) == ["c"]
    assert call.settle(joined=["a"], not_admitted=["c"]) == []
    reserve = OpenCall.of(view, call_id=5, steps=24, reserve=True)  # `admission: reserve`: whole budgets
    # run: 10 + 100 tokens = 14 pages (112), holds 16 -> 96 more; new: 16 as above
    assert reserve.free_tokens == 200 - 96 - 16 and reserve.take(queue, 8, cap=4) == []  # a needs 300
    assert [r.request_id for r in reserve.take(queue[2:], 8, cap=4)] == ["c"]


@pytest.mark.parametrize("join", [True, False], ids=["joins", "control-interrupts"])
def test_a_waiting_request_joins_a_long_call_with_room_instead_of_interrupting_it(join: bool) -> None:
    """`join_long_calls`: a request that waited `join_after_ms` (0) while both workers are in long
    calls that take joins goes into the roomier call (`Worker.join` with that call's id) and runs
    there from then on; nothing is interrupted. A streamed request skips the roomier call, which
    does not stream, for the one that does. The replies settle them: one listed as joined is its
    call's admission; one in neither list (it came after the call's decoding ended) is queued
    again at the head. Control: `join_long_calls: false` interrupts the roomier call instead."""
    async def scenario() -> None:
        config = ServeConfig(workers=2, scheduler=SchedulerConfig(interrupt_after_ms=0, join_after_ms=0,
                                                                  join_long_calls=join))
        fakes = [FakeWorker(0), FakeWorker(1)]
        p = parts(config, fakes)
        fleet, table, dispatch, counters = p["fleet"], p["table"], p["dispatch"], p["counters"]
        w0, w1 = fleet.slots
        w1.view.free_slots = 1
        for w, call_id, streams in ((w0, 7, False), (w1, 9, True)):
            fleet.start_long_call(w, call_id)
            w.open_call = OpenCall.of(w.view, call_id, 24, streams)
        plain = table.submit([1, 2, 3], {"max_new_tokens": 4}, LIMITS)
        streamed = table.submit([4, 5], {"max_new_tokens": 4}, LIMITS)
        streamed.streaming = True
        fleet.notify()
        if not join:
            assert fakes[0].interrupts == [7] and fakes[0].joins == fakes[1].joins == []
            assert plain.state is State.WAITING and counters.joins == 0
            return
        assert fakes[0].joins == [(7, [plain.request_id])] and fakes[1].joins == [(9, [streamed.request_id])]
        assert fakes[0].interrupts == fakes[1].interrupts == [] and not table.waiting
        assert (plain.worker, streamed.worker) == (0, 1) and plain in w0.view.running
        assert w0.view.free_slots == 3 and counters.joins == 2
        decision, result = Decision(), StepResult(joined=[plain.request_id])
        dispatch.settle_joins(w0, decision, result)
        assert decision.admit == [plain] and result.not_admitted == [] and w0.open_call is None
        late = StepResult()
        dispatch.settle_joins(w1, Decision(), late)
        dispatch.put_back(w1, late)
        assert late.not_admitted == [streamed.request_id] and counters.joins_late == 1
        assert list(table.waiting) == [streamed] and streamed not in w1.view.running

    asyncio.run(scenario())


def test_the_scheduler_process_collects_less_often_and_records_each_pause():
    """`tune_gc` (the scheduler actor's process) freezes what exists and raises the young
    generation's threshold; `GcPauses` records every collection with its generation. Run in a
    fresh interpreter, so this test's process keeps Python's defaults. Control: before
    `tune_gc`, nothing is frozen and the threshold is Python's own."""
    code = ("import gc; from raysched.scheduler.heap import GcPauses, tune_gc, GC_YOUNG_THRESHOLD;"
            "before = (gc.get_freeze_count(), gc.get_threshold()[0]);"
            "p = GcPauses(); tune_gc(); gc.collect(); gc.collect(1);"
            "s = p.summary(); p.close(); gc.collect();"
            "print(before[0], before[1] != GC_YOUNG_THRESHOLD, gc.get_freeze_count() > 1000,"
            " gc.get_threshold()[0] == GC_YOUNG_THRESHOLD, s['collections'][2] >= 1, s['collections'][1] >= 1,"
            " s['pause_max_s'] > 0, p.summary()['collections'] == s['collections'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("RAY")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0"] + ["True"] * 7, out.stdout


def test_a_reader_is_one_entry_whatever_handle_each_of_its_requests_carries() -> None:
    """Each request brings its own handle to its reader's sink (deserialized apart: other
    objects, one actor id). The reader watch pings each reader once and, when it died, aborts
    every request it reads: grouping or matching by handle identity aborted only one of them.
    Control: a second reader is its own entry and keeps its request."""
    table = RequestTable(Counters())
    handle = lambda actor: type("Handle", (), {"_actor_id": actor})()  # noqa: E731
    reqs = [table.submit([1, 2], {"max_new_tokens": 2}, LIMITS) for _ in range(3)]
    for req, actor in zip(reqs, ("a", "a", "b")):
        table.attach(req, handle(actor), late=False)
    assert sorted(table.readers()) == ["a", "b"]
    assert table.read_by("a") == [reqs[0].request_id, reqs[1].request_id]
    assert table.read_by("b") == [reqs[2].request_id]
