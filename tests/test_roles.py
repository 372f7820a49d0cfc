"""Prefill and decode roles in the scheduler's parts, without Ray (the fake workers of
tests/test_scheduler_parts.py): who admits, who decodes, the hand-over, and a lost worker."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from raysched.config import ConfigError, SchedulerConfig, ServeConfig, load_serve_config
from raysched.request import Request
from raysched.sampling import SamplingParams
from raysched.scheduler.planner import WorkerView, plan_for_role
from raysched.scheduler.roles import Role, choose_target, effective_role, initial_roles
from tests.test_scheduler_parts import LIMITS, FakeWorker, expected, parts, run_until_done


def roles_config(**scheduler) -> ServeConfig:
    return load_serve_config({"roles": {"prefill": 1, "decode": 1}, "scheduler": scheduler})


def with_roles(config: ServeConfig, workers: list[FakeWorker]) -> dict:
    p = parts(config, workers)
    for slot, role in zip(p["fleet"].slots, initial_roles(config)):
        slot.view.role = role
    return p


def test_roles_config_is_typed_and_validated() -> None:
    cfg = load_serve_config({"roles": {"prefill": 1, "decode": 2}})
    assert cfg.workers == 3 and initial_roles(cfg) == [Role.PREFILL, Role.DECODE, Role.DECODE]
    assert load_serve_config(cfg.to_dict()) == cfg
    assert initial_roles(load_serve_config({"workers": 2})) == [Role.BOTH, Role.BOTH]
    for bad, words in [({"roles": {"prefill": 1}}, "missing required key(s): decode"),
                       ({"roles": {"prefill": 1, "decode": 1, "both": 1}}, "unknown key 'roles.both'"),
                       ({"roles": {"prefill": 0, "decode": 1}}, "roles.prefill"),
                       ({"workers": 3, "roles": {"prefill": 1, "decode": 1}}, "must equal workers (3)")]:
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            load_serve_config(bad)


def test_a_prefill_worker_admits_and_never_decodes_a_decode_worker_never_admits() -> None:
    cfg = SchedulerConfig()
    pre = WorkerView(0, 256, 4, 256, 4, 1, role=Role.PREFILL)
    dec = WorkerView(1, 256, 4, 256, 4, 1, role=Role.DECODE)
    waiting = deque([Request("a", (1, 2, 3), SamplingParams(max_new_tokens=5))])
    assert plan_for_role(dec, waiting, deque(), cfg, 1.0, False, (pre,)).is_empty()
    decision = plan_for_role(pre, waiting, deque(), cfg, 1.0, False, (dec,))
    assert [r.request_id for r in decision.admit] == ["a"] and decision.decode_steps == 0
    assert effective_role(dec, ()) is Role.BOTH  # alone, it does both
    assert choose_target([pre, dec, WorkerView(2, 10, 4, 256, 4, 1, role=Role.DECODE)]) == 1


def test_requests_are_prefilled_on_one_worker_and_decoded_on_the_other() -> None:
    async def scenario() -> None:
        workers = [FakeWorker(0), FakeWorker(1)]
        p = with_roles(roles_config(decode_steps_per_call=4), workers)
        reqs = [p["table"].submit([1, 2, i + 3], {"max_new_tokens": 9}, LIMITS) for i in range(5)]
        await run_until_done(p, [r.request_id for r in reqs])
        for r in reqs:
            assert r.output_ids == expected(r.request_id, 9) and r.workers == [0, 1]
        assert all(plan.decode_steps == 0 and not plan.resume for plan in workers[0].calls)
        assert all(not plan.prefill for plan in workers[1].calls)
        c = p["counters"]
        assert c.handovers == 5 and c.retractions == 0 and c.handover_bytes > 0
        assert len(c.handover_latencies_s) == 5 and c.prefill_tokens_by_role == {"prefill": 15}

    asyncio.run(scenario())


def test_a_lost_decode_worker_leaves_the_prefill_worker_doing_both() -> None:
    async def scenario() -> None:
        workers = [FakeWorker(0), FakeWorker(1)]
        p = with_roles(roles_config(replace_failed_workers=False), workers)
        reqs = [p["table"].submit([1, 2, i + 3], {"max_new_tokens": 12}, LIMITS) for i in range(3)]
        pre, dec = p["fleet"].slots
        await p["dispatch"].execute(pre, p["dispatch"].decide(pre))  # prefill
        await p["dispatch"].execute(pre, p["dispatch"].decide(pre))  # hand over
        await p["dispatch"].execute(dec, p["dispatch"].decide(dec))  # restore + decode
        workers[1].dead = True
        await run_until_done(p, [r.request_id for r in reqs])
        for r in reqs:
            assert r.output_ids == expected(r.request_id, 12) and r.workers[-1] == 0
        assert p["counters"].worker_failures == 1

    asyncio.run(scenario())


def test_a_decode_worker_that_is_out_of_room_retracts_and_recomputes_go_to_the_prefill_worker() -> None:
    async def scenario() -> None:
        workers = [FakeWorker(0), FakeWorker(1, kv=40, slots=4)]
        p = with_roles(roles_config(retract="recompute", decode_steps_per_call=2), workers)
        reqs = [p["table"].submit([1, 2, i + 3], {"max_new_tokens": 16}, LIMITS) for i in range(3)]
        await run_until_done(p, [r.request_id for r in reqs])
        for r in reqs:
            assert r.output_ids == expected(r.request_id, 16)
        assert p["counters"].retractions_recompute > 0
        assert all(not plan.prefill for plan in workers[1].calls)  # recomputes prefilled on worker 0

    asyncio.run(scenario())


def test_a_prefill_worker_that_stood_in_hands_over_once_a_decode_worker_is_back() -> None:
    async def scenario() -> None:
        workers = [FakeWorker(0), FakeWorker(1)]
        p = with_roles(roles_config(replace_failed_workers=False), workers)
        pre, dec = p["fleet"].slots
        dec.alive = False  # lost: the prefill worker does both
        reqs = [p["table"].submit([1, 2, i + 3], {"max_new_tokens": 30}, LIMITS) for i in range(2)]
        await p["dispatch"].execute(pre, p["dispatch"].decide(pre))
        assert all(r.num_generated > 1 for r in reqs) and workers[0].calls[-1].decode_steps > 0
        dec.alive = True  # back (as a replacement would be)
        decision = p["dispatch"].decide(pre)
        assert decision.handovers == reqs and decision.decode_steps == 0
        await p["dispatch"].execute(pre, decision)
        await run_until_done(p, [r.request_id for r in reqs])
        for r in reqs:
            assert r.output_ids == expected(r.request_id, 30) and r.workers == [0, 1]

    asyncio.run(scenario())


def test_status_prints_each_workers_role_and_the_handover_figures(capsys) -> None:
    from raysched.cli import format_status

    workers = [{"worker": i, "node": f"node-{i}", "device": "cpu", "kv_tokens": 256, "state_slots": 4}
               for i in range(2)]
    stats = {"workers": [{"worker": 0, "role": "prefill", "free_tokens": 256, "free_slots": 4, "running": 0},
                         {"worker": 1, "role": "decode", "free_tokens": 200, "free_slots": 3, "running": 1}],
             "tables": {"waiting": 0, "running": 1, "retracted": 0, "snapshots_held": 0}, "uptime_s": 3.0,
             "workers_alive": 2, "handovers": 4, "handover_bytes": 160_000, "prefill_tokens_by_role": {"prefill": 90},
             "handover_latency_p50_s": 0.012, "handover_latency_p99_s": 0.05}
    format_status(workers, stats)
    out = capsys.readouterr().out
    assert "worker 0: role prefill" in out and "worker 1: role decode" in out
    assert "hand-overs 4" in out and "p50 12.0 ms" in out and "p99 50.0 ms" in out
