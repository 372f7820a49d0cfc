"""The simulated data plane (`data_plane: sim`, `actors/sim.py`): same interface, same pool
accounting, exact continuation across retraction, migration and faults, no torch."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from raysched.config import load_serve_config
from raysched.messages import PrefillItem, StepPlan

from actors.sim import SimWorker

SIM = {"decode_ms": 0.0, "vocab_size": 512, "max_context": 4096}


def sim_config(**extra) -> object:
    raw = {"data_plane": "sim", "pool": {"kv_tokens": 256, "state_slots": 4}, "sim": SIM, **extra}
    return load_serve_config(raw)


def item(rid: str, prompt: list[int], max_new: int, generated: tuple[int, ...] = ()) -> PrefillItem:
    return PrefillItem(rid, tuple(prompt) + generated, len(prompt), {"max_new_tokens": max_new})


def run_alone(rid: str, prompt: list[int], max_new: int) -> list[int]:
    """The reference: one worker, never interrupted."""
    w = SimWorker(sim_config(), 0)
    out = w.step(StepPlan(prefill=(item(rid, prompt, max_new),), decode_steps=max_new))
    return out.new_tokens[rid]


def test_tokens_depend_on_request_and_position_only() -> None:
    a = run_alone("r1", [1, 2, 3], 20)
    assert a == run_alone("r1", [1, 2, 3], 20) and len(a) == 20
    assert a != run_alone("r2", [1, 2, 3], 20)  # another request id: other tokens


@pytest.mark.parametrize("how", ["snapshot", "recompute"])
def test_a_moved_request_continues_exactly(how: str) -> None:
    reference = run_alone("r", [5, 6, 7], 30)
    src, dst = SimWorker(sim_config(), 0), SimWorker(sim_config(), 1)
    first = src.step(StepPlan(prefill=(item("r", [5, 6, 7], 30),), decode_steps=9)).new_tokens["r"]
    if how == "snapshot":
        snap, nbytes = src.retract_pending("r")
        assert nbytes == snap.num_cached_tokens * 4096 + (1 << 20)  # the nominal size
        rest = dst.step(StepPlan(resume=("r",), decode_steps=30), snap).new_tokens["r"]
    else:
        src.step(StepPlan(drop=("r",)))
        rest = dst.step(StepPlan(prefill=(item("r", [5, 6, 7], 30, tuple(first)),), decode_steps=30)).new_tokens["r"]
    assert first + rest == reference
    assert src.is_idle() and dst.is_idle()  # finished: everything freed


def test_negative_control_a_dropped_state_changes_the_tokens() -> None:
    from actors.faults import with_faults

    reference = run_alone("r", [5, 6, 7], 30)
    src = SimWorker(sim_config(), 0)
    dst = with_faults(SimWorker)(sim_config(scheduler={"debug_drop_state": True}), 1)
    first = src.step(StepPlan(prefill=(item("r", [5, 6, 7], 30),), decode_steps=9)).new_tokens["r"]
    snap, _ = src.retract_pending("r")
    rest = dst.step(StepPlan(resume=("r",), decode_steps=30), snap).new_tokens["r"]
    assert first + rest != reference


def test_corrupted_and_lost_snapshots_are_refused() -> None:
    from actors.faults import corrupted
    from actors.sim import Lost

    src, dst = SimWorker(sim_config(), 0), SimWorker(sim_config(), 1)
    src.step(StepPlan(prefill=(item("a", [1], 9), item("b", [2], 9)), decode_steps=2))
    bad = corrupted(src.retract_pending("a")[0])
    out = dst.step(StepPlan(resume=("a", "b"), decode_steps=1), bad, Lost("ObjectLostError"))
    assert "checksum" in out.resume_failed["a"] and out.resume_failed["b"].startswith("snapshot lost")
    assert dst.is_idle()


def test_pool_accounting_stalls_and_refuses_like_a_real_worker() -> None:
    w = SimWorker(sim_config(pool={"kv_tokens": 16, "state_slots": 2}), 0)
    out = w.step(StepPlan(prefill=(item("a", [1] * 6, 20), item("b", [2] * 6, 20), item("c", [3], 20))))
    assert out.not_admitted == ["c"]  # two state slots
    assert (out.usage.kv_free_tokens, out.usage.state_free_slots) == (4, 0)
    out = w.step(StepPlan(decode_steps=4))
    assert out.stalled == ["a", "b"]  # two steps fit, then KV ran out: stalled, not dropped
    assert out.allocated == {"a": 8, "b": 8} and [len(t) for t in out.new_tokens.values()] == [2, 2]


def test_the_simulated_data_plane_imports_no_torch() -> None:
    code = "import sys, actors.sim, actors.faults, actors.accounting; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "False"


def test_sim_config_is_validated() -> None:
    from raysched.config import ConfigError

    with pytest.raises(ConfigError, match="sim.decode_ms must be a finite number >= 0"):
        load_serve_config({"data_plane": "sim", "sim": {"decode_ms": -1}})
    with pytest.raises(ConfigError, match="sim applies only to data_plane: sim"):
        load_serve_config({"sim": {"decode_ms": 3}})
    with pytest.raises(ConfigError, match="unknown key 'sim.decode_msec'"):
        load_serve_config({"data_plane": "sim", "sim": {"decode_msec": 3}})


def test_sim_fleet_on_ray_loses_no_token_through_retractions_and_faults(tmp_path) -> None:
    """Eight simulated workers in two processes, retracting every call, with a worker killed
    between calls, one dying inside a step and one corrupted snapshot: every request gets
    exactly the tokens of an uninterrupted run, and the pools end empty."""
    import raysched

    faults = [{"kind": "kill_worker", "worker": 1, "after_steps": 3},
              {"kind": "kill_in_step", "worker": 2, "after_steps": 2, "after_decode_steps": 1},
              {"kind": "corrupt_snapshot", "worker": 3, "after_steps": 1}]
    cfg = sim_config(workers=8, faults=faults, scheduler={"force_retract_every": 1, "decode_steps_per_call": 2},
                     sim={**SIM, "decode_ms": 1.0, "workers_per_process": 4}, state_cache={"enabled": False},
                     object_store_memory=100 << 20)
    client = raysched.launch(cfg)
    try:
        handles = [client.submit([3, 1, i], {"max_new_tokens": 24}) for i in range(24)]
        records = [h.result(timeout=120) for h in handles]
        stats = client.stats()
        idle = client.check_idle()
    finally:
        client.shutdown()
    for r in records:
        assert r["token_ids"] == run_alone(r["request_id"], [3, 1, int(r["prompt_ids"][-1])], 24), r
    assert stats["worker_failures"] == 2 and stats["retractions"] > 0 and stats["folded_calls"] > 0
    assert stats["snapshots_refused"] >= 1
    assert idle["workers_idle"] and idle["tables"]["requests"] == 0


def long_call_then_a_kill(later_tokens: int, finish_notices: bool = True) -> tuple[list, dict, dict]:
    """One simulated worker (20 ms steps, long calls of 8 x 4 steps, joins at once): two requests
    of 60 tokens, then, once the first call is back, two of `later_tokens` that join the long
    call; the worker dies at that call's decode step 28. (records, stats, check_idle)."""
    import time

    import raysched

    faults = [{"kind": "kill_in_step", "worker": 0, "after_steps": 1, "folded": True, "after_decode_steps": 28}]
    cfg = sim_config(workers=1, faults=faults, state_cache={"enabled": False}, object_store_memory=80 << 20,
                     scheduler={"decode_steps_per_call": 4, "fold_calls": 8, "join_after_ms": 0,
                                "interrupt_after_ms": 60_000, "finish_notices": finish_notices},
                     sim={**SIM, "decode_ms": 20.0, "workers_per_process": 1})
    client = raysched.launch(cfg)
    try:
        first = [client.submit([3, 1, i], {"max_new_tokens": 60}) for i in range(2)]
        deadline = time.monotonic() + 60
        while client.stats()["tokens"] < 10 and time.monotonic() < deadline:  # the admission call is back
            time.sleep(0.01)
        later = [client.submit([3, 1, i], {"max_new_tokens": later_tokens}) for i in range(2, 4)]
        records = [h.result(timeout=120) for h in first + later]
        return records, client.stats(), client.check_idle()
    finally:
        client.shutdown()


