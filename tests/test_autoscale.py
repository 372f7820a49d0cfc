"""The autoscale policy: pure decisions on a fake clock, the config, and the loop on a local Ray.

- Policy (no Ray): grows only after pressure lasted `scale_up_after_s` (a shorter spike does not),
  one grow at a time, never above max_workers; shrinks only the newest worker idle for
  `scale_down_idle_s`, never one holding requests, never while anything waits, never below
  min_workers, one at a time.
- Config: each bad value is one ConfigError line naming its key; the section round-trips.
- On a local Ray instance (`TestOnRay`): a burst on one worker grows the set to two, every request
  finishes with the reference tokens, and the idle set shrinks back to one; a turn parked by the
  removed worker is restored afterwards on the one left.
"""

from __future__ import annotations

import time

import pytest

from raysched.config import AutoscaleConfig, ConfigError, load_serve_config
from raysched.scheduler.autoscale import NOTHING, AutoscalePolicy, Decision, Load, WorkerLoad

CFG = AutoscaleConfig(min_workers=1, max_workers=3, scale_up_waiting=4, scale_up_after_s=2.0,
                      scale_down_idle_s=10.0, interval_s=0.5)


def load(now: float, waiting: int = 0, running: tuple[int, ...] = (0,), draining: tuple[int, ...] = (),
         growing: int = 0, shrinking: int = 0) -> Load:
    """Workers 0..n-1 with these running counts; `draining`: their indices."""
    workers = tuple(WorkerLoad(i, n, i in draining) for i, n in enumerate(running))
    return Load(now, waiting, workers, growing, shrinking)


def run(policy: AutoscalePolicy, loads: list[Load]) -> list[Decision]:
    return [policy.decide(x) for x in loads]


# ---------------------------------------------------------------------------- growing


def test_pressure_that_lasts_grows_by_one_once_it_lasted_long_enough():
    policy = AutoscalePolicy(CFG)
    decisions = run(policy, [load(t / 2, waiting=8, running=(2,)) for t in range(5)])  # t = 0 .. 2.0
    assert decisions == [NOTHING] * 4 + [Decision(grow=True)]


def test_negative_control_a_spike_shorter_than_scale_up_after_s_does_not_grow():
    policy = AutoscalePolicy(CFG)
    spikes = [load(0.0, 8, (2,)), load(1.5, 8, (2,)), load(1.9, 0, (2,)), load(2.0, 8, (2,)), load(3.9, 8, (2,))]
    assert all(d.nothing for d in run(policy, spikes))  # each spike ended (or restarted) before 2 s
    assert policy.decide(load(4.0, 8, (2,))).grow  # the second one, at 2.0 s, did last


def test_pressure_is_per_undrained_worker():
    policy = AutoscalePolicy(CFG)
    below = [load(t, waiting=7, running=(2, 2)) for t in (0.0, 5.0)]  # 7 < 4 per worker x 2
    assert all(d.nothing for d in run(policy, below))
    at = [load(t, waiting=8, running=(2, 2)) for t in (10.0, 12.0)]
    assert run(policy, at)[-1].grow
    drained = AutoscalePolicy(CFG)  # a draining worker takes nothing: 4 per undrained worker
    assert run(drained, [load(t, waiting=4, running=(2, 2), draining=(1,)) for t in (0.0, 2.0)])[-1].grow


def test_no_second_grow_while_one_is_starting_and_the_clock_restarts_after_it():
    policy = AutoscalePolicy(CFG)
    assert run(policy, [load(0.0, 8, (2,)), load(2.0, 8, (2,))])[-1].grow
    starting = [load(t, 8, (2,), growing=1) for t in (2.5, 5.0, 9.0)]
    assert all(d.nothing for d in run(policy, starting))
    after = run(policy, [load(9.5, 8, (2, 2)), load(11.0, 8, (2, 2)), load(11.5, 8, (2, 2))])
    assert after == [NOTHING, NOTHING, Decision(grow=True)]  # 2 s after the new worker came up


def test_never_grows_above_max_workers_counting_draining_and_starting_workers():
    policy = AutoscalePolicy(CFG)
    full = [load(t, 50, (2, 2, 2)) for t in (0.0, 5.0, 10.0)]
    assert all(d.nothing for d in run(policy, full))
    one_draining = [load(t, 50, (2, 2, 0), draining=(2,)) for t in (20.0, 25.0)]
    assert all(d.nothing for d in run(policy, one_draining))
    replacing = AutoscalePolicy(CFG)  # a replacement being started counts too
    assert all(d.nothing for d in run(replacing, [load(t, 50, (2, 2), growing=1) for t in (0.0, 5.0)]))
    room = AutoscalePolicy(CFG)  # negative control: the same pressure with room does grow
    assert run(room, [load(t, 50, (2, 2)) for t in (0.0, 5.0)])[-1].grow


