"""`raysched bench scale`: one scheduler in front of a fleet of simulated workers.

For each fleet size (8, 32, 128, 256 workers) and modeled decode step (10 ms, 30 ms), simulated
workers (`data_plane: sim`: the real worker interface and pool accounting, sleeping for the
modeled step time) serve Poisson arrivals at 80% of the fleet's ideal capacity, with ShareGPT-like
lengths (input: lognormal, median 74 / mean ~300 / p99 ~3,400 tokens; output: lognormal, median
487 / mean ~530 / p99 ~1,240; see shared NOTES). A fleet's ideal capacity is every state slot
decoding one token per step: workers * slots * 1000 / step_ms tokens/s. Reported per point:

- throughput: tokens/s generated in the measured window (after a warm-up), against what the
  arrivals offered (`vs_offered`; 1.0 = the scheduler kept up) and against the ideal capacity;
- workers' busy fraction (modeled busy time / window);
- the scheduler's CPU share (of one core) and RSS;
- decision latency p50/p99 (a worker's wake-up to its call leaving the scheduler), and its p99
  in the scheduler thread's CPU time (the difference is the OS running other processes);
- the scheduler's garbage-collection pauses (longest, and total);
- client overheads on a few streamed requests: TTFT minus the modeled prefill + one step, and
  the gaps between token arrivals (and how many tokens each arrival carried).

`--quick`: 32 workers at 10 ms for a few seconds, shorter outputs (the default test suite runs it
and checks `vs_offered` as a ratio, not a time).
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import Column, load_average, percentile, print_table, report, write_json
LOAD = 0.8  # arrivals at this fraction of the fleet's ideal capacity
STREAMED = 6  # requests per point streamed by the client (TTFT and token gaps)


@dataclass(frozen=True)
class Setup:
    sizes: tuple[int, ...]
    step_ms: tuple[float, ...]
    slots: int  # state slots per worker (its batch)
    duration_s: float  # arrivals last this long; tokens are counted after `warmup_s`
    warmup_s: float
    in_median: float
    in_sigma: float
    out_median: float
    out_sigma: float
    decode_steps_per_call: int = 4
    stream_each_step: bool = True  # each decode step's tokens sent as it completes (False: per call)
    fold_successor: bool = True  # a successor needing no decision runs in the same call (False: pipelined)
    fold_calls: int = 64  # with fold_successor: most calls' steps one call runs (2: one successor; the config's default)
    workers_per_process: int = 64  # simulated workers per host process (fewer processes: less of the
    #   simulation's own cost on a machine of a few cores)
    batch_calls: bool = True  # a host's step calls travel in batches (`sim.batch_calls`)
    join_long_calls: bool = True  # a waiting request starts inside a long call (`scheduler.join_long_calls`)
    finish_notices: bool = True  # a long call goes on past a finish and tells the scheduler (`scheduler.finish_notices`)
    direct_tokens: bool = True  # the streamed requests' tokens go from the workers to the client's sink
    #   (`raysched.sink`); False: through the scheduler (`next_tokens`, streamed step calls)


FULL = Setup(sizes=(8, 32, 128, 256), step_ms=(10.0, 30.0), slots=8, duration_s=30.0, warmup_s=10.0,
             in_median=74, in_sigma=1.685, out_median=487, out_sigma=0.4)
QUICK = Setup(sizes=(32,), step_ms=(10.0,), slots=4, duration_s=6.0, warmup_s=2.0,
              in_median=20, in_sigma=1.0, out_median=24, out_sigma=0.4)


def lengths(setup: Setup, rng: random.Random) -> tuple[int, int]:
    """(prompt tokens, output tokens) of one ShareGPT-like request."""
    prompt = int(min(4096, max(4, rng.lognormvariate(math.log(setup.in_median), setup.in_sigma))))
    out = int(min(1500, max(8, rng.lognormvariate(math.log(setup.out_median), setup.out_sigma))))
    return prompt, out


def mean_output(setup: Setup, samples: int = 20000) -> float:
    rng = random.Random(1)
    return sum(lengths(setup, rng)[1] for _ in range(samples)) / samples


def serve_config(workers: int, step_ms: float, setup: Setup):
    from raysched.config import load_serve_config

    return load_serve_config({
        "data_plane": "sim", "workers": workers, "object_store_memory": 256 << 20,
        "pool": {"kv_tokens": 16384, "state_slots": setup.slots},
        "scheduler": {"decode_steps_per_call": setup.decode_steps_per_call,
                      "stream_each_step": setup.stream_each_step, "fold_successor": setup.fold_successor,
                      "fold_calls": setup.fold_calls, "join_long_calls": setup.join_long_calls,
                      "finish_notices": setup.finish_notices},
        "state_cache": {"enabled": False},
        "sim": {"decode_ms": step_ms, "workers_per_process": setup.workers_per_process,
                "batch_calls": setup.batch_calls, "vocab_size": 32000, "max_context": 32768}})


def _scheduler_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stream(handle, t0: float, arrivals: list) -> None:
    """Stream one request, appending (seconds since submit, tokens) per arrival of tokens (a read
    that found nothing new, the sink's wait running out, is not an arrival)."""
    for tokens, _ in handle._chunks():
        if tokens:
            arrivals.append((time.perf_counter() - t0, len(tokens)))


def run_point(workers: int, step_ms: float, setup: Setup, seed: int = 0) -> dict:
    """One fleet size at one step time (starts and stops its own Ray)."""
    import ray

    import raysched

    cfg = serve_config(workers, step_ms, setup)
    ideal = workers * setup.slots * 1000.0 / step_ms  # tokens/s
    rate = LOAD * ideal / mean_output(setup)  # requests/s
    t_launch = time.perf_counter()
    client = raysched.launch(cfg)
    client.direct_tokens = setup.direct_tokens
    launch_s = time.perf_counter() - t_launch
    try:
        pid = ray.get(client.scheduler.__ray_call__.remote(lambda _s: os.getpid()))
        rng = random.Random(seed)
        streams: list = []
        threads, handles = [], []
        submitted = 0
        t0 = time.perf_counter()
        next_t = 0.0
        window = None
        while next_t < setup.duration_s:
            now = time.perf_counter() - t0
            if window is None and now >= setup.warmup_s:
                window = (time.perf_counter(), client.stats()["tokens"], _scheduler_cpu_s(pid),
                          client.stats()["busy_s"])
            if now < next_t:
                time.sleep(min(next_t - now, 0.01))
                continue
            prompt_len, out_len = lengths(setup, rng)
            prompt = [rng.randrange(32000) for _ in range(prompt_len)]
            params = {"max_new_tokens": out_len}
            if submitted % max(1, int(rate * setup.duration_s / STREAMED)) == 0 and len(threads) < STREAMED:
                handles.append(client.submit(prompt, params, stream=True))
                streams.append([])
                t = threading.Thread(target=_stream, args=(handles[-1], time.perf_counter(), streams[-1]), daemon=True)
                t.start()
                threads.append(t)
            else:
                client.scheduler.submit.remote(prompt, params, f"s{submitted}")
            submitted += 1
            next_t += rng.expovariate(rate)
        end = (time.perf_counter(), client.stats(detail=True), _scheduler_cpu_s(pid))
        for h in handles:  # the streams measured what they needed: end them before Ray goes
            h.abort()
        for t in threads:
            t.join(timeout=120)
    finally:
        client.shutdown()
    (w_t, w_tokens, w_cpu, w_busy), (e_t, stats, e_cpu) = window, end
    span = e_t - w_t
    tokens_per_s = (stats["tokens"] - w_tokens) / span
    return {"workers": workers, "step_ms": step_ms, "slots": setup.slots, "requests": submitted,
            "launch_s": launch_s, "window_s": span, "ideal_tokens_per_s": ideal,
            "offered_tokens_per_s": LOAD * ideal, "tokens_per_s": tokens_per_s,
            "vs_offered": tokens_per_s / (LOAD * ideal), "vs_ideal": tokens_per_s / ideal,
            "worker_busy": (stats["busy_s"] - w_busy) / (span * workers),
            "scheduler_cpu_share": (e_cpu - w_cpu) / span,
            "scheduler_cpu_us_per_token": (e_cpu - w_cpu) / max(1, stats["tokens"] - w_tokens) * 1e6,
            "scheduler_rss_mib": stats["scheduler_rss_bytes"] / 2**20,
            "decision_p50_ms": _ms(stats["decision_p50_s"]), "decision_p99_ms": _ms(stats["decision_p99_s"]),
            "decision_cpu_p99_ms": _ms(stats["decision_cpu_p99_s"]),
            "gc_pause_max_ms": _ms((stats.get("gc") or {}).get("pause_max_s")),
            "gc_pause_total_s": (stats.get("gc") or {}).get("pause_total_s"),
            "calls": stats["calls"], "pipelined_calls": stats["pipelined_calls"],
            "folded_calls": stats["folded_calls"], "interrupted_calls": stats["interrupted_calls"],
            "joins": stats["joins"], "joins_refused": stats["joins_refused"],
            "joins_late": stats["joins_late"],
            **_client_overheads(streams, step_ms)}


def _point_or_error(workers: int, step_ms: float, setup: Setup) -> dict:
    """`run_point`, or a row saying why it failed (the other points still run)."""
    try:
        return run_point(workers, step_ms, setup)
    except Exception as err:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        return {"workers": workers, "step_ms": step_ms, "error": repr(err)[:300]}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _client_overheads(streams: list, step_ms: float) -> dict:
    ttft = [a[0][0] * 1e3 for a in streams if a]
    gaps = [(b[0] - a[0]) * 1e3 for s in streams for a, b in zip(s, s[1:])]
    sizes = [n for s in streams for _, n in s[1:]]
    return {"ttft_overhead_p50_ms": None if not ttft else percentile(ttft, 50) - step_ms,
            "token_gap_p50_ms": percentile(gaps, 50), "token_gap_p99_ms": percentile(gaps, 99),
            "tokens_per_arrival": sum(sizes) / len(sizes) if sizes else None}


def main(out_dir: Path = Path("bench-out"), quick: bool = False) -> dict:
    setup = QUICK if quick else FULL
    load_start = load_average()
    rows = [_point_or_error(n, ms, setup) for ms in setup.step_ms for n in setup.sizes]
    result = {"setup": {**setup.__dict__, "load": LOAD}, "rows": rows, "load_avg_1m": [load_start, load_average()],
              "cpus": os.cpu_count(), "targets": _targets(rows)}
    return report(out_dir, "scale", result, _print, _figure)


def _targets(rows: list[dict]) -> dict:
    def at(n: int, ms: float) -> dict | None:
        return next((r for r in rows if r["workers"] == n and r["step_ms"] == ms and "error" not in r), None)

    out = {}
    for n, want in ((256, 0.9), (32, 0.97)):
        r = at(n, 10.0)
        out[f"{n} workers @10 ms, throughput / offered"] = {
            "value": None if r is None else r["vs_offered"], "target": f">= {want}",
            "met": None if r is None else r["vs_offered"] >= want}
    r = at(256, 10.0)
    out["256 workers @10 ms, decision p99 ms"] = {"value": None if r is None else r["decision_p99_ms"],
                                                 "target": "<= 1", "met": None if r is None else r["decision_p99_ms"] <= 1}
    out["256 workers @10 ms, decision p99 ms of scheduler CPU"] = {
        "value": None if r is None else r["decision_cpu_p99_ms"], "target": "<= 1 (info: the wall clock's is the target)",
        "met": None}
    return out


def _print(result: dict) -> None:
    cols = [Column("workers", "workers"), Column("step ms", "step_ms", ".0f"), Column("tok/s", "tokens_per_s", ".0f"),
            Column("vs offered", "vs_offered", ".3f"), Column("vs ideal", "vs_ideal", ".3f"),
            Column("busy", "worker_busy", ".2f"), Column("sched CPU", "scheduler_cpu_share", ".2f"),
            Column("us/token", "scheduler_cpu_us_per_token", ".2f"),
            Column("RSS MiB", "scheduler_rss_mib", ".0f"), Column("dec p50 ms", "decision_p50_ms", ".2f"),
            Column("dec p99 ms", "decision_p99_ms", ".2f"), Column("dec CPU p99", "decision_cpu_p99_ms", ".2f"),
            Column("GC max ms", "gc_pause_max_ms", ".0f"), Column("TTFT+ ms", "ttft_overhead_p50_ms", ".0f"),
            Column("gap p50 ms", "token_gap_p50_ms", ".1f"), Column("gap p99 ms", "token_gap_p99_ms", ".1f"),
            Column("tok/arrival", "tokens_per_arrival", ".1f")]
    print_table(f"scale: simulated workers x {result['setup']['slots']} slots, Poisson arrivals at "
                f"{LOAD:.0%} of ideal, {result['cpus']} CPUs, load avg {result['load_avg_1m']}", cols, result["rows"])
    for name, t in result["targets"].items():
        verdict = "" if t["met"] is None else ("met" if t["met"] else "MISSED")
        print(f"target {name}: {'-' if t['value'] is None else format(t['value'], '.3g')} (want {t['target']}) {verdict}")


def _figure(result: dict, plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    for ms in sorted({r["step_ms"] for r in result["rows"]}):
        pts = [(r["workers"], r["vs_ideal"]) for r in result["rows"] if r["step_ms"] == ms and "error" not in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{ms:.0f} ms steps")
    ax.axhline(LOAD, color="grey", linestyle="--", label=f"offered ({LOAD:.0%} of ideal)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("simulated workers")
    ax.set_ylabel("throughput / ideal capacity")
    ax.set_ylim(0, 1)
    ax.legend()
    return fig



def main_points(out: Path, sizes: tuple[int, ...], step_ms: tuple[float, ...], duration_s: float, warmup_s: float,
                **overrides: Any) -> dict:
    """Part of the full curve (these sizes and steps, shorter windows): for recording a curve on a
    busy machine, one point at a time. `overrides`: other `Setup` fields (`fold_calls=2`, ...)."""
    setup = Setup(**{**FULL.__dict__, "sizes": sizes, "step_ms": step_ms, "duration_s": duration_s,
                     "warmup_s": warmup_s, **overrides})
    rows = [_point_or_error(n, ms, setup) for ms in setup.step_ms for n in setup.sizes]
    result = {"setup": {**setup.__dict__, "load": LOAD}, "rows": rows, "load_avg_1m": [load_average()],
              "cpus": os.cpu_count(), "targets": _targets(rows)}
    _print(result)
    tag = (("" if setup.stream_each_step else "-per-call") + ("" if setup.fold_successor else "-unfolded")
           + f"-fold{setup.fold_calls}" + ("" if setup.batch_calls else "-unbatched")
           + ("" if setup.join_long_calls else "-nojoin") + ("" if setup.direct_tokens else "-via-scheduler"))
    write_json(out, f"scale-{'-'.join(map(str, sizes))}-{'-'.join(f'{m:g}' for m in step_ms)}{tag}", result)
    return result


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)