def test_a_worker_that_dies_in_a_long_call_with_joined_requests_loses_no_token() -> None:
    """Two requests decode on one simulated worker in a long call (32 steps of 20 ms); two more
    arrive during it and join it (`join_long_calls`, no interrupt); the worker dies at the call's
    decode step 28 (`kill_in_step`, folded). All four are recovered from it, on the replacement,
    and end with the tokens of an uninterrupted run (the reference); the pools end empty."""
    records, stats, idle = long_call_then_a_kill(later_tokens=30)
    for r in records:
        assert r["token_ids"] == run_alone(r["request_id"], list(r["prompt_ids"]), len(r["token_ids"])), r
        assert len(r["token_ids"]) == (60 if r["prompt_ids"][-1] < 2 else 30)
    assert stats["joins"] >= 2 and stats["interrupted_calls"] == 0 and stats["worker_failures"] == 1
    assert stats["recovered"] == 4  # the joined ones too were on worker 0 when it died
    assert idle["workers_idle"] and idle["tables"]["requests"] == 0


@pytest.mark.parametrize("notices", [True, False], ids=["notices", "control-calls-end-at-a-finish"])
def test_requests_that_finish_inside_a_long_call_end_once_when_the_worker_dies_after(notices: bool) -> None:
    """Two long requests decode in a long call (32 steps of 20 ms); two short ones join it and
    finish inside it; the worker dies at the call's decode step 28. With `finish_notices` the
    call went on past their finish and the scheduler ended them from the notices: each of the
    four ends once, with the tokens of an uninterrupted run, and only the two long ones are
    recovered. Control: without notices the call ends at the first finish (none are sent) and
    dies there (the fault fires after a call's last step): its reply is lost, all four are
    recovered, and the same tokens come out."""
    records, stats, idle = long_call_then_a_kill(later_tokens=6, finish_notices=notices)
    for r in records:
        assert r["token_ids"] == run_alone(r["request_id"], list(r["prompt_ids"]), len(r["token_ids"])), r
        assert len(r["token_ids"]) == (60 if r["prompt_ids"][-1] < 2 else 6)
    assert stats["finished"] == 4 and stats["worker_failures"] == 1 and stats["joins"] >= 2
    if notices:  # (the long ones, recovered, end in a later long call: notices too)
        assert stats["finish_notices"] >= 2 and stats["recovered"] == 2
    else:  # the call ended at their finish, and its reply was lost with the worker
        assert stats["finish_notices"] == 0 and stats["recovered"] == 4
    assert idle["workers_idle"] and idle["tables"]["requests"] == 0