# ---------------------------------------------------------------------------- shrinking


def test_the_newest_worker_idle_long_enough_is_shrunk_once():
    policy = AutoscalePolicy(CFG)
    idle = [load(t, 0, (0, 0, 0)) for t in (0.0, 5.0, 9.9)]
    assert all(d.nothing for d in run(policy, idle))
    assert policy.decide(load(10.0, 0, (0, 0, 0))) == Decision(shrink=2)
    assert policy.decide(load(10.5, 0, (0, 0, 0), draining=(2,), shrinking=1)).nothing  # one at a time
    assert policy.decide(load(11.0, 0, (0, 0))) == Decision(shrink=1)  # worker 1 idle since 0.0


def test_never_shrinks_a_worker_holding_requests():
    policy = AutoscalePolicy(CFG)
    busy_newest = [load(t, 0, (0, 1)) for t in (0.0, 5.0, 20.0)]
    assert [d.shrink for d in run(policy, busy_newest)] == [None, None, 0]  # worker 0 idle, 1 busy
    all_busy = AutoscalePolicy(CFG)
    assert all(d.nothing for d in run(all_busy, [load(t, 0, (1, 3)) for t in (0.0, 20.0, 40.0)]))


def test_a_request_on_a_worker_restarts_its_idle_clock():
    policy = AutoscalePolicy(CFG)
    steps = [load(0.0, 0, (0, 0)), load(9.0, 0, (0, 1)), load(12.0, 0, (1, 0)), load(21.9, 0, (1, 0))]
    assert all(d.nothing for d in run(policy, steps))  # 1 idle again since 12.0; 0 busy
    assert policy.decide(load(22.0, 0, (1, 0))) == Decision(shrink=1)


def test_a_worker_joining_restarts_every_idle_clock():
    """A worker added (by hand, or by a grow) while another had been idle past
    `scale_down_idle_s` does not make the policy remove that one at once; each needs the full
    idle time from the join. Control: the same loads without the join shrink at once."""
    joined = AutoscalePolicy(CFG)
    steps = [load(0.0, 0, (0,)), load(15.0, 0, (0,)), load(15.5, 0, (0, 0)), load(25.4, 0, (0, 0))]
    assert all(d.nothing for d in run(joined, steps))
    assert joined.decide(load(25.5, 0, (0, 0))) == Decision(shrink=1)
    stayed = AutoscalePolicy(CFG)  # the control: two workers from the start
    assert [d.shrink for d in run(stayed, [load(0.0, 0, (0, 0)), load(15.5, 0, (0, 0))])] == [None, 1]
    gone = AutoscalePolicy(CFG)  # a worker leaving restarts nothing
    assert [d.shrink for d in run(gone, [load(t, 0, (0, 0, 0)) for t in (0.0, 10.0)]) +
            [gone.decide(load(10.5, 0, (0, 0)))]] == [None, 2, 1]


def test_never_shrinks_while_anything_waits():
    policy = AutoscalePolicy(CFG)
    waiting = [load(t, 1, (0, 0)) for t in (0.0, 20.0, 40.0)]  # 1 < 4: no pressure, but it waits
    assert all(d.nothing for d in run(policy, waiting))
    assert policy.decide(load(41.0, 0, (0, 0))).nothing  # the idle clocks restarted at 41.0
    assert policy.decide(load(51.0, 0, (0, 0))) == Decision(shrink=1)


def test_never_shrinks_below_min_workers():
    two = AutoscaleConfig(min_workers=2, max_workers=3, scale_down_idle_s=1.0)
    policy = AutoscalePolicy(two)
    assert all(d.nothing for d in run(policy, [load(t, 0, (0, 0)) for t in (0.0, 5.0, 50.0)]))
    assert policy.decide(load(60.0, 0, (0, 0, 0))).nothing  # a third joins: every idle clock restarts
    assert policy.decide(load(61.0, 0, (0, 0, 0))) == Decision(shrink=2)  # the newest, idle 1 s
    lone = AutoscalePolicy(CFG)  # a drained worker does not count towards min_workers
    assert all(d.nothing for d in run(lone, [load(t, 0, (0, 0), draining=(0,)) for t in (0.0, 50.0)]))


