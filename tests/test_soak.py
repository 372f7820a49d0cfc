"""Soak: 2,000 requests with forced retraction on two workers, nothing lost, nothing leaked.

    .venv/bin/python -m pytest -m soak -s tests/test_soak.py

A Poisson stream of requests (mixed greedy and seeded sampling) at about the rate two tiny
workers serve them; one victim per worker per call is retracted and resumed (snapshot, or
recompute where the budget says so). Afterwards: zero token mismatches against the
uninterrupted in-process reference, zero slots allocated, zero snapshot refs held, and the
scheduler's RSS flat: measured after a warm-up of the first requests and at the end (the
first requests pay for one-off imports and allocator growth; a leak grows with every request),
and small: under 150 MiB at the end, with torch never loaded in the scheduler's process.
Excluded from the default run (pyproject: addopts -m 'not soak').
"""

from __future__ import annotations

import dataclasses
import time

import pytest

import raysched
from raysched.runner import run_workload
from tests.exactness import assert_exactly_once, assert_idle, reference, synthetic

REQUESTS = 2000
WARMUP = 200  # the first requests, after which the RSS baseline is taken
ARRIVAL_RATE = 20.0  # requests/s: a steady stream, not one burst held in the tables at once
CHUNK = 200  # the reference runs in chunks (the forward is batch-invariant)
RSS_GROWTH_LIMIT = 50 << 20
RSS_LIMIT = 150 << 20  # the scheduler process holds no torch and no model code


def _rss_mib(client: raysched.Client) -> float:
    return client.stats(detail=True)["scheduler_rss_bytes"] / 2**20


@pytest.mark.soak
def test_two_thousand_requests_with_forced_retraction_lose_nothing_and_leak_nothing():
    specs = synthetic(2024, requests=REQUESTS, prompt_len=(8, 64), max_new_tokens=(8, 48), arrival_rate=ARRIVAL_RATE)
    for i in range(0, REQUESTS, CHUNK):  # computed (and cached) before the run, not during it
        reference(specs[i:i + CHUNK])
    warmup, rest = specs[:WARMUP], specs[WARMUP:]
    rest = [dataclasses.replace(s, arrival_s=s.arrival_s - rest[0].arrival_s) for s in rest]
    raw = {"workers": 2, "pool": {"kv_tokens": 256, "state_slots": 8},  # KV-bound: victims migrate
           "scheduler": {"force_retract_every": 1, "decode_steps_per_call": 4}, "object_store_memory": 200 << 20}
    with raysched.launch(raw) as client:
        rss_launch = _rss_mib(client)
        start = time.monotonic()
        records = run_workload(client, warmup, progress=True)["requests"]
        rss_start = _rss_mib(client)
        report = run_workload(client, rest, progress=True)
        elapsed = time.monotonic() - start
        rss_end = _rss_mib(client)
        stats = client.stats(detail=True)
        idle = client.check_idle()
    records += report["requests"]
    tokens = sum(len(r["token_ids"]) for r in records)
    print(f"\nsoak: {len(records)} requests, {tokens} tokens in {elapsed:.1f} s; retractions {stats['retractions']} "
          f"(snapshot {stats['retractions_snapshot']}, recompute {stats['retractions_recompute']}), "
          f"resumes {stats['resumes']}, migrations {stats['migrations']}, store fallbacks "
          f"{stats['store_pressure_fallbacks']}, snapshot bytes {stats['snapshot_bytes'] / 2**20:.0f} MiB, spilled "
          f"{stats.get('object_store_spilled_mib')} MiB; scheduler RSS {rss_launch:.1f} MiB at launch, "
          f"{rss_start:.1f} after {WARMUP} requests, {rss_end:.1f} at the end")
    by_id = {r["request_id"]: r for r in records}
    assert len(by_id) == len(records) == REQUESTS
    for i in range(0, REQUESTS, CHUNK):
        chunk = specs[i:i + CHUNK]
        assert_exactly_once({"requests": [by_id[s.request_id] for s in chunk]}, chunk)
    assert stats["finished"] == REQUESTS and stats["retractions"] >= REQUESTS
    assert_idle(idle)
    assert stats["tables"]["snapshots_held"] == 0 and stats["snapshot_bytes_held"] == 0
    assert (rss_end - rss_start) * 2**20 < RSS_GROWTH_LIMIT
    assert rss_end * 2**20 < RSS_LIMIT and stats["scheduler_torch_loaded"] is False
