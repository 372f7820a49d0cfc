"""`raysched bench balance`: a skewed load with the rebalancer (`scheduler.rebalance`) on vs off.

Two workers (1 CPU each, embedded Ray), the same config but for `scheduler.rebalance.enabled`,
one deployment per mode in one Ray instance, both warmed up (a short request per worker and one
live migration). The skew is made deterministically with the placement rules: worker 1 is
drained while empty (as if back from maintenance), so the long requests, arriving first, all
start on worker 0 (a draining worker admits nothing). Once every long request decodes, worker 1
is undrained and the short requests arrive; they start on worker 1, the roomier one.

Worker 0's pool holds every long prompt but not every long request's whole budget (K/V is
overcommitted, as admission does), so left alone it runs out of room mid-decode and retracts
requests (resumed where there is room) while worker 1 idles after the short ones: one worker
overloaded, the other light, the case Llumnix balances by live migration. With the rebalancer
on, running requests move from worker 0 to worker 1 as soon as the gap in virtual usage passes
the threshold.

Measured at the client: each request's latency (submission to its last token); p50 and p99 per
mode and the ratio off / on (target: p99 at least 1.3x better with rebalancing on), the
scheduler's `rebalance_moves`, `live_migrations` and `retractions`, and requests whose tokens
differ between the modes (greedy: they must not).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (Column, Recorder, label_axes, load_average, local_ray, machine, measured_client,
                               percentile, plain_setup, print_load, print_table, print_targets, random_prompt, ratio,
                               report, wait_for_tokens)
from benchmarks.drain import warm_with_a_migration
from raysched.config import PoolConfig, RebalanceConfig, SchedulerConfig, ServeConfig, StateCacheConfig

MODES = ("rebalance_off", "rebalance_on")
LIGHT = 1  # the worker drained while the long requests arrive
TARGET_P99_RATIO = 1.3


@dataclass(frozen=True)
class Setup:
    model: str
    long: int  # long requests, all started on worker 0
    long_prompt: tuple[int, int]  # spread evenly between
    long_new: int
    short: int  # short requests, arriving once worker 1 is back
    short_prompt: int
    short_new: int
    kv_tokens: int  # per worker: every long prompt, not every long budget
    state_slots: int
    vocab: int


FULL = Setup("small", long=8, long_prompt=(1536, 2560), long_new=256, short=8, short_prompt=96, short_new=32,
             kv_tokens=16384 + 8 * 128, state_slots=12, vocab=8192)
QUICK = Setup("tiny", long=6, long_prompt=(192, 320), long_new=192, short=6, short_prompt=32, short_new=16,
              kv_tokens=2112, state_slots=8, vocab=512)


def prompts(setup: Setup) -> tuple[list[list[int]], list[list[int]]]:
    lo, hi = setup.long_prompt
    lengths = [lo + (hi - lo) * i // max(1, setup.long - 1) for i in range(setup.long)]
    return ([random_prompt(n, setup.vocab, seed=i) for i, n in enumerate(lengths)],
            [random_prompt(setup.short_prompt, setup.vocab, seed=1000 + i) for i in range(setup.short)])


def serve_config(setup: Setup, mode: str) -> ServeConfig:
    sched = SchedulerConfig(rebalance=RebalanceConfig(enabled=mode == "rebalance_on"))
    return ServeConfig(model=setup.model, workers=2, device="cpu", scheduler=sched,
                       pool=PoolConfig(kv_tokens=setup.kv_tokens, state_slots=setup.state_slots),
                       state_cache=StateCacheConfig(enabled=False))


def main(out_dir: Path = Path("bench-out"), quick: bool = False) -> dict:
    load_start = load_average()
    setup = QUICK if quick else FULL
    longs, shorts = prompts(setup)
    with local_ray(num_cpus=3):
        runs = {mode: run_mode(setup, mode, longs, shorts) for mode in MODES}
    result = _result(setup, runs)
    result["load_avg_1m_start"], result["load_avg_1m_end"] = load_start, load_average()
    return report(out_dir, "balance", result, _print, _figure)


def run_mode(setup: Setup, mode: str, longs: list[list[int]], shorts: list[list[int]]) -> dict:
    with measured_client(serve_config(setup, mode)) as (client, costs):
        warm_with_a_migration(client)
        before = client.stats()
        t0 = time.perf_counter()
        client.drain(LIGHT)  # empty: nothing moves, and nothing new starts there
        long_recs = [Recorder(client, p, {"max_new_tokens": setup.long_new}) for p in longs]
        wait_for_tokens(long_recs, 1)
        client.undrain(LIGHT)
        short_recs = [Recorder(client, p, {"max_new_tokens": setup.short_new}) for p in shorts]
        for r in long_recs + short_recs:
            r.join()
        duration = time.perf_counter() - t0
        cost, stats = costs(), client.stats()
    delta = {k: stats[k] - before[k] for k in ("rebalance_moves", "live_migrations", "retractions")}
    print(f"{mode:>14}: {duration:.1f} s, {delta}", flush=True)
    return {"long": long_recs, "short": short_recs, "duration_s": duration, **delta, **cost}


# ---------------------------------------------------------------------------- analysis
def _row(mode: str, run: dict, reference: dict | None) -> dict:
    recs = run["long"] + run["short"]
    lat = [r.latency_s() for r in recs if r.latency_s() is not None]
    long_lat = [r.latency_s() for r in run["long"] if r.latency_s() is not None]
    tokens = [r.tokens for r in recs]
    return {"mode": mode, "requests": len(recs), "errors": sum(r.error is not None for r in recs),
            "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
            "long_latency_p50_s": percentile(long_lat, 50), "long_latency_max_s": max(long_lat, default=None),
            "duration_s": run["duration_s"], "rebalance_moves": run["rebalance_moves"],
            "live_migrations": run["live_migrations"], "retractions": run["retractions"],
            "worker_cpu_s": run["worker_cpu_s"], "worker_busy_s": run["worker_busy_s"],
            "long_workers": [r.record.get("workers") for r in run["long"]],
            "mismatches": 0 if reference is None else sum(t != ref for t, ref in zip(tokens, reference["tokens"]))}


def _targets(rows: dict) -> dict:
    off, on = rows["rebalance_off"], rows["rebalance_on"]
    p99 = ratio(off["latency_p99_s"], on["latency_p99_s"])
    p50 = ratio(off["latency_p50_s"], on["latency_p50_s"])
    errors = off["errors"] + on["errors"]
    return {
        "latency p99 off / on": {"value": p99, "target": f">= {TARGET_P99_RATIO}",
                                 "met": bool(p99 and p99 >= TARGET_P99_RATIO)},
        "latency p50 off / on": {"value": p50, "target": "(informational)", "met": None},
        "rebalance moves (on)": {"value": on["rebalance_moves"], "target": "> 0", "met": on["rebalance_moves"] > 0},
        "client errors": {"value": errors, "target": "0", "met": errors == 0},
        "same tokens in both modes": {"value": on["mismatches"], "target": "0 mismatched requests",
                                      "met": on["mismatches"] == 0},
    }


def _result(setup: Setup, runs: dict) -> dict:
    reference = {"tokens": [r.tokens for r in runs["rebalance_off"]["long"] + runs["rebalance_off"]["short"]]}
    rows = {"rebalance_off": _row("rebalance_off", runs["rebalance_off"], None),
            "rebalance_on": _row("rebalance_on", runs["rebalance_on"], reference)}
    return {"model": setup.model, "workers": 2, "setup": plain_setup(setup), "machine": machine(),
            "modes": list(rows.values()), "targets": _targets(rows), "mismatches": rows["rebalance_on"]["mismatches"],
            "latencies": {m: [r.latency_s() for r in runs[m]["long"] + runs[m]["short"]] for m in MODES}}


# ---------------------------------------------------------------------------- output
def _print(result: dict) -> None:
    s = result["setup"]
    print(f"balance: model {result['model']}, 2 workers x {s['kv_tokens']} K/V tokens; {s['long']} long requests "
          f"(prompts {s['long_prompt']}, {s['long_new']} new) all started on worker 0, then {s['short']} short ones "
          f"({s['short_prompt']} + {s['short_new']} tokens)")
    cols = [Column("mode", "mode"), Column("errors", "errors", "d"), Column("p50 s", "latency_p50_s", ".2f"),
            Column("p99 s", "latency_p99_s", ".2f"), Column("long p50 s", "long_latency_p50_s", ".2f"),
            Column("time s", "duration_s", ".1f"), Column("rebalance moves", "rebalance_moves", "d"),
            Column("live migrations", "live_migrations", "d"), Column("retractions", "retractions", "d"),
            Column("worker CPU s", "worker_cpu_s", ".1f"), Column("mismatches", "mismatches", "d")]
    print_table("", cols, result["modes"])
    print_targets(result["targets"])
    print_load(result)


def _figure(result: dict, plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, values in result["latencies"].items():
        xs = sorted(v for v in values if v is not None)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=mode, drawstyle="steps-post", marker=".")
    label_axes(ax, "request latency at the client (s)", "fraction of requests",
               f"skewed load, rebalancing on vs off ({result['model']}, 2 workers)")
    return fig


if __name__ == "__main__":
    main()