def test_no_shrink_while_a_grow_is_in_flight():
    policy = AutoscalePolicy(CFG)
    assert all(d.nothing for d in run(policy, [load(t, 0, (0, 0), growing=1) for t in (0.0, 50.0)]))
    assert policy.decide(load(51.0, 0, (0, 0))) == Decision(shrink=1)  # its clock ran meanwhile


def test_grow_then_idle_then_shrink_back_to_min():
    policy = AutoscalePolicy(AutoscaleConfig(max_workers=2, scale_up_after_s=1.0, scale_down_idle_s=3.0))
    trace = [load(0.0, 6, (2,)), load(1.0, 6, (2,)), load(1.5, 6, (2,), growing=1), load(2.0, 2, (2, 2)),
             load(3.0, 0, (1, 2)), load(4.0, 0, (0, 0)), load(6.9, 0, (0, 0)), load(7.0, 0, (0, 0))]
    assert [(d.grow, d.shrink) for d in run(policy, trace)] == [
        (False, None), (True, None), (False, None), (False, None), (False, None), (False, None),
        (False, None), (False, 1)]


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("raw, message", [
    ({"autoscale": {"min_workers": 1}}, "serve config: autoscale is missing required key(s): max_workers"),
    ({"autoscale": {"max_workers": 0}}, "serve config: autoscale.max_workers must be a positive integer, got 0"),
    ({"autoscale": {"max_workers": 2, "min_workers": 0}},
     "serve config: autoscale.min_workers must be a positive integer, got 0"),
    ({"autoscale": {"max_workers": 1, "min_workers": 2}},
     "serve config: autoscale.max_workers must be >= autoscale.min_workers (2), got 1"),
    ({"workers": 3, "autoscale": {"max_workers": 2}},
     "serve config: workers must lie within autoscale.min_workers..max_workers (1..2), got 3"),
    ({"workers": 1, "autoscale": {"max_workers": 3, "min_workers": 2}},
     "serve config: workers must lie within autoscale.min_workers..max_workers (2..3), got 1"),
    ({"autoscale": {"max_workers": 2, "scale_up_waiting": 0}},
     "serve config: autoscale.scale_up_waiting must be a positive integer, got 0"),
    ({"autoscale": {"max_workers": 2, "scale_up_after_s": -1}},
     "serve config: autoscale.scale_up_after_s must be a finite number >= 0, got -1"),
    ({"autoscale": {"max_workers": 2, "scale_down_idle_s": "soon"}},
     "serve config: autoscale.scale_down_idle_s must be a finite number >= 0, got 'soon'"),
    ({"autoscale": {"max_workers": 2, "interval_s": 0}}, "serve config: autoscale.interval_s must be > 0, got 0.0"),
    ({"autoscale": {"max_workers": 2, "min_worker": 1}},
     "serve config: unknown key 'autoscale.min_worker' (did you mean 'min_workers'?)"),
    ({"autoscale": 3}, "serve config: autoscale must be a mapping, got 3"),
    ({"roles": {"prefill": 1, "decode": 1}, "autoscale": {"max_workers": 2}},
     "serve config: autoscale cannot be combined with roles (an added worker would both prefill and decode)"),
])
def test_a_bad_autoscale_value_is_one_line_naming_its_key(raw, message):
    with pytest.raises(ConfigError) as info:
        load_serve_config(raw)
    assert str(info.value) == message


def test_autoscale_is_off_by_default_starts_at_min_workers_and_round_trips(tmp_path):
    import yaml

    assert load_serve_config({}).autoscale is None and load_serve_config({"autoscale": None}).autoscale is None
    cfg = load_serve_config({"autoscale": {"min_workers": 2, "max_workers": 4, "scale_down_idle_s": 5}})
    assert cfg.workers == 2 and cfg.autoscale == AutoscaleConfig(max_workers=4, min_workers=2, scale_down_idle_s=5.0)
    assert load_serve_config(cfg.to_dict()) == cfg
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_serve_config(tmp_path / "serve.yaml") == cfg
    assert load_serve_config(load_serve_config({}).to_dict()).autoscale is None
    assert load_serve_config({"workers": 3, "autoscale": {"max_workers": 4}}).workers == 3  # given: kept


# ---------------------------------------------------------------------------- on a local Ray instance


