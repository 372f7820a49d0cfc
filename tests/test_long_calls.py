"""Long calls on real workers: a call that folds up to `scheduler.fold_calls` calls' decode steps,
and the interrupt that ends it when something needs a decision (see `Dispatcher.fold_factor`,
`Dispatcher.interrupt_for_waiting`, `Worker.interrupt`).

The reference is an uninterrupted in-process run of the same requests (`tests.exactness`).
"""

from __future__ import annotations

import time

import pytest
import ray

from raysched.sampling import SamplingParams
from raysched.workload import RequestSpec
from tests.exactness import assert_idle, reference, serving


def spec(rid: str, prompt: list[int], max_new: int, temperature: float = 0.0) -> RequestSpec:
    return RequestSpec(rid, tuple(prompt), SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=7))


FIRST = [spec("a", [5, 9, 13, 2, 7], 160), spec("b", [3, 1, 4, 1, 5, 9, 2, 6], 150, temperature=0.8)]
LATER = [spec("c", [8, 6, 7, 5, 3, 0, 9], 24), spec("d", [2, 7, 1, 8], 20, temperature=0.8)]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=120 << 20)
    yield
    ray.shutdown()


@pytest.mark.parametrize("fold_calls", [8, 2], ids=["long-calls", "control-one-successor"])
def test_requests_arriving_during_a_long_call_interrupt_it_and_every_token_stays_exact(local_ray, fold_calls):
    """Two long requests decode on one worker in long calls (32 steps: nothing waits); two more
    arrive mid-call, the worker has free slots, so the call is interrupted and they start at
    once. Every request ends with the reference's tokens, and the pools end empty. Control: `fold_calls: 2` folds one successor (8 steps),
    never a long call: nothing is interrupted, the same tokens."""
    raw = {"model": "tiny", "workers": 1, "pool": {"kv_tokens": 1024, "state_slots": 4},
           "scheduler": {"decode_steps_per_call": 4, "fold_calls": fold_calls, "interrupt_after_ms": 0},
           "state_cache": {"enabled": False}}
    with serving(raw) as client:
        handles = {s.request_id: client.submit(list(s.prompt_ids), s.sampling, s.request_id) for s in FIRST}
        deadline = time.monotonic() + 120
        while client.stats()["tokens"] < 40 and time.monotonic() < deadline:  # past the admission call
            time.sleep(0.02)
        handles.update({s.request_id: client.submit(list(s.prompt_ids), s.sampling, s.request_id) for s in LATER})
        records = {rid: h.result(timeout=300) for rid, h in handles.items()}
        stats = client.stats()
        idle = client.check_idle()
    want = reference(FIRST + LATER)
    assert {rid: r["token_ids"] for rid, r in records.items()} == want
    assert_idle(idle)
    if fold_calls == 8:
        assert stats["interrupted_calls"] >= 1 and stats["folded_calls"] >= 1
    else:
        assert stats["interrupted_calls"] == 0 and stats["folded_calls"] >= 1
