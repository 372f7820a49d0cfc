"""Serving on a 3-node Ray cluster with pools so small that requests must be retracted.

Every request's tokens must equal the in-process reference (`Engine.generate`, never retracted),
whichever way it was retracted (snapshot, recompute, auto), however often, and wherever it
resumed. Afterwards every pool, every scheduler table and the scheduler's object references are
empty. Negative controls show that the checks can fail: dropping the Mamba state on resume
changes tokens, and a snapshot reference kept back is seen as a leak.

One cluster serves the whole module; each test launches (and shuts down) its own scheduler.
"""

from __future__ import annotations

import asyncio
import random
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import ray

import raysched
from raysched import ray_compat
from raysched.sampling import SamplingParams
from tests.conftest import reference_tokens, wait_for_no_workers, wait_until

NUM_REQUESTS = 24
POOL = {"kv_tokens": 120, "state_slots": 4}  # ~2 requests' worth of KV for 4 slots: retraction


def make_workload(n: int = NUM_REQUESTS, seed: int = 3) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 8-48 tokens, 16-40 new tokens; even requests greedy, odd ones seeded sampling."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(8, 48))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(16, 40)) if i % 2 == 0 else
              SamplingParams(max_new_tokens=rng.randint(16, 40), temperature=0.8, top_p=0.9, seed=i)
              for i in range(n)]
    return prompts, params


PROMPTS, PARAMS = make_workload()


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return reference_tokens("tiny", PROMPTS, PARAMS)


@pytest.fixture
def serve(multinode_cluster: Any) -> Iterator[Callable[..., raysched.Client]]:
    """`serve(pool=None, **scheduler_settings)` launches a client on the cluster; all are shut
    down afterwards, and the test fails unless their scheduler and worker actors really exit."""
    clients: list[raysched.Client] = []

    def launch(pool: dict | None = None, **scheduler: Any) -> raysched.Client:
        config = {"model": "tiny", "workers": 2, "pool": pool or POOL, "scheduler": scheduler}
        client = raysched.launch(config)
        clients.append(client)
        return client

    yield launch
    for client in clients:
        client.shutdown()
    wait_for_no_workers()  # both fake GPUs free again for the next test


# ------------------------------------------------------------------------------ helpers


def run_all(client: raysched.Client, prompts=PROMPTS, params=PARAMS, timeout_s: float = 120) -> list[dict]:
    handles = [client.submit(p, sp) for p, sp in zip(prompts, params)]
    return [h.result(timeout=timeout_s) for h in handles]


def run_until_cross_node(client: raysched.Client, reference: list[list[int]], max_rounds: int = 3) -> list[dict]:
    """Serve the workload in rounds until some request has resumed on the other node; every
    round must match the reference. Where a resumed request lands depends on which worker has
    room first, so one round (of ~10 retractions) now and then keeps them all on their node."""
    records: list[dict] = []
    for round_number in range(1, max_rounds + 1):
        round_records = run_all(client)
        assert mismatches(round_records, reference) == []
        records += round_records
        if client.stats()["cross_node_migrations"]:
            break
        warnings.warn(f"round {round_number} resumed every request on its own node; serving another")
    return records


def mismatches(records: list[dict], reference: list[list[int]]) -> list[str]:
    return [f"{r['request_id']} (retractions {r['retractions']}, workers {r['workers']})"
            for r, ref in zip(records, reference) if r["token_ids"] != ref]


def in_scheduler(client: raysched.Client, fn: Callable[[Any], Any], timeout_s: float = 30) -> Any:
    """Run `fn(scheduler)` on the scheduler actor's event loop, atomically with respect to its
    worker loops. `fn` may be async if nothing it awaits suspends (e.g. `Scheduler.abort`).
    Test-only introspection through Ray's `__ray_call__` (which runs on another thread)."""

    def call(sched: Any) -> Any:
        async def run() -> Any:
            out = fn(sched)
            return await out if asyncio.iscoroutine(out) else out

        loop = sched.workers[0].task.get_loop()
        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout_s)

    return ray.get(client.scheduler.__ray_call__.remote(call), timeout=timeout_s)


def scheduler_object_refs(client: raysched.Client) -> int:
    """Object references alive in the scheduler's process (its core worker's reference table):
    snapshots it owns, and calls in flight. Zero once everything has ended."""
    count = in_scheduler(client, lambda _s: ray_compat.owned_reference_count())
    assert count is not None, "this Ray offers no reference table: the leak check cannot run"
    return count