INLINE_LIMIT = 1024  # results above 1 KiB go to the object store: parked states are not held inline


@pytest.fixture(scope="module")
def local_ray():
    """One node, 3 CPUs: the scheduler takes none, each worker one (room for two, and a spare).
    Ray returns results over `INLINE_LIMIT` through the object store (the processes it starts
    read the variable), so parked turn states live there, as a real model's do, not in the
    scheduler's memory."""
    import os

    import ray

    if ray.is_initialized():
        ray.shutdown()
    before = os.environ.get("RAY_max_direct_call_object_size")
    os.environ["RAY_max_direct_call_object_size"] = str(INLINE_LIMIT)
    try:
        ray.init(address="local", num_cpus=3, object_store_memory=100 << 20, include_dashboard=False,
                 logging_level="WARNING")
        yield
    finally:
        ray.shutdown()
        if before is None:
            os.environ.pop("RAY_max_direct_call_object_size", None)
        else:
            os.environ["RAY_max_direct_call_object_size"] = before


def serving(**autoscale):
    from tests.exactness import serving as launch

    return launch({"workers": 1, "pool": {"kv_tokens": 1024, "state_slots": 2},
                   "scheduler": {"decode_steps_per_call": 2}, "state_cache": {"min_tokens": 16},
                   "autoscale": {"min_workers": 1, "max_workers": 2, "interval_s": 0.1, **autoscale}})


@pytest.mark.usefixtures("local_ray", "one_torch_thread")
class TestOnRay:
    def test_a_burst_grows_the_set_and_idle_shrinks_it_back_with_nothing_lost(self):
        import threading

        from raysched.runner import run_workload
        from tests.conftest import wait_until
        from tests.exactness import assert_exactly_once, assert_idle, synthetic

        specs = synthetic(seed=5, requests=32, max_new_tokens=(70, 110))
        burst, after_grow = specs[:16], specs[16:]
        with serving(scale_up_waiting=2, scale_up_after_s=0.3, scale_down_idle_s=1.0) as client:
            t0 = time.monotonic()
            reports: list[dict] = []
            first = threading.Thread(target=lambda: reports.append(run_workload(client, burst, progress=False)))
            first.start()  # the burst queues past the 2 slots: the policy grows the set
            # A fast CPU may serve the burst before a worker starts (~6 s): the rest of the
            # requests come once the added worker is up, so that it has work whatever the speed.
            wait_until(lambda: client.stats()["workers_alive"] == 2, 120, "the set to grow to two workers")
            reports.append(run_workload(client, after_grow, progress=False))
            first.join(timeout=300)
            served_s = time.monotonic() - t0
            stats = client.stats()
            assert stats["autoscale_grows"] == 1 and len(stats["workers"]) == 2, stats["workers"]
            wait_until(lambda: client.stats()["workers_alive"] == 1, 60, "the idle set to shrink to one worker")
            after = client.stats()
            assert after["autoscale_shrinks"] == 1 and after["autoscale_grows"] == 1, after
            assert_idle(client.check_idle())
        report = {"requests": [r for rep in reports for r in rep["requests"]]}
        assert_exactly_once(report, specs)
        on_added = [r["request_id"] for r in report["requests"] if 1 in r["workers"]]
        assert on_added, "the added worker served no request"
        print(f"\nserved in {served_s:.1f} s; {len(on_added)} of {len(specs)} requests ran on the added worker")

    def test_a_turn_parked_by_a_removed_worker_is_restored_after_it_went(self):
        """Turn 1 runs on worker 1 (worker 0 drained meanwhile); worker 1 idles and the policy
        removes it; turn 2 restores turn 1's finished state on worker 0 with the right tokens."""
        from raysched.sampling import SamplingParams
        from raysched.workload import RequestSpec
        from tests.conftest import wait_until
        from tests.exactness import reference

        greedy = SamplingParams(max_new_tokens=12)
        p1 = [(7 * i + 3) % 500 for i in range(60)]
        with serving(scale_down_idle_s=3.0) as client:
            client.add_worker()
            client.drain(0)
            r1 = client.submit(p1, greedy).result(timeout=120)
            client.undrain(0)
            wait_until(lambda: client.stats()["workers_alive"] == 1, 60, "the idle worker 1 to be removed")
            p2 = p1 + r1["token_ids"] + [(11 * i) % 500 for i in range(20)]
            r2 = client.submit(p2, greedy).result(timeout=120)
            stats = client.stats()
        want = reference([RequestSpec("t1", tuple(p1), greedy), RequestSpec("t2", tuple(p2), greedy)])
        assert r1["workers"] == [1] and r2["workers"] == [0], (r1["workers"], r2["workers"])
        assert stats["autoscale_shrinks"] == 1 and stats["autoscale_grows"] == 0, stats
        assert [r1["token_ids"], r2["token_ids"]] == [want["t1"], want["t2"]]
        assert r2["cache_kind"] == "finished" and r2["cache_source"] == "same_node", r2
        assert r2["cached_tokens"] == len(p1) + len(r1["token_ids"]) - 1
        assert stats["state_cache_bytes"] > 0 and stats["state_cache_inline_bytes"] == 0, stats  # in the store
        print(f"\nturn 2 restored {r2['cached_tokens']} tokens parked by the removed worker; parked "
              f"{stats['state_cache_bytes']} B, {stats['state_cache_inline_bytes']} B of it inline")


