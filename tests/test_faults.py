"""Faults: every accepted request finishes exactly once with the tokens it would have had anyway.

Workers are killed at chosen moments through the `faults:` config: between calls (prefill,
decode, during and right after a retraction, while a resume is in flight) and inside calls (the
worker's process exits in the middle of a step after k decode steps, of a pipelined step, of a
retract after the gather, of a restore, including a resume from another node); a whole node is
removed while snapshots it produced wait to resume, the scheduler itself is killed, a snapshot is
corrupted, and the object store is put under pressure. Faults do not change scheduling
(pipelining stays on). After each run: all requests finished, tokens identical to the
uninterrupted in-process reference, replacement workers started, pools and tables empty.
The scenario table with results is in docs/faults.md.

The cluster (`ray.cluster_utils.Cluster`): a head with 1 CPU (driver and scheduler) and three
nodes with 1 CPU and 1 fake GPU each. A worker asks for one GPU when the cluster has GPUs, so
each worker sits on its own node and one node is spare for a replacement. Torch sees no CUDA,
so the workers run on the CPU. Each scenario launches its own scheduler on that cluster.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import ray

import raysched
from raysched.client import SchedulerDiedError
from raysched.messages import StepResult, Usage
from raysched.scheduler.planner import Decision
from raysched.request import State
from raysched.runner import run_workload
from raysched.sampling import SamplingParams
from raysched.workload import RequestSpec
from tests.conftest import local_cluster, wait_until
from tests.exactness import (assert_exactly_once, assert_idle, bare_scheduler, reference, scheduler_log, serving,
                              synthetic)

NODE_STORE_BYTES = 100 << 20
POOL = {"kv_tokens": 160, "state_slots": 4}  # small: 20 requests overflow two workers
REPLACEMENT_TIMEOUT_S = 240  # the scheduler gives a replacement 180 s to start
SCHEDULER_RSS_LIMIT_MIB = 150


def kill(worker: int, after: int, kind: str = "kill_worker", **options: Any) -> dict:
    return {"kind": kind, "worker": worker, "after_steps": after, **options}


@pytest.fixture(scope="class")
def cluster() -> Iterator[Any]:
    """Head + 3 one-GPU nodes: one spare node for replacement workers."""
    with local_cluster(gpu_nodes=3, store_bytes=NODE_STORE_BYTES) as c:
        yield c


def config(scheduler: dict | None = None, faults: list | None = None, workers: int = 2, **extra) -> dict:
    return {"workers": workers, "pool": POOL, "scheduler": {"decode_steps_per_call": 4, **(scheduler or {})},
            "faults": faults or [], **extra}


def wait_for_replacements(client: raysched.Client, count: int) -> dict:
    wait_until(lambda: client.stats()["workers_replaced"] >= count, REPLACEMENT_TIMEOUT_S,
               f"{count} replacement worker(s)")
    return client.stats()


# ---------------------------------------------------------------------------- scenarios

class Scenario(NamedTuple):
    scheduler: dict  # overrides of the scheduler section
    faults: list
    seed: int  # of the workload
    pool: dict = POOL
    requests: int = 20
    tokens: tuple[int, int] = (24, 48)  # max_new_tokens of each request (range)


ROOMY = {"kv_tokens": 2048, "state_slots": 8}  # nothing waits: pure-decode calls run their successors


def halves(requests: int) -> dict:
    """A roomy pool with slots for half the requests: nothing waits, and each worker runs half of
    them whichever decides first (with room for all, one worker could take every request and the
    one a fault names none, so that the fault never fires: seen in CI)."""
    return {"kv_tokens": 2048, "state_slots": requests // 2}
PIPELINED = {"fold_successor": False}  # a successor is a second call, sent before the first returns


def one_worker_killed_in_a_long_call(specs: list[RequestSpec], scheduler: dict, faults: list) -> dict:
    """`specs` on one roomy worker with prefix reuse off (so its long calls take joins) and
    `faults`: every request ends once with the reference's tokens, the dead worker is replaced,
    no pool or table holds anything. Returns the scheduler's stats."""
    with serving(config(scheduler, faults, workers=1, pool=ROOMY, state_cache={"enabled": False})) as client:
        report = run_workload(client, specs, progress=False)
        assert_exactly_once(report, specs)
        stats = wait_for_replacements(client, 1)
        assert_idle(client.check_idle())
    return stats

