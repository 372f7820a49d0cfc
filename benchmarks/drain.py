"""`raysched bench drain`: drain a worker while its requests decode, against the same requests
finishing in place.

Two workers (1 CPU each, embedded Ray), one decode step per call so every token is its own
arrival at the client. 16 greedy requests with prompts spread evenly over 1k-8k tokens (`small`;
`--quick`: `tiny`, 4 requests of 128-384 tokens) stream from their own threads. Once every one
has `start_after` tokens, the `drain` mode calls `client.drain(1)`: every request on worker 1
moves to worker 0 (live migration, else a snapshot fallback) while all of them keep decoding.
The `in_place` mode, on its own deployment in the same Ray instance, runs the same requests and
drains nothing. Both are warmed up first (a short request per worker and one live migration).

Measured at the client: the largest inter-token gap of any request from the drain call to
`AFTER` tokens after the drain returned, in units of the median of that request's last `RECENT` gaps before the call
(one decode step as its client sees it); the same window in the in-place run says how noisy the
machine was. Also the drain's `seconds`, `moved`, `fallbacks`, the time from the drain call
(or the same moment in place) until the last request ends, client errors, and requests whose
tokens differ between the two runs. Targets: no gap over 3 decode steps, 0 errors, 0 mismatches.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (Column, Recorder, label_axes, load_average, local_ray, machine, measured_client,
                               plain_setup, print_load, print_table, print_targets, random_prompt, report,
                               wait_for_tokens, warm_up)
from raysched.config import (MigrationConfig, PoolConfig, RebalanceConfig, SchedulerConfig, ServeConfig,
                             StateCacheConfig)

MODES = ("drain", "in_place")
DRAINED = 1  # the worker drained
AFTER = 8  # tokens after the drain returned that still count as "around the drain"
RECENT = 8  # gaps just before the drain call whose median is "one decode step" of the request
TARGET_GAP_STEPS = 3.0


@dataclass(frozen=True)
class Setup:
    model: str
    requests: int
    prompt: tuple[int, int]  # shortest and longest prompt; the rest spread evenly between
    new_tokens: int  # per request: enough to decode through the drain
    start_after: int  # tokens every request has streamed before the drain
    kv_tokens: int  # per worker: holds every request after the drain
    state_slots: int
    vocab: int


FULL = Setup("small", requests=16, prompt=(1024, 8192), new_tokens=480, start_after=16,
             kv_tokens=16 * 4608 + 16 * 480 + 2048, state_slots=16, vocab=8192)
QUICK = Setup("tiny", requests=4, prompt=(128, 384), new_tokens=128, start_after=8,
              kv_tokens=2048, state_slots=8, vocab=512)


def prompt_lengths(setup: Setup) -> list[int]:
    """Evenly spread, in submission order: every other length first, then the rest, so the
    first half (one worker's) and the second half (the other's) both span the range."""
    lo, hi = setup.prompt
    n = setup.requests
    spread = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    return spread[0::2] + spread[1::2]


def serve_config(setup: Setup) -> ServeConfig:
    """`max_batch_size` = half the requests: each worker admits half of them, whichever plans
    first (without it, the first to plan admits every queued request and the other drains
    nothing). It caps admissions only: after the drain worker 0 decodes all of them. The
    rebalancer is off: it moved 3 requests in the in-place run, which then was not in place."""
    sched = SchedulerConfig(decode_steps_per_call=1, prefill_chunk_tokens=0, prefill_budget_tokens=0,
                            max_batch_size=setup.requests // 2,
                            rebalance=RebalanceConfig(enabled=False))  # in place means in place
    return ServeConfig(model=setup.model, workers=2, device="cpu", scheduler=sched,
                       pool=PoolConfig(kv_tokens=setup.kv_tokens, state_slots=setup.state_slots),
                       state_cache=StateCacheConfig(enabled=False), migration=MigrationConfig())


def main(out_dir: Path = Path("bench-out"), quick: bool = False) -> dict:
    load_start = load_average()
    setup = QUICK if quick else FULL
    prompts = [random_prompt(n, setup.vocab, seed=i) for i, n in enumerate(prompt_lengths(setup))]
    with local_ray(num_cpus=3):
        runs = {mode: run_mode(setup, mode, prompts) for mode in MODES}
    result = _result(setup, runs)
    result["load_avg_1m_start"], result["load_avg_1m_end"] = load_start, load_average()
    return report(out_dir, "drain", result, _print, _figure)


WARM_BUDGET = 1500  # tokens: within every setup's pool (2,048 K/V tokens at least) with its 32-token prompt


def warm_with_a_migration(client: Any) -> None:
    """A short request per worker, and one live migration (its first call pays lazy set-up).
    The moved request's budget is far beyond what one worker call decodes, so it still runs when
    the move comes (with 200, a long first call could leave it ending before the move); it is
    aborted once moved."""
    warm_up(client)
    rec = Recorder(client, [3] * 32, {"max_new_tokens": WARM_BUDGET})
    wait_for_tokens([rec], 4)
    client.migrate(rec.request_id)
    rec.abort()
    rec.join()


def run_mode(setup: Setup, mode: str, prompts: list[list[int]]) -> dict:
    with measured_client(serve_config(setup)) as (client, _costs):
        warm_with_a_migration(client)
        warm_moves = client.stats()["live_migrations"]
        recs = [Recorder(client, p, {"max_new_tokens": setup.new_tokens}) for p in prompts]
        wait_for_tokens(recs, setup.start_after)
        t_call = time.perf_counter()
        drained = client.drain(DRAINED) if mode == "drain" else {"moved": 0, "seconds": 0.0, "fallbacks": 0}
        t_back = time.perf_counter()
        print(f"  {mode}: {drained}", flush=True)
        for r in recs:
            r.join()
        live = client.stats()["live_migrations"] - warm_moves
    return {"recs": recs, "drained": drained, "t_call": t_call, "t_back": t_back, "live_migrations": live}


# ---------------------------------------------------------------------------- analysis
def gap_steps(rec: Recorder, t_call: float, t_back: float) -> tuple[float, float, float | None]:
    """(largest gap around the drain in decode steps, median of the `RECENT` gaps before it in
    seconds: one decode step of the batch the request is in when the drain comes (a median over
    its whole life before would count steps of the smaller batches it started in), median gap
    after the window: one decode step of the batch the request ended up in)."""
    gaps = [b - a for a, b in zip(rec.arrivals, rec.arrivals[1:])]
    first_after = next((i for i, t in enumerate(rec.arrivals) if t > t_call), len(rec.arrivals))
    last = next((i for i, t in enumerate(rec.arrivals) if t > t_back), len(rec.arrivals)) + AFTER
    before = [g for g in gaps[1:max(2, first_after - 1)] if g > 0][-RECENT:]
    around, after = gaps[max(0, first_after - 1):last], [g for g in gaps[last:] if g > 0]
    step = statistics.median(before) if before else float("nan")
    return (max(around) / step if around else 0.0), step, (statistics.median(after) if after else None)


def _row(mode: str, run: dict, reference: list[list[int]] | None) -> dict:
    recs = run["recs"]
    decoding = [r for r in recs if r.arrivals and r.arrivals[-1] > run["t_call"]]  # not ended by the call
    measured = [gap_steps(r, run["t_call"], run["t_back"]) for r in decoding] or [(0.0, float("nan"), None)]
    ends = [r.ended for r in recs if r.ended is not None]
    return {"mode": mode, "requests": len(recs), "errors": sum(r.error is not None for r in recs),
            "decoding_at_drain": len(decoding), "error_messages": [r.error for r in recs if r.error],
            "gap_steps_max": max(g for g, _, _ in measured),
            "gap_steps_per_request": [round(g, 2) for g, _, _ in measured],
            "step_s_median": statistics.median(s for _, s, _ in measured),
            "step_s_after_median": statistics.median([a for _, _, a in measured if a is not None] or [float("nan")]),
            "drain_s": run["drained"]["seconds"], "moved": run["drained"]["moved"],
            "fallbacks": run["drained"]["fallbacks"],
            "finish_s": max(ends) - run["t_call"] if ends else None,
            "live_migrations": run["live_migrations"],  # not counting the warm-up's
            "workers_used": sorted({w for r in recs for w in r.record.get("workers", [])}),
            "mismatches": 0 if reference is None else sum(r.tokens != ref for r, ref in zip(recs, reference))}


def _targets(rows: dict) -> dict:
    d, p = rows["drain"], rows["in_place"]
    finish = d["finish_s"] / p["finish_s"] if d["finish_s"] and p["finish_s"] else None
    return {
        "largest gap around the drain (decode steps)": {
            "value": d["gap_steps_max"], "target": f"<= {TARGET_GAP_STEPS}",
            "met": d["gap_steps_max"] <= TARGET_GAP_STEPS},
        "same window in place, no drain (decode steps)": {
            "value": p["gap_steps_max"], "target": "(noise floor)", "met": None},
        "client errors": {"value": d["errors"] + p["errors"], "target": "0", "met": d["errors"] + p["errors"] == 0},
        "requests moved by the drain": {"value": d["moved"], "target": "> 0", "met": d["moved"] > 0},
        "requests still decoding at the drain call": {
            "value": d["decoding_at_drain"], "target": f"all {d['requests']}",
            "met": d["decoding_at_drain"] == d["requests"]},
        "finish time drained / in place": {"value": finish, "target": "(informational)", "met": None},
        "same tokens drained and in place": {"value": d["mismatches"], "target": "0 mismatched requests",
                                             "met": d["mismatches"] == 0},
    }


def _result(setup: Setup, runs: dict) -> dict:
    reference = [r.tokens for r in runs["in_place"]["recs"]]
    rows = {"drain": _row("drain", runs["drain"], reference), "in_place": _row("in_place", runs["in_place"], None)}
    return {"model": setup.model, "workers": 2, "setup": plain_setup(setup), "machine": machine(),
            "prompt_lengths": prompt_lengths(setup), "modes": list(rows.values()), "targets": _targets(rows),
            "mismatches": rows["drain"]["mismatches"],
            "arrivals": {m: [[t - runs[m]["t_call"] for t in r.arrivals] for r in runs[m]["recs"]] for m in MODES}}


# ---------------------------------------------------------------------------- output
def _print(result: dict) -> None:
    s = result["setup"]
    print(f"drain: model {result['model']}, 2 workers; {s['requests']} requests, prompts {s['prompt']} tokens, "
          f"{s['new_tokens']} new each; worker {DRAINED} drained after {s['start_after']} tokens")
    cols = [Column("mode", "mode"), Column("errors", "errors", "d"), Column("decoding", "decoding_at_drain", "d"),
            Column("largest gap (steps)", "gap_steps_max", ".2f"),
            Column("step ms", "step_s_median", ".1f", 1e3), Column("step ms after", "step_s_after_median", ".1f", 1e3),
            Column("drain s", "drain_s", ".2f"),
            Column("moved", "moved", "d"), Column("fallbacks", "fallbacks", "d"),
            Column("finish s", "finish_s", ".2f"), Column("live migrations", "live_migrations", "d"),
            Column("mismatches", "mismatches", "d")]
    print_table("", cols, result["modes"])
    print_targets(result["targets"])
    print_load(result)


def _figure(result: dict, plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, style in zip(MODES, ("-", ":")):
        for i, arrivals in enumerate(result["arrivals"][mode]):
            gaps = [(b, (b - a) * 1e3) for a, b in zip(arrivals, arrivals[1:])]
            ax.plot([t for t, _ in gaps], [g for _, g in gaps], style, lw=0.8,
                    label=mode if i == 0 else None, color="C0" if mode == "drain" else "C1")
    ax.axvline(0.0, color="k", lw=0.6)
    ax.set_yscale("log")
    label_axes(ax, "time since the drain call (s)", "inter-token gap (ms)",
               f"token gaps while worker {DRAINED} drains ({result['model']})", which="both")
    return fig


if __name__ == "__main__":
    main()
