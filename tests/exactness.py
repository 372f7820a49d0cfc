"""Shared checks for the reliability suites (faults, bad input, soak).

The promise they check: every accepted request ends exactly once, `finished`, with the tokens
an uninterrupted in-process run gives (`Engine.generate`: same model, same seeds, never
retracted), and afterwards no slot, table entry or snapshot is left behind.

    specs = synthetic(seed=3, requests=16)
    report = run_workload(client, specs, progress=False)
    assert_exactly_once(report, specs)
    assert_idle(report["summary"]["idle_after"])
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import ray

from raysched.ray_compat import session_log_dir
from raysched.sampling import SamplingParams
from raysched.workload import RequestSpec, load_workload

TINY_VOCAB = 512


def synthetic(seed: int, requests: int, prompt_len: tuple[int, int] = (8, 40),
              max_new_tokens: tuple[int, int] = (16, 40), sampled_fraction: float = 0.5,
              arrival_rate: float | str = "inf") -> list[RequestSpec]:
    """A seeded workload for the tiny preset (all arriving at t=0 unless a Poisson
    `arrival_rate` in requests/s is given); a share of it samples."""
    raw = {"requests": requests, "seed": seed, "prompt_len": list(prompt_len),
           "max_new_tokens": list(max_new_tokens), "arrival_rate": arrival_rate}
    if sampled_fraction:
        raw["sampling"] = {"sampled_fraction": sampled_fraction, "temperature": 0.8, "top_p": 0.9}
    return load_workload(raw, TINY_VOCAB)


@lru_cache(maxsize=64)
def _reference(model: str, seed: int, prompts: tuple[tuple[int, ...], ...],
               sampling: tuple[SamplingParams, ...]) -> tuple[tuple[int, ...], ...]:
    import torch

    from actors.engine import build_engine

    kv_tokens = sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, sampling))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in Ray's workers (OMP_NUM_THREADS=1); 2 threads on 2 busy cores crawl
    try:
        engine = build_engine(model, "float32", "cpu", kv_tokens=kv_tokens, state_slots=len(prompts), seed=seed)
        return tuple(tuple(out) for out in engine.generate([list(p) for p in prompts], list(sampling)))
    finally:
        torch.set_num_threads(threads)


def reference(specs: Sequence[RequestSpec], model: str = "tiny", seed: int = 0) -> dict[str, list[int]]:
    """request id -> output tokens of an uninterrupted run of all `specs` in this process."""
    outs = _reference(model, seed, tuple(s.prompt_ids for s in specs), tuple(s.sampling for s in specs))
    return {s.request_id: list(out) for s, out in zip(specs, outs)}


def _first_difference(got: list[int], want: list[int]) -> str:
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"first difference at token {i}: got {got[i:i + 4]}, want {want[i:i + 4]} (lengths {len(got)}/{len(want)})"


def assert_exactly_once(report: dict, specs: Sequence[RequestSpec], model: str = "tiny") -> None:
    """Every spec has exactly one record, finished, with the reference tokens."""
    records = report["requests"]
    ids = sorted(r["request_id"] for r in records)
    assert ids == sorted(s.request_id for s in specs), "a request was lost or reported twice"
    unfinished = {r["request_id"]: (r["state"], r.get("error")) for r in records if r["state"] != "finished"}
    assert not unfinished, f"requests that did not finish: {unfinished}"
    want = reference(specs, model)
    mismatched = {r["request_id"]: _first_difference(r["token_ids"], want[r["request_id"]])
                  for r in records if r["token_ids"] != want[r["request_id"]]}
    assert not mismatched, f"{len(mismatched)} of {len(records)} requests differ from the reference: {mismatched}"


def assert_idle(idle: dict) -> None:
    """`client.check_idle()`: every live worker's pool free, every scheduler table empty."""
    assert idle["workers_idle"], f"a worker still holds slots: {idle}"
    assert not any(idle["tables"].values()), f"scheduler tables not empty: {idle['tables']}"


@contextmanager
def serving(raw: dict) -> Iterator[Any]:
    """`raysched.launch` of the serve config `raw` on the connected cluster; shut down after."""
    import raysched
    from raysched.config import load_serve_config

    client = raysched.launch(load_serve_config(raw))
    try:
        yield client
    finally:
        client.shutdown()


def scheduler_log(client) -> str:
    """What the scheduler actor wrote to stderr (its warnings and errors), from the session logs."""
    pid = ray.get(client.scheduler.__ray_call__.remote(lambda _self: os.getpid()))
    logs = session_log_dir()
    return "".join(p.read_text(errors="replace") for p in sorted(logs.glob(f"worker-*-{pid}.err")))


def bare_scheduler() -> tuple[Any, Any]:
    """A `Scheduler` object in this process (no Ray, no worker loops, no replacements) with two
    fake 256-token workers; returns (scheduler, worker slot 0). For white-box tests of its
    bookkeeping: submit, decide, then feed `dispatch.apply` the results or failures to check."""
    from raysched.config import SchedulerConfig, ServeConfig
    from raysched.messages import Usage, WorkerInfo
    from raysched.scheduler import Scheduler

    sched = Scheduler(ServeConfig(scheduler=SchedulerConfig(replace_failed_workers=False)))
    for index in range(2):
        usage = Usage(256, 256, 4, 4, 1)
        sched.fleet.add(None, WorkerInfo(index, f"node-{index}", "cpu", "model", TINY_VOCAB, 8192, usage, 256, 31_488))
    return sched, sched.workers[0]