SCENARIOS = {
    # between calls: the scheduler kills the worker actor before the call numbered after_steps
    "prefill": Scenario({}, [kill(0, 0)], 1),  # dies on its very first call: the first prefill
    "first-decode": Scenario({}, [kill(1, 1)], 2),
    "decode-7": Scenario({}, [kill(1, 7)], 4),
    "during-retraction": Scenario({"force_retract_every": 2}, [kill(0, 2)], 5),  # call 2 retracts: the snapshot is never taken
    "after-retraction": Scenario({"force_retract_every": 2}, [kill(1, 3)], 6),  # call 2's snapshot waits elsewhere
    "resume-in-flight": Scenario({"force_retract_every": 1}, [kill(0, 4)], 7),  # every call from the 2nd resumes one
    "both-workers": Scenario({"force_retract_every": 3}, [kill(0, 2), kill(1, 6)], 8),
    "recompute-mode": Scenario({"retract": "recompute", "force_retract_every": 2}, [kill(1, 3)], 9),
    # a tight snapshot budget mixes both retraction modes on the same requests before the kill
    "mixed-modes": Scenario({"force_retract_every": 1, "snapshot_budget_bytes": 60_000}, [kill(0, 6)], 20),
    "node-fault": Scenario({"force_retract_every": 2}, [kill(1, 4, "remove_node")], 11),
    # inside calls: the worker's process exits at a point the step plan / retract call names
    "in-step-before-decode": Scenario({}, [kill(0, 0, "kill_in_step", after_decode_steps=0)], 21),  # after its prefill
    "in-step-after-2-decodes": Scenario({}, [kill(1, 3, "kill_in_step", after_decode_steps=2)], 22),
    "in-pipelined-step": Scenario(PIPELINED, [kill(0, 2, "kill_in_step", after_decode_steps=1, pipelined=True)], 23,
                                  pool=halves(8), requests=8),
    "in-pipelined-step-pressure": Scenario(  # KV pressure later: the pipelined call dies, then victims
        PIPELINED, [kill(1, 2, "kill_in_step", after_decode_steps=3, pipelined=True)], 24,
        pool={"kv_tokens": 320, "state_slots": 8}, requests=10),
    # a folded call runs 2 x 4 decode steps: dies after 6, past where an unfolded call ends
    "in-folded-step": Scenario({"fold_calls": 2}, [kill(1, 2, "kill_in_step", after_decode_steps=6, folded=True)], 30,
                               pool=halves(8), requests=8),
    # a long call (up to `fold_calls` 8 x 4 steps; the scenarios run without rebalancing, whose
    # moves would keep calls short) dies after 12 of its steps, past where a call folding one
    # successor ends (8); its requests want 50-70 tokens, so each of the worker's three is still
    # decoding 12 steps into its third call (after a prefill call and a long call of at most 32
    # steps), whatever ends a call early
    "in-long-call": Scenario({"fold_calls": 8}, [kill(0, 2, "kill_in_step", after_decode_steps=12, folded=True)], 31,
                             pool=halves(6), requests=6, tokens=(50, 70)),
    "in-retract": Scenario({"force_retract_every": 2}, [kill(0, 2, "kill_in_retract")], 25),
    "in-retract-mixed-modes": Scenario({"force_retract_every": 1, "snapshot_budget_bytes": 60_000},
                                       [kill(1, 5, "kill_in_retract")], 26),
    "in-restore": Scenario({"force_retract_every": 1}, [kill(0, 2, "kill_in_restore")], 27),
    "in-restore-cross-node": Scenario({"force_retract_every": 1}, [kill(1, 2, "kill_in_restore", cross_node=True)], 28),
    "in-step-and-in-restore": Scenario({"force_retract_every": 2},
                                       [kill(0, 3, "kill_in_step", after_decode_steps=1),
                                        kill(1, 4, "kill_in_restore")], 29),
}
SLOW_SCENARIOS = {  # combinations of stages the default suite covers one at a time (`pytest -m slow`)
    "decode-7", "both-workers", "recompute-mode", "mixed-modes", "in-step-after-2-decodes",
    "in-pipelined-step-pressure", "in-retract-mixed-modes", "in-step-and-in-restore"}