def test_simulated_worker_offers_every_public_method_of_the_real_one() -> None:
    import inspect

    from actors.worker import Worker

    def public(cls: type) -> dict[str, list[str]]:
        return {name: [p for p in inspect.signature(fn).parameters if not p.startswith("_ray")]
                for name, fn in vars(cls).items() if callable(fn) and not name.startswith("_")}

    assert public(SimWorker) == public(Worker)


def test_a_streamed_step_sends_each_decode_step_at_its_modeled_time() -> None:
    """`SimHost.stream` sends the pieces of `SimWorker._timeline`: the prefill's tokens after
    the prefill's modeled time, then one piece per decode step after a step's, and the result;
    the tokens are those of a plain `step` (a fresh worker, the reference), the times add up
    to its modeled time."""
    sim = {**SIM, "decode_ms": 10.0, "decode_ms_per_row": 1.0, "prefill_ms_per_token": 0.5}
    plan = StepPlan(prefill=(item("a", [1, 2, 3, 4], 9), item("b", [5, 6], 9)), decode_steps=3)
    w = SimWorker(sim_config(sim=sim), 0)
    *pieces, (_, result) = w._timeline(plan)
    assert [ms for ms, _ in pieces] == [3.0, 12.0, 12.0, 12.0]  # 6 prompt tokens; 10 + 2 rows
    assert [p.new_tokens for _, p in pieces[1:]] == [{"a": [result.new_tokens["a"][k]], "b": [result.new_tokens["b"][k]]}
                                                     for k in (1, 2, 3)]
    assert result.new_tokens == SimWorker(sim_config(sim=sim), 0).step(plan).new_tokens
    assert sum(ms for ms, _ in pieces) == w.last_step_ms


