"""Prefill and decode roles on a local multi-node cluster: the real hand-over path.

The cluster (`tests.conftest.multinode_cluster`): a head (driver and scheduler) and two nodes
with one fake GPU each, so the prefill worker and the decode worker sit on different nodes and
every hand-over crosses the network. Each test serves a seeded workload (greedy and sampled)
and checks every request finishes once with the tokens of the uninterrupted in-process
reference (colocated serving on one engine). Faults come through the `faults:` config: the
prefill worker is killed mid-prompt (prompts prefill in several chunks), the decode worker
mid-stream. No replacement fits the cluster, so the survivor takes both roles. The two kills
are behind the marker `slow` (a launch each: half a minute or more on a busy machine).
"""

from __future__ import annotations

from typing import Any

import pytest

from raysched.runner import run_workload
from tests.exactness import assert_exactly_once, assert_idle, serving, synthetic

POOL = {"kv_tokens": 640, "state_slots": 8}


def config(faults: list | None = None, **scheduler: Any) -> dict:
    return {"roles": {"prefill": 1, "decode": 1}, "pool": POOL, "faults": faults or [],
            "scheduler": {"decode_steps_per_call": 4, "prefill_chunk_tokens": 8, "prefill_budget_tokens": 16,
                          "replace_failed_workers": False, **scheduler}}


@pytest.mark.usefixtures("multinode_cluster")
class TestRolesOnCluster:
    def test_handover_across_nodes_is_token_exact(self):
        specs = synthetic(41, requests=10, prompt_len=(20, 40), max_new_tokens=(8, 20))
        with serving(config()) as client:
            report = run_workload(client, specs, progress=False)
            assert_exactly_once(report, specs)
            stats = client.stats()
            assert [w["role"] for w in stats["workers"]] == ["prefill", "decode"]
            assert [w["role"] for w in client.workers] == ["prefill", "decode"]
            assert client.workers[0]["node"] != client.workers[1]["node"]
            assert stats["handovers"] == len(specs) and stats["retractions"] == 0, stats
            assert stats["cross_node_migrations"] == len(specs) and stats["handover_bytes"] > 0
            assert stats["handover_latency_p99_s"] >= stats["handover_latency_p50_s"] > 0
            assert set(stats["prefill_tokens_by_role"]) == {"prefill"}
            for record in report["requests"]:
                assert record["workers"] == [0, 1], record
            assert_idle(client.check_idle())

    @pytest.mark.slow
    def test_prefill_worker_killed_mid_prompt(self):
        specs = synthetic(42, requests=8, prompt_len=(30, 40), max_new_tokens=(8, 16))
        faults = [{"kind": "kill_worker", "worker": 0, "after_steps": 2}]  # its 3rd chunk of a prompt
        with serving(config(faults)) as client:
            report = run_workload(client, specs, progress=False)
            assert_exactly_once(report, specs)
            stats = client.stats()
            assert stats["worker_failures"] == 1 and stats["workers_alive"] == 1, stats
            assert stats["faults_fired"][0]["worker"] == 0
            assert stats["prefill_tokens_by_role"].get("decode", 0) > 0  # the survivor does both
            assert_idle(client.check_idle())

    @pytest.mark.slow
    def test_decode_worker_killed_mid_stream(self):
        specs = synthetic(43, requests=8, prompt_len=(10, 20), max_new_tokens=(24, 40))
        faults = [{"kind": "kill_in_step", "worker": 1, "after_steps": 3, "after_decode_steps": 2}]
        with serving(config(faults)) as client:
            report = run_workload(client, specs, progress=False)
            assert_exactly_once(report, specs)
            stats = client.stats()
            assert stats["worker_failures"] == 1 and stats["handovers"] >= 1, stats
            assert stats["recovered"] >= 1
            assert_idle(client.check_idle())