IN_CALL = ("kill_in_step", "kill_in_retract", "kill_in_restore")


@pytest.mark.usefixtures("cluster")
class TestOnCluster:
    @pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SCENARIOS else n
                                      for n in SCENARIOS])
    def test_killed_worker_loses_no_request_and_no_token(self, name):
        case = SCENARIOS[name]
        specs = synthetic(case.seed, requests=case.requests, max_new_tokens=case.tokens)
        # No rebalancing: its moves (on by default) take requests off a worker at moments no
        # scenario schedules, so a kill could meet a worker that had just handed its only requests
        # over (seen once in CI: `recovered` 0). Kills mid-migration: `tests/test_migration.py`.
        scheduler = {"rebalance": {"enabled": False}, **case.scheduler}
        with serving(config(scheduler, case.faults, pool=case.pool)) as client:
            report = run_workload(client, specs, progress=False)
            assert_exactly_once(report, specs)
            summary = report["summary"]
            assert summary["worker_failures"] == len(case.faults), summary
            assert summary["recovered"] >= 1, summary
            stats = wait_for_replacements(client, len(case.faults))
            assert stats["workers_alive"] == 2
            assert_idle(client.check_idle())  # the replacements' pools too
        def key(f: dict) -> tuple:
            return f["kind"], f["worker"]

        fired = sorted(stats["faults_fired"], key=key)  # in the order they fired, which timing decides
        assert [key(f) for f in fired] == sorted(map(key, case.faults)), fired
        for spec, record in zip(sorted(case.faults, key=key), fired):
            assert record["call"] >= spec["after_steps"]
            if spec.get("pipelined"):
                assert record["pipelined"] is True, record
            if spec.get("folded"):  # one successor (8 steps), or a long call (more)
                long = case.scheduler.get("fold_calls", 64) > 2
                assert record["folded"] is True and (record["decode_steps"] > 8 if long else record["decode_steps"] == 8), record
            if spec["kind"] == "kill_in_step":
                assert record["decode_steps"] >= spec.get("after_decode_steps", 0), record  # died inside it
            if spec.get("cross_node"):
                assert record["cross_node"] is True, record
        print(f"\nfault scenario {name}: fired {[(f['kind'], f['worker'], f['call'], f['pipelined']) for f in fired]}; "
              f"{summary['finished']}/{summary['requests']} finished with reference tokens, "
              f"worker failures {summary['worker_failures']}, recovered {summary['recovered']}, retractions "
              f"{summary['retractions']}, migrations {summary['migrations']} ({summary['cross_node_migrations']} "
              f"cross-node), pipelined calls {stats['pipelined_calls']}, folded {stats['folded_calls']}, replaced {stats['workers_replaced']}")

    @pytest.mark.parametrize("notices", [True, False], ids=["notices", "control-calls-end-at-a-finish"])
    def test_a_worker_killed_in_a_long_call_with_finish_notices_loses_no_token(self, notices):
        """One worker runs two long and two shorter requests; its long call (8 x 4 steps, joins
        on: prefix reuse off) dies after 24 decode steps, whose tokens never leave it (the fault
        runs them). Its requests are recovered (any sent to join it and not taken are queued
        again), and every request ends once with the reference's tokens. The shorter ones need
        more tokens than their first call on the replacement (a recompute or a first prefill)
        gives, so they finish inside a later call, a long one, which goes on past their finish
        and sends finish notices. Control: without notices no long call goes on past a finish,
        none are sent, the same tokens. (Shorter requests that could finish in that first call,
        8 and 10 tokens, made the notices depend on timing.)"""
        specs = [RequestSpec(f"r{i}", tuple(range(3 + i, 11 + i)),
                             SamplingParams(max_new_tokens=n, temperature=0.8 if i % 2 else 0.0, seed=5))
                 for i, n in enumerate((60, 64, 24, 28))]
        faults = [kill(0, 2, "kill_in_step", after_decode_steps=24, folded=True)]
        scheduler = {"fold_calls": 8, "finish_notices": notices, "rebalance": {"enabled": False}}
        stats = one_worker_killed_in_a_long_call(specs, scheduler, faults)
        assert stats["worker_failures"] == 1 and stats["recovered"] >= 2, stats
        fired = stats["faults_fired"][0]
        assert fired["folded"] and fired["decode_steps"] >= (24 if notices else 8), fired
        assert (stats["finish_notices"] >= 1) if notices else (stats["finish_notices"] == 0), stats["finish_notices"]
        print(f"\nnotices {notices}: recovered {stats['recovered']}, finish notices {stats['finish_notices']}")

    def test_a_worker_killed_with_a_joined_prompt_half_fed_loses_no_token(self):
        """One worker runs two long requests in a folded call (joins on: prefix reuse off); two
        requests whose prompts span six 32-token chunks arrive while it runs and join it
        (`join_after_ms` 0), fed a chunk a step (`Worker._take_joins`); the worker dies right
        after a chunk of one of them while the rest of its prompt is unfed (`kill_in_join`).
        Every request ends once with the reference's tokens (the joined ones prefilled again from
        their prompts on the replacement), and no slot or table entry is left."""
        long = [RequestSpec(f"long{i}", tuple(range(3 + i, 11 + i)),
                            SamplingParams(max_new_tokens=400, temperature=0.8 if i else 0.0, seed=5))
                for i in range(2)]
        joiners = [RequestSpec(f"join{i}", tuple((7 * k + i) % 97 for k in range(5 * 32 + 3)),
                               SamplingParams(max_new_tokens=12, temperature=0.8 if i else 0.0, seed=5), 0.15)
                   for i in range(2)]
        specs = long + joiners
        scheduler = {"fold_calls": 64, "join_after_ms": 0, "prefill_chunk_tokens": 32, "prefill_budget_tokens": 32,
                     "rebalance": {"enabled": False}}
        faults = [kill(0, 1, "kill_in_join")]
        stats = one_worker_killed_in_a_long_call(specs, scheduler, faults)
        assert stats["worker_failures"] == 1 and stats["joins"] >= 1, stats
        fired = stats["faults_fired"][0]
        assert fired["kind"] == "kill_in_join" and fired["folded"], fired
        print(f"\njoined prompt half fed: joins {stats['joins']}, recovered {stats['recovered']}")

    def test_without_replacement_the_survivor_finishes_everything(self):
        specs = synthetic(12, requests=16)
        with serving(config({"replace_failed_workers": False, "force_retract_every": 2}, [kill(1, 2)])) as client:
            report = run_workload(client, specs, progress=False)
            assert_exactly_once(report, specs)
            stats = client.stats()
            assert (stats["worker_failures"], stats["workers_replaced"], stats["workers_alive"]) == (1, 0, 1)
            assert_idle(client.check_idle())

    def test_corrupted_snapshot_is_refused_recomputed_and_logged(self):
        specs = synthetic(13, requests=12)
        faults = [{"kind": "corrupt_snapshot", "worker": 0, "after_steps": 1}]
        with serving(config({"force_retract_every": 1}, faults)) as client:
            report = run_workload(client, specs, progress=False)
            assert_exactly_once(report, specs)
            summary = report["summary"]
            assert summary["snapshots_refused"] == 1 and summary["worker_failures"] == 0, summary
            assert_idle(summary["idle_after"])
            log = scheduler_log(client)
        assert "corrupt_snapshot sent to worker 0 retracting" in log
        assert "refused on worker" in log and "checksum mismatch" in log and "recomputing it instead" in log

    def test_snapshot_budget_falls_back_to_recompute_under_store_pressure(self):
        # One tiny-preset snapshot is 35-45 KB: the budget holds one at a time, far less than
        # the retracted requests would need, so the rest are retracted by recompute.
        specs = synthetic(14, requests=20, max_new_tokens=(24, 48))
        with serving(config({"force_retract_every": 1, "snapshot_budget_bytes": 60_000})) as client:
            report = run_workload(client, specs, progress=False)
            assert_exactly_once(report, specs)
            s = report["summary"]
            stats = client.stats()
            print(f"\nbudget 60 kB: {s['retractions_snapshot']} snapshot retractions, "
                  f"{stats['store_pressure_fallbacks']} fell back to recompute")
            assert stats["store_pressure_fallbacks"] > 0 and s["retractions_snapshot"] > 0, stats
            assert s["retractions_recompute"] == stats["store_pressure_fallbacks"]
            assert s["snapshot_bytes"] > 60_000  # what went through the store, a snapshot at a time
            assert_idle(s["idle_after"])

    def test_max_retractions_stops_the_victim_order_from_starving_a_request(self):
        """One worker, one victim per call. fewest_generated picks, among equals, the longest
        prompt: the long request (submitted last) is picked, resumes one call later behind the
        others, so it has the fewest tokens again and is picked again. With max_retractions 3
        it is protected after three; with 1000 it is picked about every other call."""
        short = synthetic(15, requests=7, prompt_len=(6, 10), max_new_tokens=(40, 40), sampled_fraction=0)
        long = synthetic(16, requests=1, prompt_len=(120, 120), max_new_tokens=(40, 40), sampled_fraction=0)
        specs = short + [RequestSpec("long", long[0].prompt_ids, long[0].sampling)]
        counts = {}
        for cap in (3, 1000):
            sched = {"force_retract_every": 1, "max_retractions": cap, "victim_order": "fewest_generated"}
            with serving(config(sched, workers=1, pool={"kv_tokens": 512, "state_slots": 8})) as client:
                report = run_workload(client, specs, progress=False)
                assert_exactly_once(report, specs)
                assert_idle(report["summary"]["idle_after"])
            counts[cap] = {r["request_id"]: r["retractions"] for r in report["requests"]}
        print(f"\nretractions per request: max_retractions 3 -> {counts[3]}; 1000 -> {counts[1000]}")
        assert max(counts[3].values()) <= 3 and counts[3]["long"] <= 3
        unbounded = counts[1000]
        assert unbounded["long"] == max(unbounded.values()), unbounded
        assert unbounded["long"] >= 2 * 3, unbounded  # picked again and again, far past the cap

    def test_scheduler_death_fails_pending_requests_promptly(self):
        raw = config(pool={"kv_tokens": 4096, "state_slots": 8})
        specs = synthetic(17, requests=4, max_new_tokens=(3000, 3000), sampled_fraction=0)
        with serving(raw) as client:
            handles = [client.submit([1, 2, 3, i], {"max_new_tokens": 3000}) for i in range(3)]
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                run = pool.submit(run_workload, client, specs, False)
                wait_until(lambda: client.stats()["submitted"] == 7 and client.stats()["tokens"] > 0,
                           30, "the workload to start decoding")
                killed_at = time.monotonic()
                ray.kill(client.scheduler)
                with pytest.raises(SchedulerDiedError):
                    handles[0].result(timeout=10)
                with pytest.raises(SchedulerDiedError):
                    run.result(timeout=10)
                elapsed = time.monotonic() - killed_at
            for h in handles[1:]:
                with pytest.raises(SchedulerDiedError):
                    h.result(timeout=10)
        # "promptly": each result() above raised SchedulerDiedError, not a timeout of its own
        print(f"\nscheduler death noticed by result() and run_workload in {elapsed:.2f} s")

    def test_removed_node_loses_no_waiting_snapshot(self, cluster):
        """The node does not come back: the tests after it run on the nodes left.

        Long requests on small pools: decode overflows and victims wait, snapshotted, for room.
        Once one worker has produced at least two snapshots that still wait, its node is removed
        (a crash, not a drain). Those snapshots lay in the removed node's object store: a resume
        that reads one reports it lost and the request is recomputed from its token history,
        without blaming (retiring) the worker that tried, so there is exactly one failure.
        """
        specs = synthetic(18, requests=24, prompt_len=(16, 40), max_new_tokens=(60, 100))
        with serving(config(pool={"kv_tokens": 160, "state_slots": 4})) as client:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                run = pool.submit(run_workload, client, specs, False)
                waiting: dict[int, int] = {}

                def snapshots_wait() -> bool:
                    waiting.update(_waiting_snapshots_by_producer(client))
                    return run.done() or max(waiting.values(), default=0) >= 2

                wait_until(snapshots_wait, 60, "two waiting snapshots from one worker")
                assert not run.done(), "the workload ended before snapshots waited"
                tables = client.stats()["tables"]
                producer = max(waiting, key=waiting.get)
                victim_node = client.workers[producer]["node"]
                node = next(n for n in cluster.list_all_nodes() if n.node_id == victim_node)
                cluster.remove_node(node, allow_graceful=False)
                report = run.result(timeout=120)
            assert tables["retracted"] > 0 and tables["snapshots_held"] > 0, tables
            assert_exactly_once(report, specs)
            s = report["summary"]
            assert s["worker_failures"] == 1 and s["snapshots_refused"] == 0, s
            print(f"\nnode removed: {s['snapshots_lost']} waiting snapshot(s) lost and recomputed")
            wait_for_replacements(client, 1)  # on the spare node: the removed one is gone
            assert_idle(client.check_idle())
        # The tests after this one start actors (a reader's sink needs no resource): until Ray's
        # health check marks the killed node dead, it may place one there, and that actor dies
        # unstarted (seen in CI). Leave once the cluster knows the node is gone.
        wait_until(lambda: not any(n["NodeID"] == victim_node and n["Alive"] for n in ray.nodes()), 120,
                   "Ray to mark the removed node dead")


    @pytest.mark.slow
    def test_killed_scheduler_is_restarted_and_run_completes_every_request_once(self):
        """kill_scheduler: the scheduler's process exits mid-run (its workers die with it, their
        owner). Ray restarts it; `run_workload` (what `raysched run` runs) resubmits the pending
        requests, the restarted scheduler starts new workers and completes each of them once.
        Under `slow`: the default suite kills the scheduler under `raysched run` itself
        (`test_cli_run.py::test_run_survives_the_death_of_its_scheduler`) and under streams (below)."""
        specs = synthetic(31, requests=20, max_new_tokens=(24, 48))
        with serving(config({"force_retract_every": 2}, [kill(0, 6, "kill_scheduler")])) as client:
            report = run_workload(client, specs, progress=False)
            assert_exactly_once(report, specs)
            s = report["summary"]
            assert s["scheduler_restarted"] is True and s["resubmitted"] > 0, s
            stats = client.stats()
            assert stats["workers_alive"] == 2 and stats["faults_fired"] == [], stats  # not fired again
            assert_idle(client.check_idle())
        print(f"\nscheduler killed and restarted: {s['resubmitted']} of {len(specs)} requests resubmitted, "
              f"all finished once with reference tokens")

    def test_streams_keep_their_tokens_across_a_scheduler_restart(self):
        """Streaming clients keep the tokens they received; after the restart each request is
        resubmitted with them and continues where it was: every token arrives exactly once and
        the streams equal the uninterrupted reference.

        The kill comes after worker 1's 8th step. A request on the other worker may finish
        before it (seen once in CI: 5 of 6 resubmitted), and is rightly not resubmitted; so the
        check is that the restarted scheduler got nothing but resubmissions (its stream still
        equals the reference, as every other)."""
        specs = synthetic(32, requests=6, max_new_tokens=(60, 80))
        # short calls: worker 1's 8th call comes long before the answers end (with long calls
        # it once came after them, and the scheduler was never killed: seen in a fresh clone's CI)
        with serving(config({"fold_calls": 2}, [kill(1, 8, "kill_scheduler")])) as client:
            handles = [client.submit(list(s.prompt_ids), s.sampling, s.request_id, stream=True) for s in specs]
            with concurrent.futures.ThreadPoolExecutor(len(handles)) as pool:
                streams = list(pool.map(lambda h: list(h.stream()), handles))
            stats = client.stats()
            assert_idle(client.check_idle())
        want = reference(specs)
        assert streams == [want[s.request_id] for s in specs]
        assert stats["scheduler_restarted"] is True, stats
        assert 0 < stats["resubmitted"] == stats["submitted"] <= len(specs), stats
        assert stats["resubmitted_tokens"] > 0, stats  # they resumed from what they had received
        print(f"\nstreams across a scheduler restart: {stats['resubmitted_tokens']} tokens carried over by "
              f"{stats['resubmitted']} resubmitted requests")

    def test_scheduler_process_never_loads_torch_or_the_data_plane(self):
        """Snapshots pass through the scheduler (it re-owns them) as torch-free messages, and the
        worker class it starts imports the data plane in the worker's process only."""
        specs = synthetic(30, requests=24)
        with serving(config({"force_retract_every": 1})) as client:
            report = run_workload(client, specs, progress=False)
            stats = client.stats(detail=True)
            loaded = ray.get(client.scheduler.__ray_call__.remote(
                lambda _self: sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "actors"))))
        assert_exactly_once(report, specs)
        assert stats["retractions_snapshot"] > 0 and stats["resumes_snapshot"] > 0, stats
        assert loaded == [] and stats["scheduler_torch_loaded"] is False, loaded
        rss_mib = stats["scheduler_rss_bytes"] / 2**20
        print(f"\nscheduler RSS after {len(specs)} requests: {rss_mib:.0f} MiB")
        assert rss_mib < SCHEDULER_RSS_LIMIT_MIB