def test_an_interrupted_step_ends_after_the_step_under_way_and_continues_exactly() -> None:
    """`interrupt(call_id)` while a step call streams: its decoding ends after the step under
    way, its reply covers only the steps that ran (modeled time included), and a next call
    continues the request with the tokens of an uninterrupted run (the reference). Controls:
    another call's id interrupts nothing; a call without an id cannot be interrupted."""
    reference = run_alone("r", [5, 6, 7], 30)
    w = SimWorker(sim_config(sim={**SIM, "decode_ms": 10.0}), 0)
    stream = w.step_stream(StepPlan(prefill=(item("r", [5, 6, 7], 30),), decode_steps=20, call_id=4))
    pieces = [next(stream) for _ in range(3)]  # the prefill's token, then 2 decode steps
    w.interrupt(3)  # another call's id: nothing
    pieces.append(next(stream))
    w.interrupt(4)
    *rest, result = stream
    assert len(rest) == 0 and result.new_tokens["r"] == reference[:4] and w.last_step_ms == 30.0
    assert [p.new_tokens["r"][0] for p in pieces] == reference[:4]
    more = w.step(StepPlan(decode_steps=26, call_id=5)).new_tokens["r"]  # (call ids are not reused)
    assert reference[:4] + more == reference

    w = SimWorker(sim_config(), 0)
    stream = w.step_stream(StepPlan(prefill=(item("r", [5, 6, 7], 30),), decode_steps=20))
    next(stream)
    w.interrupt(0)
    assert list(stream)[-1].new_tokens["r"] == reference[:21]


def test_an_interrupt_reaches_a_simulated_workers_call_in_flight_on_ray() -> None:
    """Through `SimHost` on Ray: the interrupt runs beside the call (not after it, in the
    worker's order), which then ends early with a consistent reply; the request's tokens are
    the reference's. Control: the same call, not interrupted, runs all its steps."""
    import time

    import ray

    from raysched.workers import spawn_sim_worker

    cfg = sim_config(sim={**SIM, "decode_ms": 20.0})
    ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=80 << 20)
    try:
        results = []
        for interrupt in (True, False):
            h = spawn_sim_worker(cfg, 0 if interrupt else 1)
            ray.get(h.info.remote())  # the host and the worker are up
            plan = StepPlan(prefill=(item("r", [5, 6, 7], 30),), decode_steps=25, call_id=1)
            call = h.step.remote(plan)
            time.sleep(0.15)
            if interrupt:
                h.interrupt.remote(1)
            results.append(ray.get(call, timeout=30).new_tokens["r"])
    finally:
        ray.shutdown()
    reference = run_alone("r", [5, 6, 7], 30)
    assert 1 < len(results[0]) < 26 and results[0] == reference[:len(results[0])]
    assert results[1] == reference[:26]


def test_a_long_call_ends_at_the_step_a_request_finishes() -> None:
    """`end_at_finish` (a long call): the decoding ends after the step in which a request
    finished (here its 5th token, decode step 4), so its client hears at once; the other
    request's tokens are the reference's. Control: without it, the call runs all 20 steps."""
    plan = StepPlan(prefill=(item("short", [1, 2], 5), item("long", [3, 4], 40)), decode_steps=20, end_at_finish=True)
    out = SimWorker(sim_config(sim={**SIM, "decode_ms": 10.0}), 0).step(plan)
    assert out.finished == {"short": "length"} and out.new_tokens["long"] == run_alone("long", [3, 4], 40)[:5]
    full = SimWorker(sim_config(), 0).step(StepPlan(prefill=plan.prefill, decode_steps=20))
    assert len(full.new_tokens["long"]) == 21


class NoticeBox:
    """A scheduler's handle as `StepPlan.notices` sees it: records each `call_finished`."""

    def __init__(self) -> None:
        self.got: list[tuple] = []
        box = self

        class CallFinished:
            @staticmethod
            def remote(*args):
                box.got.append(args)
        self.call_finished = CallFinished


