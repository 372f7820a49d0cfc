"""Live migration: pre-copied K/V blocks + a stop-and-copy continue bit-exactly elsewhere.

Data plane (no Ray): a request decodes on engine `a` while its completed K/V blocks are copied to
a reservation on engine `b` in stages; the stop-and-copy carries the last K/V, every recurrent
state tensor and the sampling state (`Snapshot.kv_from`); `b` continues. The reference is the
same requests run uninterrupted: tokens ==, logits torch.equal. Negative controls: a block
whose K/V is lost in transit, and blocks of another history (refused).

On a cluster (`TestOnCluster`): `client.migrate` while the request streams, each mid-migration
fault (docs/faults.md), finish/abort mid-copy, too many stages, and a drain under load.
"""

from __future__ import annotations

import dataclasses

import pytest
import ray  # noqa: F401  (the cluster tests)
import torch

from actors.engine import Engine, Sequence, build_engine
from actors.snapshot import SnapshotError
from raysched.sampling import SamplingParams

BT = 4  # tokens per block in these tests (prompts are short)
PROMPTS = [[5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 19, 300, 77, 2, 45, 18, 91, 23, 400, 6], [1, 2],
           list(range(40, 77))]
GREEDY = SamplingParams(max_new_tokens=24)
SAMPLED = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=1234)
MOVED = "r2"


def engine(**kw) -> Engine:
    return build_engine("tiny", device="cpu", record_logits=True, **{"kv_tokens": 512, "state_slots": 8, **kw})


def sequences(params: SamplingParams) -> list[Sequence]:
    return [Sequence(f"r{i}", list(p), len(p), dataclasses.replace(params, seed=params.seed + i))
            for i, p in enumerate(PROMPTS)]


def run_to_end(eng: Engine) -> None:
    while eng.running:
        eng.decode(1)


def uninterrupted(params: SamplingParams) -> Engine:
    eng = engine()
    eng.prefill(sequences(params))
    run_to_end(eng)
    return eng


