"""`raysched bench e2e`: one memory-pressure workload on 2 workers under each retract mode.

Modes, run one after another on the same embedded Ray instance and the same requests (with
`rounds: 2`, a second round in reverse order, and a mode's numbers are the mean of its rounds):

- `recompute`: overcommit admission; a retracted request is re-prefilled (prompt + outputs).
- `snapshot`:  overcommit admission; a retracted request's state goes to the object store and is
               restored (on whichever worker has room).
- `auto`:      overcommit admission; the cost model picks snapshot or recompute per victim.
- `reserve`:   the no-overcommit baseline: every request keeps room for its whole budget
               (prompt + max_new_tokens) from admission on, so nothing is ever retracted.

The workload is built so that retraction matters and recompute is costly: long prompts on the
`small` preset, a KV pool per worker of a few prompts' worth, and every request arriving at
t=0. All requests are greedy, so every mode must produce the same tokens per request; the
`reserve` run (never interrupted) is the reference, and mismatches are reported, not hidden.

Wall-clock throughput on a shared machine moves with other people's load by tens of percent
from one minute to the next, more than the modes differ. So each mode also reports the CPU
time its two worker processes used (from /proc), the seconds they spent computing inside step
calls as the scheduler summed them (`worker busy s`), and tokens per worker CPU-second: the work
a mode needed, which that load moves much less.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from benchmarks.common import (Column, load_average, local_ray, machine, measured_client, print_table, print_targets,
                               ratio, report)
from raysched.config import PoolConfig, SchedulerConfig, ServeConfig
from raysched.workload import RequestSpec, WorkloadConfig, build_requests

MODES = ("recompute", "snapshot", "auto", "reserve")
REFERENCE_MODE = "reserve"


@dataclass(frozen=True)
class Setup:
    """Model, pool and workload of one e2e run."""

    model: str
    kv_tokens: int  # per worker
    state_slots: int  # per worker
    workload: WorkloadConfig
    bin_s: float  # width of the time bins in the plot
    rounds: int  # 2: every mode twice, the second round in reverse order


FULL = Setup("small", kv_tokens=2048, state_slots=8, bin_s=2.0, rounds=1,
             workload=WorkloadConfig(requests=12, seed=11, prompt_len=(400, 1200),
                                     max_new_tokens=(128, 384)))
QUICK = Setup("tiny", kv_tokens=768, state_slots=8, bin_s=0.5, rounds=1,
              workload=WorkloadConfig(requests=10, seed=11, prompt_len=(100, 300),
                                      max_new_tokens=(16, 64)))


def serve_config(setup: Setup, mode: str) -> ServeConfig:
    admission = "reserve" if mode == "reserve" else "overcommit"
    retract = "snapshot" if mode == "reserve" else mode
    return ServeConfig(model=setup.model, workers=2, device="cpu",
                       pool=PoolConfig(kv_tokens=setup.kv_tokens, state_slots=setup.state_slots),
                       scheduler=SchedulerConfig(retract=retract, admission=admission))


def main(out_dir: Path = Path("bench-out"), quick: bool = False) -> dict:
    load_start = load_average()
    setup = QUICK if quick else FULL
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    order = [m for r in range(setup.rounds) for m in (MODES if r % 2 == 0 else MODES[::-1])]
    with local_ray(num_cpus=2):
        for mode in order:
            runs[mode].append(run_mode(setup, mode))
    result = _result(setup, runs, order)
    result["load_avg_1m_start"] = load_start
    return report(out_dir, "e2e", result, _print, _figure)


def run_mode(setup: Setup, mode: str) -> dict:
    """Launch scheduler + 2 workers, run the workload, return summary, outputs, timeline and the
    CPU time the worker and scheduler processes spent on it (`measured_client`)."""
    from raysched.runner import run_workload

    with measured_client(serve_config(setup, mode)) as (client, costs):
        specs = build_requests(setup.workload, client.vocab_size())
        start_s = client.stats()["uptime_s"]  # the timeline counts from the scheduler's start
        report = run_workload(client, specs, progress=False)
        cost = costs()
        timeline = [(t - start_s, *rest) for t, *rest in client.timeline()]
    s = report["summary"]
    print(f"{mode:>10}: {s['tokens_per_s']} tokens/s in {s['duration_s']:.1f} s, "
          f"{s['retractions']} retractions, worker CPU {cost['worker_cpu_s'] or 0:.1f} s", flush=True)
    return {"summary": s, "outputs": {r["request_id"]: r["token_ids"] for r in report["requests"]},
            "timeline": timeline, "workload": _describe(specs), **cost}


def _describe(specs: list[RequestSpec]) -> dict:
    prompts = [len(s.prompt_ids) for s in specs]
    budgets = [s.sampling.max_new_tokens for s in specs]
    return {"requests": len(specs), "prompt_tokens": sum(prompts), "max_new_tokens_total": sum(budgets),
            "prompt_len_range": [min(prompts), max(prompts)], "max_new_tokens_range": [min(budgets), max(budgets)]}


# ---------------------------------------------------------------------------- analysis
def _mismatches(outputs: dict[str, list[int]], reference: dict[str, list[int]]) -> list[dict]:
    """Requests whose tokens differ from the reference run, with the first differing index."""
    bad = []
    for rid, ref in sorted(reference.items()):
        got = outputs.get(rid)
        if got != ref:
            first = next((i for i, (x, y) in enumerate(zip(got or [], ref)) if x != y),
                         min(len(got or []), len(ref)))
            bad.append({"request_id": rid, "first_diff_index": first,
                        "len": len(got or []), "reference_len": len(ref)})
    return bad


MEAN_KEYS = ("tokens_per_s", "tokens_per_worker_cpu_s", "worker_cpu_s", "worker_busy_s", "scheduler_cpu_s",
             "duration_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s",
             "retractions", "retractions_snapshot", "retractions_recompute", "resumes", "migrations",
             "snapshot_mb")


def _run_row(run: dict, reference: dict) -> dict:
    s = run["summary"]
    cpu = run["worker_cpu_s"]
    return {"tokens_per_s": s["tokens_per_s"], "duration_s": s["duration_s"], "tokens": s["tokens"],
            "worker_cpu_s": cpu, "scheduler_cpu_s": run["scheduler_cpu_s"], "worker_busy_s": run["worker_busy_s"],
            "tokens_per_worker_cpu_s": s["tokens"] / cpu if cpu else None,
            "finished": s["finished"], "failed": s["failed"],
            "latency_p50_s": s["latency_p50_s"], "latency_p99_s": s["latency_p99_s"],
            "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
            "retractions": s["retractions"], "retractions_snapshot": s["retractions_snapshot"],
            "retractions_recompute": s["retractions_recompute"], "resumes": s["resumes"],
            "migrations": s["migrations"], "snapshot_mb": (s["snapshot_bytes"] or 0) / 1e6,
            "mismatches": len(_mismatches(run["outputs"], reference)),
            "idle_after": s["idle_after"]["workers_idle"]}


def _row(mode: str, runs: list[dict], reference: dict) -> dict:
    """A mode's numbers: the mean over its rounds (each round listed under `rounds`)."""
    per_round = [_run_row(r, reference) for r in runs]
    row = {"mode": mode, **{k: _mean([r[k] for r in per_round]) for k in MEAN_KEYS}}
    row.update({"finished": min(r["finished"] for r in per_round),
                "failed": sum(r["failed"] for r in per_round),
                "mismatches": sum(r["mismatches"] for r in per_round),
                "idle_after": all(r["idle_after"] for r in per_round), "rounds": per_round})
    return row