def test_a_long_call_with_notices_goes_on_past_a_finish_and_tells_the_scheduler() -> None:
    """`StepPlan.notices`: a long call (`end_at_finish`) that finds a request finished decodes
    on, and tells the scheduler at once, with the finished request's tokens of the call (those
    of an uninterrupted run, the reference); the other request runs all 20 steps with the
    reference's tokens. Control: the same plan without `notices` ends at that step."""
    box = NoticeBox()
    plan = StepPlan(prefill=(item("short", [1, 2], 5), item("long", [3, 4], 40)), decode_steps=20,
                    end_at_finish=True, call_id=1, joins=True, notices=box, notice_id=9)
    *_, out = SimWorker(sim_config(sim={**SIM, "decode_ms": 10.0}), 0).step_stream(plan)
    assert box.got == [(0, 9, {"short": ("length", run_alone("short", [1, 2], 5))})]
    assert out.finished == {"short": "length"} and out.new_tokens["long"] == run_alone("long", [3, 4], 40)[:21]
    control = SimWorker(sim_config(sim={**SIM, "decode_ms": 10.0}), 0)
    *_, ended = control.step_stream(dataclasses.replace(plan, notices=None))
    assert len(ended.new_tokens["long"]) == 5


def test_a_request_joins_a_long_call_between_decode_steps_and_continues_exactly() -> None:
    """`join(call_id, items)` while a long call that takes joins (`StepPlan.joins`) streams: the
    call starts the item before its next decode step and decodes it with its own request; its
    reply lists it in `joined`, its streamed tokens are those of an uninterrupted run (the
    reference), and a next call continues it exactly. Controls: a join for an earlier call's id
    comes back as not admitted; one after the call's decoding ended is dropped (in no list); a
    call without `joins` takes none."""
    reference = run_alone("j", [4, 4, 4], 30)
    w = SimWorker(sim_config(sim={**SIM, "decode_ms": 10.0}), 0)
    stream = w.step_stream(StepPlan(prefill=(item("r", [5, 6, 7], 40),), decode_steps=10, call_id=3, joins=True))
    next(stream), next(stream)  # the prefill's token, decode step 0
    w.join(2, [item("x", [1], 5)])
    w.join(3, [item("j", [4, 4, 4], 30)])
    *pieces, result = stream
    assert result.joined == ["j"] and result.not_admitted == ["x"] and "x" not in w.running_ids()
    assert [tok for p in pieces for tok in p.new_tokens.get("j", [])] == reference[:10]  # 1 + 9 steps
    assert result.new_tokens["j"] == reference[:10] and len(result.new_tokens["r"]) == 11
    w.join(3, [item("late", [2], 5)])
    more = w.step(StepPlan(decode_steps=20, call_id=4, joins=True))
    assert reference[:10] + more.new_tokens["j"] == reference and more.finished["j"] == "length"
    assert not more.joined and not more.not_admitted and "late" not in w.running_ids()
    w.join(5, [item("y", [3], 5)])
    plain = w.step(StepPlan(decode_steps=2, call_id=5))
    assert plain.not_admitted == ["y"] and not plain.joined and "y" not in w.running_ids()


class _InProcess:
    """A host actor's handle without Ray: `handle.method.remote(*args)` runs the method here
    (a coroutine's result is awaited by the caller, as a Ray reference would be)."""

    def __init__(self, impl, log: list) -> None:
        self.impl, self.log = impl, log

    def __getattr__(self, name: str):
        impl, log = self.impl, self.log

        class Method:
            @staticmethod
            def remote(*args):
                log.append((name, args))
                return getattr(impl, name)(*args)
        return Method


def test_a_call_with_nothing_left_to_decode_ends_there() -> None:
    """A simulated long call whose requests all finished, with no join waiting, ends (its
    modeled time covers the steps that ran), as the real engine's `decode_steps` does: a call
    that goes on past finishes must not sleep through steps that decode nothing. Control: a
    request that outlasts the call runs all its steps."""
    sim = sim_config(sim={**SIM, "decode_ms": 10.0})
    plan = StepPlan(prefill=(item("short", [1, 2], 5),), decode_steps=20, call_id=1, joins=True,
                    end_at_finish=True, notices=NoticeBox(), notice_id=1)
    w = SimWorker(sim, 0)
    out = w.step(plan)
    assert out.finished == {"short": "length"} and w.last_step_ms == sim.sim.step_ms(2, 4, 1)
    longer = SimWorker(sim, 0)
    longer.step(dataclasses.replace(plan, prefill=(item("long", [1, 2], 40),)))
    assert longer.last_step_ms == sim.sim.step_ms(2, 20, 1)