def assert_clean(client: raysched.Client) -> None:
    """Pools empty on every worker, every table zero, no object reference left in the scheduler
    but the prefix index's (one per parked point, one per parked K/V block)."""
    idle = client.check_idle()
    assert idle["workers_idle"] is True
    assert idle["tables"] == {"requests": 0, "waiting": 0, "retracted": 0, "snapshots_held": 0, "running": 0}
    stats = client.stats()
    assert stats["snapshot_bytes_held"] == 0
    assert scheduler_object_refs(client) == stats["state_cache_points"] + stats["state_cache_chunks"]


# ------------------------------------------------------------------------------ tokens


def test_snapshot_retraction_across_nodes_keeps_every_token(serve, reference) -> None:
    client = serve(rebalance={"enabled": False})  # moves by retraction only (a live migration has none)
    assert len({w["node"] for w in client.workers}) == 2  # one worker per GPU node
    records = run_until_cross_node(client, reference)
    stats = client.stats()
    assert stats["retractions"] > 0 and stats["retractions_snapshot"] == stats["retractions"]
    assert stats["cross_node_migrations"] >= 1
    moved = [r for r in records if len(set(r["workers"])) > 1]
    assert moved, "no request record shows a move between workers"
    assert all(r["retractions"] >= 1 for r in moved)
    assert_clean(client)


def test_forced_retraction_keeps_greedy_and_sampled_tokens(serve, reference) -> None:
    client = serve(force_retract_every=2)
    records = run_until_cross_node(client, reference)
    retracted = [(r, sp) for r, sp in zip(records, PARAMS * 3) if r["retractions"]]
    assert any(sp.is_greedy for _, sp in retracted) and any(not sp.is_greedy for _, sp in retracted)
    assert client.stats()["cross_node_migrations"] >= 1
    assert_clean(client)


def test_recompute_resume_keeps_every_token(serve, reference) -> None:
    client = serve(retract="recompute", force_retract_every=3)
    records = run_all(client)
    assert mismatches(records, reference) == []
    stats = client.stats()
    assert stats["retractions_recompute"] > 0 and stats["retractions_snapshot"] == 0
    assert stats["resumes_recompute"] > 0 and stats["resumes_snapshot"] == 0
    assert_clean(client)


def test_auto_retract_mode_keeps_every_token(serve, reference) -> None:
    client = serve(retract="auto", force_retract_every=3)
    records = run_all(client)
    assert mismatches(records, reference) == []
    stats = client.stats()
    assert stats["retractions"] > 0
    assert stats["retractions_snapshot"] + stats["retractions_recompute"] == stats["retractions"]
    assert_clean(client)


def test_chunked_prefill_mixed_with_decode_keeps_every_token(serve, reference) -> None:
    """Prompts of 8-48 tokens prefilled 8 tokens per call between decode steps, in pools small
    enough to retract (a victim caught mid-prefill is released and recomputed): tokens equal
    the reference."""
    client = serve(prefill_chunk_tokens=8)
    records = run_all(client)
    assert mismatches(records, reference) == []
    assert_clean(client)


def test_dropping_mamba_state_on_resume_is_caught(serve, reference) -> None:
    """Negative control: the broken debug mode must change some retracted request's tokens."""
    client = serve(force_retract_every=2, debug_drop_state=True)
    records = run_all(client)
    wrong = [r for r, ref in zip(records, reference) if r["token_ids"] != ref]
    assert wrong, "zeroing the Mamba state on resume went unnoticed"
    assert all(r["retractions"] >= 1 for r in wrong)  # only resumed requests can be affected
    assert [r for r, ref in zip(records, reference) if not r["retractions"] and r["token_ids"] != ref] == []


# ------------------------------------------------------------------------------ leaks