def _mean(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return mean(known) if known else None


def _targets(rows: dict[str, dict]) -> dict:
    tps = {m: rows[m]["tokens_per_s"] for m in rows}
    snap_vs_re = tps["snapshot"] / tps["recompute"]
    best = max(tps["snapshot"], tps["recompute"])
    return {
        "snapshot_vs_recompute_throughput": {"value": snap_vs_re, "target": ">= 1.3",
                                             "met": snap_vs_re >= 1.3},
        "auto_vs_best_throughput": {"value": tps["auto"] / best, "target": ">= 0.95",
                                    "met": tps["auto"] >= 0.95 * best},
        "snapshot_vs_reserve_p99_latency": {
            "value": rows["snapshot"]["latency_p99_s"] / rows["reserve"]["latency_p99_s"],
            "target": "< 1 (snapshot p99 latency below no-overcommit's)",
            "met": rows["snapshot"]["latency_p99_s"] < rows["reserve"]["latency_p99_s"]},
        # not a target: the same comparison in tokens per worker CPU-second, which competing
        # programs on a shared machine move much less than wall-clock throughput
        "snapshot_vs_recompute_cpu_efficiency": {
            "value": ratio(rows["snapshot"]["tokens_per_worker_cpu_s"],
                            rows["recompute"]["tokens_per_worker_cpu_s"]),
            "target": "(informational)", "met": None},
        "same_tokens_every_mode": {"value": sum(r["mismatches"] for r in rows.values()),
                                   "target": "0 mismatched requests",
                                   "met": all(r["mismatches"] == 0 for r in rows.values())},
    }


def _result(setup: Setup, runs: dict[str, list[dict]], order: list[str]) -> dict:
    reference = runs[REFERENCE_MODE][0]["outputs"]  # never retracted: the uninterrupted run
    rows = {m: _row(m, runs[m], reference) for m in MODES}
    return {
        "model": setup.model, "workers": 2, "kv_tokens_per_worker": setup.kv_tokens,
        "state_slots_per_worker": setup.state_slots, "workload": runs[MODES[0]][0]["workload"],
        "workload_config": {k: (list(v) if isinstance(v, tuple) else v)
                            for k, v in dataclasses.asdict(setup.workload).items()},
        "rounds": setup.rounds, "run_order": order, "machine": machine(),
        "modes": list(rows.values()), "targets": _targets(rows),
        "mismatched_requests": {m: [bad for r in runs[m] for bad in _mismatches(r["outputs"], reference)]
                                for m in MODES},
        "timelines": {m: runs[m][0]["timeline"] for m in MODES},  # first round's
    }


# ---------------------------------------------------------------------------- output
def _print(result: dict) -> None:
    w = result["workload"]
    print(f"e2e: model {result['model']}, 2 workers x {result['kv_tokens_per_worker']} KV tokens, "
          f"{w['requests']} requests at t=0, prompts {w['prompt_len_range']}, "
          f"max_new_tokens {w['max_new_tokens_range']}; mean of {result['rounds']} round(s)")
    cols = [Column("mode", "mode"), Column("tokens/s", "tokens_per_s", ".1f"),
            Column("time s", "duration_s", ".1f"), Column("worker busy s", "worker_busy_s", ".1f"),
            Column("worker CPU s", "worker_cpu_s", ".1f"),
            Column("tok/CPU-s", "tokens_per_worker_cpu_s", ".1f"),
            Column("p50 lat s", "latency_p50_s", ".2f"), Column("p99 lat s", "latency_p99_s", ".2f"),
            Column("p99 TTFT s", "ttft_p99_s", ".2f"), Column("retract", "retractions", "g"),
            Column("(snap/recomp)", "split"), Column("migrations", "migrations", "g"),
            Column("mismatches", "mismatches")]
    rows = [{**r, "split": f"{r['retractions_snapshot']:g}/{r['retractions_recompute']:g}"}
            for r in result["modes"]]
    print_table("", cols, rows)
    print_targets(result["targets"])


def _binned(rows: list[tuple], bin_s: float) -> tuple[list[float], list[float], list[float]]:
    """(bin centres, tokens/s, mean KV occupancy) from timeline rows."""
    rows = [r for r in rows if r[0] >= 0]
    if not rows:
        return [], [], []
    n = int(max(r[0] for r in rows) // bin_s) + 1
    tokens, occ, counts = [0.0] * n, [0.0] * n, [0] * n
    for t, _worker, kv_frac, _slots, new_tokens in rows:
        i = int(t // bin_s)
        tokens[i] += new_tokens
        occ[i] += kv_frac
        counts[i] += 1
    centres = [(i + 0.5) * bin_s for i in range(n)]
    return (centres, [x / bin_s for x in tokens],
            [o / c if c else float("nan") for o, c in zip(occ, counts)])


def _figure(result: dict, plt: Any) -> Any:
    """The figure of `result` (see `common.plot`)."""
    bin_s = QUICK.bin_s if result["model"] == QUICK.model else FULL.bin_s
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 6.5), sharex=True)
    for mode, rows in result["timelines"].items():
        t, tps, occ = _binned(rows, bin_s)
        top.plot(t, tps, label=mode)
        bottom.plot(t, occ, label=mode)
    top.set_ylabel(f"tokens/s (both workers, {bin_s:g} s bins)")
    bottom.set_ylabel("KV pool occupancy (mean of workers)")
    bottom.set_xlabel("time since the workload started (s)")
    bottom.set_ylim(0, 1.05)
    top.set_title(f"e2e under memory pressure ({result['model']} preset, 2 workers)")
    top.legend()
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    return fig


if __name__ == "__main__":
    main()