def _waiting_snapshots_by_producer(client: raysched.Client) -> dict[int, int]:
    """worker index -> snapshots it took that wait (retracted, not resumed yet), read from the
    scheduler actor's own tables."""
    def count(sched: Any) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in sched.retracted:
            if r.snapshot_ref is not None:
                out[r.workers[-1]] = out.get(r.workers[-1], 0) + 1
        return out

    return ray.get(client.scheduler.__ray_call__.remote(count))


# ---------------------------------------------------------------------------- small object store


@pytest.mark.slow
def test_a_snapshot_every_call_through_a_small_store_loses_nothing():
    """A local Ray with an 80 MiB store; prompts of several hundred tokens, retracted every call:
    every snapshot is put, fetched across workers and freed, and nothing is lost. (The `tiny`
    snapshots never fill this store; spilling under real pressure is `tests/test_store_pressure.py`,
    marker `slow`.) Under `slow`: the default suite retracts every call in the `resume-in-flight`,
    `in-restore` and `in-restore-cross-node` kill scenarios."""
    specs = synthetic(19, requests=16, prompt_len=(200, 500), max_new_tokens=(16, 32))
    raw = config({"force_retract_every": 1}, pool={"kv_tokens": 2048, "state_slots": 6},
                 object_store_memory=80 << 20)
    with serving(raw) as client:
        report = run_workload(client, specs, progress=False)
        stats = client.stats(detail=True)
    assert_exactly_once(report, specs)
    assert_idle(report["summary"]["idle_after"])
    assert stats["retractions_snapshot"] > 0
    assert "object_store_spilled_mib" in stats
    print(f"\nsmall store: {stats['retractions_snapshot']} snapshots, {stats['snapshot_bytes'] / 2**20:.1f} MiB "
          f"through the store, spilled {stats['object_store_spilled_mib']} MiB, "
          f"fallbacks {stats['store_pressure_fallbacks']}")