def test_leak_check_sees_a_snapshot_ref_kept_back(serve, reference) -> None:
    """Negative control for `assert_clean`: a snapshot ref kept by the scheduler after its
    request finished shows up in the scheduler's reference table until it is dropped."""
    client = serve(force_retract_every=2)
    handles = [client.submit(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    kept: list[int] = []

    def keep_snapshots(s: Any) -> int:
        s.kept_for_test = [r.snapshot_ref for r in s.requests.values() if r.snapshot_ref is not None]
        return len(s.kept_for_test)

    wait_until(lambda: kept.append(in_scheduler(client, keep_snapshots)) or kept[-1] > 0, 60,
               "a snapshot to be held")
    records = [h.result(timeout=120) for h in handles]
    assert mismatches(records, reference) == []
    assert client.check_idle()["tables"]["snapshots_held"] == 0  # the counter cannot see it...
    assert scheduler_object_refs(client) >= kept[-1]  # ...the reference table does
    in_scheduler(client, lambda s: s.kept_for_test.clear())
    assert_clean(client)


# ------------------------------------------------------------------------------ abort


def _abort_one(client: raysched.Client, state: str) -> dict | None:
    """Abort one request that is in `state` right now (atomically); None if there is none.

    For "retracted" it picks one whose snapshot is held; for "running" the one its worker would
    retract first, so that its next plan may pick the aborted request as a victim (which once
    crashed the scheduler loop)."""
    from raysched.policy import order_victims
    from raysched.request import State

    async def pick(s: Any) -> dict | None:
        if state == "running":
            cfg = s.config.scheduler
            candidates = [order_victims(w.view.running, cfg.victim_order, cfg.max_retractions)[:1]
                          for w in s.workers]
            candidates = [c[0] for c in candidates if c and c[0].state is State.RUNNING]
        else:
            candidates = [r for r in s.requests.values() if r.state.value == state
                          and (state != "retracted" or (r in s.retracted and r.snapshot_ref is not None))]
        if not candidates:
            return None
        req = candidates[-1]
        held_before = s._table_sizes()["snapshots_held"]
        aborted = await s.abort(req.request_id)  # never suspends: nothing runs in between
        return {"request_id": req.request_id, "aborted": aborted, "held_before": held_before,
                "held_after": s._table_sizes()["snapshots_held"]}

    return in_scheduler(client, pick)


def abort_when(client: raysched.Client, state: str, timeout_s: float = 60) -> dict:
    found: list[dict | None] = []
    wait_until(lambda: found.append(_abort_one(client, state)) or found[-1] is not None, timeout_s,
               f"a {state} request to abort", poll_s=0.02)
    return found[-1]


@pytest.mark.parametrize("state, force_retract_every", [
    ("waiting", 2),
    ("running", 1),  # every call retracts: the aborted request is its worker's next victim
    ("retracted", 2),
])
def test_abort_in_any_state_frees_everything(serve, reference, state: str, force_retract_every: int) -> None:
    client = serve(force_retract_every=force_retract_every)
    handles = [client.submit(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    info = abort_when(client, state)
    assert info["aborted"] is True
    if state == "retracted":
        assert info["held_after"] == info["held_before"] - 1  # its snapshot was released at once
    records = {h.request_id: h.result(timeout=120) for h in handles}
    assert records[info["request_id"]]["state"] == "aborted"
    assert handles[0].abort() is False  # already ended (and forgotten)
    others = [(records[h.request_id], ref) for h, ref in zip(handles, reference)
              if h.request_id != info["request_id"]]
    assert all(r["state"] == "finished" for r, _ in others)
    assert [r["request_id"] for r, ref in others if r["token_ids"] != ref] == []
    assert client.stats()["aborted"] == 1
    assert_clean(client)


# ------------------------------------------------------------------------------ streaming


def test_stream_yields_exactly_the_result_tokens(serve, reference) -> None:
    """Streams read while `result()` waits on the same request (which once made the stream fail
    with a KeyError), streams alone (which once left the request in the tables for good), and
    `result()` alone; a late `result()` after a finished stream still answers."""
    client = serve(force_retract_every=2)
    handles = [client.submit(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    both, stream_only = handles[0::3], handles[1::3]
    with ThreadPoolExecutor(max_workers=len(both) + len(stream_only)) as pool:
        streams = {h.request_id: pool.submit(lambda h=h: list(h.stream())) for h in both + stream_only}
        records = {h.request_id: h.result(timeout=120) for h in handles if h not in stream_only}
        streamed = {rid: f.result(timeout=120) for rid, f in streams.items()}
    for h, ref in zip(handles, reference):
        if h in stream_only:
            assert streamed[h.request_id] == ref
        else:
            assert records[h.request_id]["token_ids"] == ref
        if h in both:
            assert streamed[h.request_id] == records[h.request_id]["token_ids"]
    assert any(records[h.request_id]["retractions"] for h in both)  # streams crossed a retraction
    assert_clean(client)  # the stream-only requests left the tables too
    late = stream_only[0].result(timeout=10)
    assert late["state"] == "finished" and late["token_ids"] == streamed[stream_only[0].request_id]
