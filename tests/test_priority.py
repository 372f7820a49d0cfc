"""Priority preemption on a multi-node cluster: urgent requests arriving at a full cluster are
admitted by retracting the least urgent running ones, and every request still gets exactly the
tokens of an uninterrupted run (the preempted ones resume from their snapshots, on any node)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import raysched
from raysched.config import load_serve_config
from raysched.workload import RequestSpec
from tests.conftest import local_cluster, wait_until
from tests.exactness import assert_exactly_once, synthetic

POOL = {"kv_tokens": 3072, "state_slots": 4}  # K/V for every request's whole budget: only the slots run out, so
#   an urgent request finds no room unless it preempts (with K/V overcommitted, a low-priority request
#   retracted for K/V could free a slot first, and the urgent ones started without preempting)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with local_cluster(gpu_nodes=2) as c:
        yield c


def run_with_urgent(retract: str, preemption: bool = True) -> tuple[list[dict], dict, list[RequestSpec]]:
    """8 long low-priority requests fill both workers; once all run, 2 urgent ones arrive."""
    low = [RequestSpec(s.request_id, s.prompt_ids, s.sampling, priority=5)
           for s in synthetic(31, requests=8, prompt_len=(24, 32), max_new_tokens=(600, 660))]
    #   (long enough that none has finished, freeing a slot, by the time the urgent ones come: their
    #   tokens reach the scheduler when a long call ends, after up to `fold_calls` x
    #   `decode_steps_per_call` = 256 steps; with 300-330 tokens, 45-75 were left then, and a
    #   fresh-clone run once finished them before the urgent ones were placed)
    high = [RequestSpec(f"urgent-{i}", s.prompt_ids, s.sampling, priority=0)
            for i, s in enumerate(synthetic(32, requests=2, prompt_len=(40, 50), max_new_tokens=(8, 8)))]
    cfg = {"workers": 2, "pool": POOL, "scheduler": {"retract": retract, "preemption": preemption}}
    client = raysched.launch(load_serve_config(cfg))
    try:
        handles = [client.submit(list(s.prompt_ids), s.sampling, s.request_id, priority=5) for s in low]
        wait_until(lambda: client.stats()["tables"]["waiting"] == 0 and client.stats()["tokens"] > 8, 60,
                   "the low-priority requests to be running")
        handles += [client.submit(list(s.prompt_ids), s.sampling, s.request_id, priority=0) for s in high]
        records = [h.result(timeout=300) for h in handles]
        stats = client.stats()
    finally:
        client.shutdown()
    return records, stats, low + high


@pytest.mark.usefixtures("cluster")
@pytest.mark.parametrize("retract", ["snapshot", "recompute"])
def test_urgent_requests_preempt_low_priority_ones_and_every_token_stays_exact(retract: str) -> None:
    records, stats, specs = run_with_urgent(retract)
    assert_exactly_once({"requests": records}, specs)
    assert stats["preemptions"] >= 1, stats
    assert any(r["priority"] == 5 and r["retractions"] for r in records), records  # the preempted
    mode = "retractions_snapshot" if retract == "snapshot" else "retractions_recompute"
    assert stats[mode] >= stats["preemptions"], stats
    print(f"\n{retract}: {stats['preemptions']} preemptions, {stats['retractions']} retractions")
    if retract == "snapshot":
        # workers sit on two nodes, the scheduler on a third: a resume reads its snapshot from the
        # producer's node once (nothing on the same node); the former flow relayed every snapshot
        # through the scheduler's node (two transfers)
        resumes = stats["resumes_snapshot"]
        assert resumes >= 1 and stats["resume_bytes_via_scheduler"] > 0, stats
        assert stats["resume_bytes_moved"] <= stats["resume_bytes_via_scheduler"] / 2, stats
        print(f"bytes moved per snapshot resume: {stats['resume_bytes_moved'] / resumes / 1e3:.1f} kB "
              f"(via the scheduler's node: {stats['resume_bytes_via_scheduler'] / resumes / 1e3:.1f} kB), "
              f"{stats['cross_node_migrations']} of {resumes} resumes crossed nodes")


@pytest.mark.usefixtures("cluster")
def test_without_preemption_nothing_is_preempted() -> None:
    records, stats, specs = run_with_urgent("snapshot", preemption=False)
    assert_exactly_once({"requests": records}, specs)
    assert stats["preemptions"] == 0, stats