def test_a_batching_hosts_finish_notices_come_back_through_its_channel() -> None:
    """With `sim.batch_calls`, a simulated worker's finish notice leaves with the host's replies
    (`SimHost._notice`, no Ray call of its own) and the channel hands it to its `on_notice`
    (`route_notices`) before the call's reply: the finished request's tokens are the reference's.
    Control: a host that does not batch sends it as a Ray call to the plan's `notices`."""
    import asyncio

    from actors.sim import SimHost
    from raysched.workers import HostChannel

    async def scenario(batch: bool) -> tuple[list, list]:
        host = SimHost(sim_config(sim={**SIM, "decode_ms": 2.0, "batch_calls": batch}))
        await host.add(0)
        channel, routed, box = HostChannel(_InProcess(host, [])), [], NoticeBox()
        channel.on_notice = lambda *args: routed.append((args, channel.waiting.get((0, 0)) is not None))
        plan = StepPlan(prefill=(item("short", [1, 2], 5), item("long", [3, 4], 40)), decode_steps=12,
                        call_id=1, joins=True, end_at_finish=True, notices=box, notice_id=3)
        out = await channel.step(0, 0, (plan,))
        assert out.new_tokens["long"] == run_alone("long", [3, 4], 40)[:13]
        return routed, box.got

    routed, sent = asyncio.run(scenario(batch=True))
    assert routed == [((0, 3, {"short": ("length", run_alone("short", [1, 2], 5))}), True)] and sent == []
    routed, sent = asyncio.run(scenario(batch=False))
    assert routed == [] and sent == [(0, 3, {"short": ("length", run_alone("short", [1, 2], 5))})]


def test_a_host_channel_batches_a_loop_turns_calls_and_routes_every_reply() -> None:
    """`HostChannel` (`sim.batch_calls`): the step calls and interrupt started in one turn of the
    event loop leave in one `submit`, in order; each caller gets its own worker's reply, equal
    to that worker run alone; a killed worker's call raises its death; the host's death fails
    every call still waiting. The control: a worker's call interrupted in the same batch ends
    early, so the reply really is that call's."""
    import asyncio

    from actors.sim import SimHost, SimWorkerDied
    from raysched.workers import HostChannel

    async def scenario() -> None:
        log: list = []
        host = SimHost(sim_config(sim={**SIM, "decode_ms": 2.0}))
        for index in range(3):
            await host.add(index)
        channel = HostChannel(_InProcess(host, log))
        host.workers[2].dead = True
        plans = {i: StepPlan(prefill=(item(f"r{i}", [1, 2, i], 30),), decode_steps=30, call_id=1) for i in range(3)}
        replies = {i: channel.step(i, 0, (plans[i],)) for i in range(3)}
        channel.post("interrupt", 1, 1)
        await asyncio.sleep(0)
        assert [name for name, _ in log if name == "submit"] == ["submit"]
        assert [kind for kind, *_ in log[0][1][0]] == ["step", "step", "step", "interrupt"]
        assert (await replies[0]).new_tokens["r0"] == run_alone("r0", [1, 2, 0], 30)
        cut = (await replies[1]).new_tokens["r1"]
        assert len(cut) < 30 and cut == run_alone("r1", [1, 2, 1], 30)[:len(cut)]
        with pytest.raises(SimWorkerDied):
            await replies[2]

        class DeadHost:
            def __getattr__(self, name):
                class Method:
                    @staticmethod
                    def remote(*args):
                        async def died():
                            raise RuntimeError("the host actor died")
                        return died() if name == "collect" else None
                return Method

        dead = HostChannel(DeadHost())
        waiting = [dead.step(i, 0, (plans[i],)) for i in range(2)]
        for reply in waiting:
            with pytest.raises(RuntimeError, match="host actor died"):
                await reply

    asyncio.run(scenario())