# ---------------------------------------------------------------------------- scheduler, in process


def test_worker_shell_forwards_every_public_method_of_the_data_plane_worker():
    """`raysched.workers.Worker` (the class the scheduler starts) hands each call to
    `actors.worker.Worker`: they must offer the same methods, or a call would fail on a cluster."""
    import inspect

    from actors.worker import Worker as DataPlaneWorker
    from raysched.workers import Worker as Shell

    def public(cls: type) -> dict[str, list[str]]:
        # (`ray.remote` on a class, which other tests do in this process, adds `_ray_trace_ctx`)
        return {name: [p for p in inspect.signature(fn).parameters if not p.startswith("_ray")]
                for name, fn in vars(cls).items() if callable(fn) and not name.startswith("_")}

    assert public(Shell) == public(DataPlaneWorker)


def test_request_aborted_during_a_failed_call_stays_aborted():
    async def scenario() -> None:
        sched, w = bare_scheduler()
        ids = [await sched.submit([1, 2, 3 + i], {"max_new_tokens": 8}) for i in range(2)]
        plan = sched.dispatch.decide(w)
        sched.dispatch.mark_running(w, plan.admit)
        assert await sched.abort(ids[0])
        sched.dispatch.apply(w, plan, ray.exceptions.ActorDiedError(), [])  # the in-flight call failed
        assert sched.requests[ids[0]].state is State.ABORTED
        # the other one never produced a token: it waits to be admitted afresh
        assert [r.request_id for r in sched.waiting] == [ids[1]] and not sched.retracted
        assert sched.counters.recovered == 1

    asyncio.run(scenario())