def live_migrate(a: Engine, b: Engine, rid: str, decodes_between: tuple[int, ...], tamper=None) -> None:
    """Move `rid` from `a` to `b`: one pre-copy stage before each entry of `decodes_between`
    (then that many decode steps on `a`, the request going on), then the stop-and-copy."""
    seq = a.running[rid]
    assert b.reserve(rid, seq.num_cached + BT)
    sent = 0
    for steps in decodes_between:
        last = a.running[rid].num_cached // BT
        blocks = a.copy_blocks(rid, sent // BT, last, BT)
        assert b.receive_blocks(rid, tuple(blocks))
        sent = max(sent, last * BT)
        a.decode(steps)
    if tamper:
        tamper(b, rid)
    snap = a.copy_state(rid, sent)
    a.release(rid)
    assert snap.kv_from == sent > 0
    assert b.commit(snap)


def migrated(params: SamplingParams, tamper=None) -> tuple[Engine, Engine]:
    a = engine()
    a.prefill(sequences(params))
    a.decode(3)
    b = engine(kv_tokens=300, state_slots=3, page_size=4)
    b.prefill([Sequence("other", [9] * 50, 50, GREEDY)])
    live_migrate(a, b, MOVED, (2, 3, 1), tamper)
    run_to_end(a)
    run_to_end(b)
    return a, b


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_live_migration_continues_bit_exactly(params):
    ref = uninterrupted(params)
    a, b = migrated(params)
    got = a.logits[MOVED] + b.logits[MOVED]
    assert len(got) == len(ref.logits[MOVED])
    assert all(torch.equal(x, y) for x, y in zip(got, ref.logits[MOVED]))
    assert b.sequence(MOVED) is None and a.pool.is_empty()  # finished and freed on both sides
    assert not b.reserved and b.pool.owners() <= {"other"}


def _lose_first_block(eng: Engine, rid: str) -> None:
    slots = eng.pool.kv.token_slots(rid)[:BT]
    eng.pool.k[:, slots] = 0
    eng.pool.v[:, slots] = 0


def test_negative_control_a_block_lost_in_transit_changes_the_logits():
    ref = uninterrupted(GREEDY)
    a, b = migrated(GREEDY, tamper=_lose_first_block)
    got = a.logits[MOVED] + b.logits[MOVED]
    assert not all(torch.equal(x, y) for x, y in zip(got, ref.logits[MOVED]))


def test_blocks_of_another_history_are_refused_and_the_reservation_freed():
    a = engine()
    a.prefill(sequences(GREEDY))
    a.decode(2)
    b = engine()
    assert b.reserve(MOVED, 64)
    assert b.receive_blocks(MOVED, tuple(a.copy_blocks("r0", 0, 2, BT)))  # r0's K/V, under r3's name
    with pytest.raises(SnapshotError, match="another history"):
        b.commit(a.copy_state(MOVED, 2 * BT))
    assert MOVED in a.running  # the source still runs it
    with pytest.raises(SnapshotError, match="does not follow"):
        b.receive_blocks(MOVED, tuple(a.copy_blocks(MOVED, 3, 4, BT)))
    assert b.unreserve(MOVED) and not b.unreserve(MOVED)
    assert b.pool.is_empty() and not b.reserved


def test_a_full_destination_refuses_the_reservation_and_takes_nothing():
    b = engine(kv_tokens=64)
    assert not b.reserve("big", 65)
    assert b.pool.is_empty() and not b.reserved


# ---------------------------------------------------------------------------- on a cluster

import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import raysched  # noqa: E402
from raysched.config import load_serve_config  # noqa: E402
from tests.conftest import reference_tokens, wait_until  # noqa: E402

PROMPT = [(7 * i + 3) % 500 for i in range(120)]
CASES = {"greedy": {"max_new_tokens": 160}, "seeded": {"max_new_tokens": 160, "temperature": 0.8, "seed": 7}}


@contextmanager
def serving(migration: dict | None = None, faults: list | None = None, workers: int = 2,
            rebalance: dict | None = None) -> Iterator[raysched.Client]:
    client = raysched.launch(load_serve_config({
        "workers": workers, "pool": {"kv_tokens": 2048, "state_slots": 8}, "state_cache": {"enabled": False},
        "scheduler": {"decode_steps_per_call": 2, "rebalance": rebalance or {}}, "migration": migration or {},
        "faults": faults or []}))
    try:
        yield client
    finally:
        client.shutdown()


def reference(sampling: dict) -> list[int]:
    return reference_tokens("tiny", [PROMPT], [SamplingParams.from_dict(sampling)])[0]


def migrate_midway(client: raysched.Client, sampling: dict, after_tokens: int = 8) -> tuple[dict, dict]:
    """Submit, wait for `after_tokens` streamed tokens, migrate; (migrate result, request record)."""
    handle = client.submit(PROMPT, sampling, stream=True)  # read from its first token on
    stream = handle.stream()
    for _ in range(after_tokens):
        next(stream)
    moved = client.migrate(handle.request_id)
    return moved, handle.result()


def assert_clean(client: raysched.Client) -> None:
    wait_until(lambda: client.check_idle()["workers_idle"], 60, "every pool empty (reservations freed)")
    assert client.check_idle()["tables"]["requests"] == 0


def both(kind: str, **options) -> list[dict]:
    """The fault on both workers: only the one in the right role fires (placement decides which)."""
    return [{"kind": kind, "worker": w, "after_steps": 0, **options} for w in (0, 1)]


@pytest.mark.usefixtures("multinode_cluster")
class TestOnCluster:
    def test_live_migration_moves_a_streaming_request_exactly(self):
        with serving() as client:
            for name, sampling in CASES.items():
                moved, record = migrate_midway(client, sampling)
                assert moved["mode"] == "live" and moved["stages"] >= 1, moved
                assert moved["precopy_bytes"] > 0 and moved["final_bytes"] > 0, moved
                assert record["workers"] == [moved["from"], moved["to"]], (name, record["workers"])
                assert record["token_ids"] == reference(sampling), name
            stats = client.stats()
            assert stats["live_migrations"] == 2 and stats["migration_downtime_s"]["max"] > 0
            assert_clean(client)

    def test_too_many_stages_fall_back_to_one_snapshot_copy(self):
        with serving({"last_stage_tokens": 0, "max_stages": 2}) as client:
            moved, record = migrate_midway(client, CASES["seeded"])
            assert (moved["mode"], moved["stages"]) == ("snapshot", 2), moved
            assert record["token_ids"] == reference(CASES["seeded"])
            assert_clean(client)

    @pytest.mark.parametrize("faults, mode", [
        (both("refuse_migration"), "stayed"),
        (both("kill_migration_dest"), "stayed"),
        (both("kill_migration_source"), "recovered"),
        pytest.param(both("kill_migration_source", final=True), "recovered", marks=pytest.mark.slow),
        pytest.param(both("kill_migration_dest", final=True), "recovered", marks=pytest.mark.slow),
        pytest.param(both("kill_migration_source", stage=2), "recovered", marks=pytest.mark.slow),
        pytest.param(both("kill_migration_dest", stage=2), "stayed", marks=pytest.mark.slow),
    ], ids=["no-room", "dest-dies-stage-1", "source-dies-stage-1", "source-dies-final", "dest-dies-commit",
            "source-dies-stage-2", "dest-dies-stage-2"])
    def test_a_fault_mid_migration_loses_nothing(self, faults, mode):
        stage_2 = {"last_stage_tokens": 0, "max_stages": 3, "block_tokens": 1}  # every stage sends new tokens
        migration = stage_2 if faults[0].get("stage") == 2 else {}
        with serving(migration, faults) as client:
            moved, record = migrate_midway(client, CASES["seeded"])
            assert moved["mode"] == mode, moved
            assert record["state"] == "finished" and record["token_ids"] == reference(CASES["seeded"])
            fired = client.stats()["faults_fired"]
            assert len(fired) == 1 and fired[0]["requests"] == [record["request_id"]], fired
            assert_clean(client)

    def test_abort_mid_migration_ends_it_once_and_frees_the_reservation(self):
        """An abort sent once the migration is under way (the request is in the scheduler's
        `migrations_in_flight`) ends the request once: the migration reports `ended`, the
        request's record says aborted, the counters gain one abort and no finish, and every pool
        ends empty (the destination's reservation freed). Stages of one-token blocks keep the
        copy going over several calls; a try in which the copy still finished before the abort
        got there must end the same way (aborted once, nothing left), and is repeated, up to 5
        tries, until one lands mid-copy."""
        with serving({"last_stage_tokens": 0, "max_stages": 3, "block_tokens": 1}) as client:
            modes = []
            for _ in range(5):
                handle = client.submit(PROMPT, {"max_new_tokens": 1500})
                next(handle.stream())
                before = client.stats()
                moving = client.scheduler.migrate.remote(handle.request_id)
                while handle.request_id not in client.stats()["migrations_in_flight"]:
                    assert not ray.wait([moving], timeout=0)[0], ray.get(moving)  # it must start in flight
                handle.abort()
                modes.append(ray.get(moving, timeout=120)["mode"])
                assert handle.result()["state"] == "aborted", modes
                after = client.stats()
                assert (after["aborted"] - before["aborted"], after["finished"] - before["finished"]) == (1, 0)
                assert after["migrations_in_flight"] == []
                assert_clean(client)
                if modes[-1] == "ended":
                    break
            print(f"\nmigration modes per try: {modes}")
            assert modes[-1] == "ended", modes  # the abort landed mid-copy (others: it came after)
            assert set(modes) <= {"ended", "snapshot", "live"}, modes

    def test_migrating_a_request_that_is_not_running_is_one_clear_error(self):
        with serving() as client:
            with pytest.raises(Exception, match="is not running"):
                client.migrate("req-404")
            handle = client.submit(PROMPT, {"max_new_tokens": 40})
            next(handle.stream())
            with pytest.raises(Exception, match="worker must be one of"):
                client.migrate(handle.request_id, 9)
            handle.result()

    def test_drain_under_streaming_load_moves_everything_exactly(self):
        prompts = [[(11 * i + j) % 500 for j in range(60 + 20 * i)] for i in range(6)]
        sampling = [{"max_new_tokens": 120, "temperature": 0.7, "seed": i} if i % 2 else {"max_new_tokens": 120}
                    for i in range(6)]
        with serving() as client:
            handles = [client.submit(p, s) for p, s in zip(prompts, sampling)]
            streamed: dict[int, list[int]] = {}

            def read(i: int) -> None:
                streamed[i] = list(handles[i].stream())

            readers = [threading.Thread(target=read, args=(i,)) for i in range(6)]
            for t in readers:
                t.start()
            wait_until(lambda: client.stats()["workers"][0]["running"] > 0, 60, "requests on worker 0")
            drained = client.drain(0)
            assert client.stats()["workers"][0]["running"] == 0
            described = ray.get(client.scheduler.describe.remote())["workers"]
            assert [w["draining"] for w in described] == [True, False]  # what `raysched status` shows
            for t in readers:
                t.join(120)
            refs = reference_tokens("tiny", prompts, [SamplingParams.from_dict(s) for s in sampling])
            assert [streamed[i] for i in range(6)] == refs
            assert drained["moved"] >= 1 and drained["seconds"] > 0, drained
            assert_clean(client)

    def test_the_rebalancer_spreads_a_skewed_load_and_workers_come_and_go(self):
        prompts = [[(13 * i + j) % 500 for j in range(80)] for i in range(4)]
        sampling = [{"max_new_tokens": 300, "temperature": 0.7, "seed": i} for i in range(4)]
        with serving(rebalance={"enabled": True, "threshold": 0.05, "interval_s": 0.05}) as client:
            assert client.drain(1)["moved"] == 0  # empty: every request below lands on worker 0
            handles = [client.submit(p, s) for p, s in zip(prompts, sampling)]
            for h in handles:
                next(h.stream())
            client.undrain(1)
            results = [h.result() for h in handles]
            refs = reference_tokens("tiny", prompts, [SamplingParams.from_dict(s) for s in sampling])
            assert [r["token_ids"] for r in results] == refs
            stats = client.stats()
            assert stats["rebalance_moves"] >= 1 and stats["live_migrations"] >= 1, stats
            assert any(r["workers"][:2] == [0, 1] for r in results), [r["workers"] for r in results]
            client.remove_worker(1)  # its node's GPU is free again: the added worker lands there
            line = client.add_worker()
            assert line["worker"] == 2 and client.stats()["workers_alive"] == 2
            assert client.submit(prompts[0], sampling[0]).result()["token_ids"] == refs[0]
            assert_clean(client)


# ---------------------------------------------------------------------------- rebalance policy (pure)

from raysched.request import Request, State  # noqa: E402
from raysched.scheduler.planner import WorkerView  # noqa: E402
from raysched.scheduler.rebalance import pick_move, virtual_usage  # noqa: E402


def _view(index: int, requests: list[tuple[int, int, int]], total: int = 1000, free: int | None = None) -> WorkerView:
    """A worker running requests of (prompt tokens, generated, max_new_tokens)."""
    v = WorkerView(index, free if free is not None else total, 8, total, 8, 1)
    for i, (p, g, m) in enumerate(requests):
        r = Request(f"w{index}-{i}", tuple(range(p)), SamplingParams(max_new_tokens=m))
        r.output_ids, r.state = [1] * g, State.RUNNING
        v.running.append(r)
    return v


def test_virtual_usage_counts_the_tokens_still_to_come():
    assert virtual_usage(_view(0, [(100, 10, 300)])) == pytest.approx((109 + 290) / 1000)
    assert virtual_usage(_view(0, [(1, 1, 2)] * 4)) == 4 / 8  # slots scarcer than tokens


def test_pick_move_takes_the_request_with_most_to_come_from_heavy_to_light():
    heavy = _view(0, [(200, 5, 200), (100, 5, 400), (50, 5, 60)], free=400)
    light = _view(1, [(50, 5, 60)], free=900)
    move = pick_move([heavy, light], threshold=0.25)
    assert (move.request.request_id, move.src, move.dst) == ("w0-1", 0, 1)
    assert pick_move([heavy, light], threshold=0.25, busy={"w0-1"}).request.request_id == "w0-0"
    assert pick_move([heavy, light], threshold=0.25, queued=True) is None  # admission balances first


def test_pick_move_leaves_balanced_workers_and_lone_requests_alone():
    assert pick_move([_view(0, [(100, 5, 100)] * 2), _view(1, [(100, 5, 100)] * 2)], 0.1) is None
    assert pick_move([_view(0, [(300, 5, 600)]), _view(1, [])], 0.1) is None  # moving it only swaps
    assert pick_move([_view(0, [(100, 5, 400)] * 2), _view(1, [], free=50)], 0.1) is None  # no room there
    assert pick_move([_view(0, [(100, 5, 400)] * 2)], 0.1) is None


def test_pick_move_never_sends_a_decoding_request_to_a_prefill_worker():
    from raysched.scheduler.roles import Role

    heavy = _view(0, [(200, 5, 200), (100, 5, 400), (50, 5, 60)], free=400)
    light = _view(1, [], free=900)
    assert pick_move([heavy, light], threshold=0.25).dst == 1  # control: both decode, it moves
    heavy.role, light.role = Role.DECODE, Role.PREFILL
    assert pick_move([heavy, light], threshold=0.25) is None
    third = _view(2, [], free=900)
    third.role = Role.DECODE
    assert pick_move([heavy, light, third], threshold=0.25).dst == 2  # the decode peer takes it


def test_the_rebalancer_is_on_by_default():
    from raysched.config import ServeConfig

    assert ServeConfig.from_dict({"model": "tiny"}).scheduler.rebalance.enabled
    assert not ServeConfig.from_dict({"model": "tiny", "scheduler": {"rebalance": {"enabled": False}}}
                                     ).scheduler.rebalance.enabled