# ---------------------------------------------------------------------------- the loop's steps (no Ray)


def test_a_refused_resource_request_is_logged_and_not_raised(monkeypatch, caplog):
    import ray.autoscaler.sdk

    from raysched import ray_compat

    def refuse(**_):
        raise ConnectionError("no autoscaler here")

    monkeypatch.setattr(ray.autoscaler.sdk, "request_resources", refuse)
    with caplog.at_level("INFO", logger="raysched.ray_compat"):
        assert ray_compat.request_resources([{"CPU": 1}]) is False
    assert "no autoscaler here" in caplog.text
    asked = []
    monkeypatch.setattr(ray.autoscaler.sdk, "request_resources", lambda **kw: asked.append(kw))
    assert ray_compat.request_resources([{"CPU": 1}]) is True and asked == [{"bundles": [{"CPU": 1}]}]


def test_a_grow_asks_for_the_whole_new_set_before_starting_the_worker_and_counts_it(monkeypatch):
    import asyncio

    from raysched.scheduler import actor
    from tests.exactness import bare_scheduler

    sched, _ = bare_scheduler()  # two live (fake) workers
    calls = []
    monkeypatch.setattr(actor, "worker_bundle", lambda cfg: {"CPU": 1, "GPU": 1})
    monkeypatch.setattr(actor, "request_resources", lambda bundles: calls.append(("ask", bundles)))

    async def add_worker():
        calls.append(("add", None))
        return {"worker": 2}

    sched.add_worker = add_worker
    sched._growing = 1  # as the loop counts it when it decides
    asyncio.run(sched._grow())
    assert calls == [("ask", [{"CPU": 1, "GPU": 1}] * 3), ("add", None)]
    assert sched.counters.autoscale_grows == 1 and sched._growing == 0


def test_a_grow_that_finds_no_room_is_not_counted(monkeypatch):
    import asyncio

    from raysched.scheduler import actor
    from tests.exactness import bare_scheduler

    sched, _ = bare_scheduler()
    monkeypatch.setattr(actor, "worker_bundle", lambda cfg: {})  # (simulated workers: nothing asked)

    async def no_room():
        raise RuntimeError("could not start a worker: the cluster has no room for one")

    sched.add_worker = no_room
    sched._growing = 1
    asyncio.run(sched._grow())
    assert sched.counters.autoscale_grows == 0 and sched._growing == 0


def test_the_load_the_loop_sees_counts_waiting_and_retracted_requests_and_each_live_worker():
    import asyncio

    from tests.exactness import bare_scheduler

    sched, w0 = bare_scheduler()

    async def submit_three():
        return [await sched.submit([1, 2, 3 + i], {"max_new_tokens": 8}) for i in range(3)]

    ids = asyncio.run(submit_three())
    retracted = sched.table.requests[ids[0]]
    sched.table.waiting.remove(retracted)
    sched.table.retracted.append(retracted)
    admitted = sched.table.requests[ids[1]]
    sched.table.waiting.remove(admitted)
    w0.view.running.append(admitted)  # (as if admitted: it holds worker 0)
    sched.fleet.slots[1].draining = True
    sched._growing, sched._shrinking = 1, 1
    load = sched._load()
    assert load.waiting == 2 and (load.growing, load.shrinking) == (1, 1)  # one new, one retracted
    assert load.workers == (WorkerLoad(0, 1, False), WorkerLoad(1, 0, True))
    sched.fleet.slots[1].alive = False  # a removed worker is not in the load
    assert [w.index for w in sched._load().workers] == [0]