def test_request_aborted_while_not_admitted_stays_aborted():
    async def scenario() -> None:
        sched, w = bare_scheduler()
        ids = [await sched.submit([1, 2, 3 + i], {"max_new_tokens": 8}) for i in range(2)]
        plan = sched.dispatch.decide(w)
        sched.dispatch.mark_running(w, plan.admit)
        assert await sched.abort(ids[0])
        result = StepResult(not_admitted=[ids[0]], usage=Usage(256, 256, 4, 4, 1))
        sched.dispatch.apply(w, plan, result, [])
        assert sched.requests[ids[0]].state is State.ABORTED
        assert not sched.waiting and not sched.retracted
        record = await sched.wait(ids[0])  # the client collects it; a late result must not crash
        assert record["state"] == "aborted"
        sched.dispatch.apply(w, plan, StepResult(not_admitted=[ids[0]], resume_failed={ids[0]: "late"},
                                             usage=Usage(256, 256, 4, 4, 1)), [])
        assert not sched.waiting and not sched.retracted

    asyncio.run(scenario())


def test_snapshot_retraction_after_a_recompute_resumes_from_the_snapshot():
    """A request once recomputed and later retracted by snapshot must resume from that snapshot:
    a stale `recompute` flag would prefill it instead and leave the snapshot pinned, and a worker
    failure after that would resume it from the stale snapshot (tokens emitted twice)."""
    async def scenario() -> None:
        sched, w = bare_scheduler()
        sched.ledger.budget_bytes = 1 << 30
        rid = await sched.submit([1, 2, 3], {"max_new_tokens": 8})
        plan = sched.dispatch.decide(w)
        sched.dispatch.mark_running(w, plan.admit)
        req = sched.requests[rid]
        req.recompute = True  # as after an earlier retraction by recompute (store pressure)
        snap, drop = sched.ledger.take_victims(w, Decision(victims=[req]))
        assert (snap, drop) == ([req], [])
        assert req.recompute is False
        assert (sched.counters.retractions_snapshot, sched.counters.retractions_recompute) == (1, 0)

    asyncio.run(scenario())


def test_lost_snapshot_is_recomputed_without_blaming_the_worker():
    """A resume whose snapshot object is gone (its node died) comes back in `resume_failed` with
    the SNAPSHOT_LOST reason: the request is recomputed, counted lost (not refused), and the
    worker that tried stays alive."""
    from raysched.messages import SNAPSHOT_LOST

    async def scenario() -> None:
        sched, w = bare_scheduler()
        rid = await sched.submit([1, 2, 3], {"max_new_tokens": 8})
        req = sched.requests[rid]
        sched.waiting.clear()
        req.state, req.retractions, req.snapshot_ref = State.RETRACTED, 1, object()
        sched.retracted.append(req)
        plan = sched.dispatch.decide(w)
        assert plan.resume == [req]
        sched.dispatch.mark_running(w, plan.resume)
        result = StepResult(resume_failed={rid: f"{SNAPSHOT_LOST}: ObjectLostError"},
                            usage=Usage(256, 256, 4, 4, 1))
        sched.dispatch.apply(w, plan, result, [req])
        assert list(sched.retracted) == [req] and req.recompute and req.snapshot_ref is None
        assert (sched.counters.snapshots_lost, sched.counters.snapshots_refused, sched.counters.recovered) == (1, 0, 1)
        assert w.alive and sched.counters.worker_failures == 0

    asyncio.run(scenario())
def test_client_used_after_shutdown_raises_at_once():
    """Before: `submit` after `shutdown` re-initialised Ray on its own, attached to a stale cluster
    and hung. Now every call of a closed client raises ClientClosedError without touching Ray."""
    from raysched.client import Client, ClientClosedError
    from raysched.config import ServeConfig

    client = Client(object(), ServeConfig(), [], owns_ray=False, owns_scheduler=False)
    client.shutdown()
    client.shutdown()  # a second shutdown does nothing
    for call in (lambda: client.submit([1, 2, 3]), client.stats, client.check_idle, client.timeline):
        with pytest.raises(ClientClosedError, match="was shut down"):
            call()
    assert not ray.is_initialized()
