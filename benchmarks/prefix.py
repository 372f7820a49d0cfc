"""`raysched bench prefix`: requests that share only part of a prompt, prefix reuse on and off.

2 workers (`small` preset). The modes alternate, on, off, on, off (a fresh cluster each), and
each (on, off) pair is reported side by side, so load that changes during the run lands in both
halves of a pair; after each pair, `shared` runs once more with reuse on and
`state_cache.turn_points: false` (single-turn traffic: no prompt-end or finished-turn points),
for the parked bytes. Workloads, every request of one submitted at once:
- `shared`: 4 groups of 16 requests; a group shares a 1,536-token prefix (a system prompt, a
  document) and each request adds a unique 64-200-token suffix.
- `trap`: vLLM's trap (its issue 45238): 32 requests sharing 1,600 tokens with 600 unique ones,
  and 32 sharing 1,500 with 700 unique (one block-boundary checkpoint per request lands in the
  unique part there: 0 of 64 hits).
- `system300` (full run only): 4 groups of 16 requests sharing a 300-token system prompt, each
  with its own 16-60-token question: shorter than a prefill chunk.
- `repeat` (full run only): 4 prompts of 300-420 tokens, each sent 8 times.

Answers are greedy (16-32 tokens); every run must give the same tokens for every request.
Reuse is counted against the *aligned* shared part, over the requests that can reuse anything
(all but the first of each group): for `shared` and `trap` the whole prefill chunks inside the
shared prefix (1,536, 1,536 and 1,024 tokens with 512-token chunks); for `system300` and
`repeat` the workers' 32-token scan grid short of the prompt's last token (288 of 300; a repeated
prompt: all but its last block). Targets: `shared` TTFT p50 >= 5x lower and throughput >= 2x
with reuse on (in every pair), >= 95% reused; `trap` >= 90% reused in both splits; `system300`
>= 90% of the shared tokens cached on every follower; `repeat` all but the last block cached;
`shared` parked bytes <= 1.5x what sharing needs (the K/V of each group's shared chunks once and
one recurrent state per group), with and without turn points.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (Column, load_average, local_ray, machine, measured_client, percentile, plot_ttft_cdf,
                               print_table, print_targets, ratio, report, warm_up)
from raysched.config import PoolConfig, SchedulerConfig, ServeConfig, StateCacheConfig
from raysched.scheduler.state_cache import GRID_TOKENS

PARKED_PARTS = ("state_cache_bytes_blocks", "state_cache_bytes_chunk", "state_cache_bytes_prompt",
                "state_cache_bytes_finished")  # K/V blocks, then the points' own objects by kind
MODES = ("reuse_on", "reuse_off")
NO_TURNS = "reuse_on_no_turn_points"  # `state_cache.turn_points: false`, the `shared` workload only
PASSES = 2  # on, off, on, off
GRID = GRID_TOKENS  # the branch-point grid (the CPU workers' `WorkerInfo.prefix_grid`)
STORE_BYTES = 1 << 30


@dataclass(frozen=True)
class Group:
    name: str
    requests: int
    shared: int  # tokens of the shared prefix
    unique: tuple[int, int]  # tokens of each request's own suffix (range)


@dataclass(frozen=True)
class Setup:
    model: str
    workloads: dict[str, tuple[Group, ...]]
    output_tokens: tuple[int, int]
    kv_tokens: int
    state_slots: int
    chunk: int  # prefill_chunk_tokens = block size
    min_tokens: int
    vocab: int


FULL = Setup("small", {
    "shared": tuple(Group(f"system{i}", 16, 1536, (64, 200)) for i in range(4)),
    "trap": (Group("1600/600", 32, 1600, (600, 600)), Group("1500/700", 32, 1500, (700, 700))),
    "system300": tuple(Group(f"sys300-{i}", 16, 300, (16, 60)) for i in range(4)),
    "repeat": tuple(Group(f"repeat{n}", 8, n, (0, 0)) for n in (300, 340, 383, 420)),
}, output_tokens=(16, 32), kv_tokens=24576, state_slots=8, chunk=512, min_tokens=64, vocab=8192)
QUICK = Setup("tiny", {
    "shared": tuple(Group(f"system{i}", 4, 96, (8, 24)) for i in range(2)),
    "trap": (Group("100/40", 4, 100, (40, 40)), Group("90/50", 4, 90, (50, 50))),
}, output_tokens=(4, 8), kv_tokens=2048, state_slots=4, chunk=32, min_tokens=16, vocab=512)


def serve_config(setup: Setup, mode: str) -> ServeConfig:
    return ServeConfig(model=setup.model, workers=2, device="cpu",
                       pool=PoolConfig(kv_tokens=setup.kv_tokens, state_slots=setup.state_slots),
                       scheduler=SchedulerConfig(prefill_chunk_tokens=setup.chunk),
                       state_cache=StateCacheConfig(enabled=mode != "reuse_off", min_tokens=setup.min_tokens,
                                                    turn_points=mode != NO_TURNS))


def workload(setup: Setup, groups: tuple[Group, ...], seed: int) -> list[dict]:
    """Requests of every group, interleaved (group 0's first, group 1's first, ...)."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(setup.vocab) for _ in range(n)]  # noqa: E731
    per_group = []
    for g in groups:
        prefix = tok(g.shared)
        per_group.append([{"group": g.name, "index": i, "shared": g.shared,
                           "prompt": prefix + tok(rng.randint(*g.unique)),
                           "max_new_tokens": rng.randint(*setup.output_tokens)} for i in range(g.requests)])
    return [r for batch in zip(*per_group) for r in batch] + [r for g in per_group for r in g[len(per_group[0]):]]


def main(out_dir: Path = Path("bench-out"), quick: bool = False) -> dict:
    load_start = load_average()
    setup = QUICK if quick else FULL
    runs = {}
    with local_ray(num_cpus=2, object_store_bytes=STORE_BYTES):
        for run in range(PASSES):
            for mode in (*MODES, NO_TURNS):
                with measured_client(serve_config(setup, mode)) as (client, costs):
                    warm_up(client)
                    for name, groups in setup.workloads.items():
                        if mode == NO_TURNS and name != "shared":
                            continue
                        requests = workload(setup, groups, seed=len(name))
                        runs[(name, mode, run + 1)] = run_workload(client, costs, requests, mode, name)
    result = _result(setup, runs)
    result["load_avg_1m_start"] = load_start
    result["load_avg_1m_end"] = load_average()
    return report(out_dir, "prefix", result, _print, _figure)


def run_workload(client, costs, requests: list[dict], mode: str, name: str) -> dict:
    """Submit every request at once; wait for all. Stats are differences over this workload."""
    import ray

    before, cost0, load = client.stats(), costs(), load_average()
    start = time.monotonic()
    handles = [client.submit(r["prompt"], {"max_new_tokens": r["max_new_tokens"]}) for r in requests]
    records = ray.get([client.scheduler.wait.remote(h.request_id) for h in handles])
    duration = time.monotonic() - start
    after, cost1 = client.stats(), costs()
    stats = {k: after[k] - before[k] for k in after if k.startswith("state_cache_hits") or k in (
        "state_cache_misses", "state_cache_tokens_reused", "state_cache_fallbacks")}
    stats.update({k: after[k] for k in ("state_cache_bytes", "state_cache_points", "state_cache_chunks",
                                        "state_cache_evictions", *PARKED_PARTS)})
    rows = [{**{k: r[k] for k in ("group", "index", "shared")}, "prompt_len": len(r["prompt"]),
             "cached_tokens": rec["cached_tokens"], "cache_kind": rec["cache_kind"],
             "cache_source": rec["cache_source"], "ttft_s": rec["ttft_s"], "token_ids": rec["token_ids"]}
            for r, rec in zip(requests, records)]
    worker_cpu = (cost1["worker_cpu_s"] or 0) - (cost0["worker_cpu_s"] or 0)
    ttft = percentile([x["ttft_s"] for x in rows], 50)
    print(f"{name:>9} {mode:>9}: {sum(len(x['token_ids']) for x in rows) / duration:.1f} tokens/s in "
          f"{duration:.1f} s, TTFT p50 {ttft:.2f} s, hits {stats['state_cache_hits']}, cached "
          f"{sum(x['cached_tokens'] for x in rows)} of {sum(x['prompt_len'] for x in rows)} prompt tokens, "
          f"load {load:.1f}", flush=True)
    return {"duration_s": duration, "requests": rows, "stats": stats, "worker_cpu_s": worker_cpu, "load_avg_1m": load}


# ---------------------------------------------------------------------------- analysis
def reuse(rows: list[dict], align: int) -> dict:
    """Aligned shared tokens reused, per group, over the requests that could reuse them (the
    shared part rounded down to `align`, short of the prompt's last token), and the least any
    of those requests cached of the whole shared part."""
    by_group = {}
    for r in rows:
        by_group.setdefault(r["group"], []).append(r)
    out = {}
    for g, rs in by_group.items():
        aligned = min(rs[0]["shared"], rs[0]["prompt_len"] - 1) // align * align
        later = [r for r in rs if r["index"] > 0]
        got = sum(min(r["cached_tokens"], aligned) for r in later)
        out[g] = {"aligned_shared": aligned, "requests": len(later), "reused": got,
                  "fraction": got / (aligned * len(later)) if aligned and later else None,
                  "least_of_shared": min((min(r["cached_tokens"], r["shared"]) / r["shared"] for r in later),
                                         default=None)}
    return out


def align_of(name: str, chunk: int) -> int:
    """What a workload's reuse is counted against: whole prefill chunks, or the scan grid."""
    return GRID if name in ("system300", "repeat") else chunk


def _row(name: str, mode: str, run_index: int, run: dict, chunk: int) -> dict:
    rows = run["requests"]
    tokens = sum(len(r["token_ids"]) for r in rows)
    groups = reuse(rows, align_of(name, chunk))
    prompt_tokens = sum(r["prompt_len"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    return {"workload": name, "mode": mode, "pair": run_index, "duration_s": run["duration_s"], "tokens": tokens,
            "tokens_per_s": tokens / run["duration_s"],
            "ttft_p50_s": percentile([r["ttft_s"] for r in rows], 50),
            "ttft_p99_s": percentile([r["ttft_s"] for r in rows], 99),
            "prompt_tokens": prompt_tokens, "prefilled_tokens": prompt_tokens - cached,
            "reuse": groups, "worker_cpu_s": run["worker_cpu_s"], "load_avg_1m": run["load_avg_1m"], **run["stats"]}


def _mismatches(runs: dict, name: str) -> list[int]:
    """Requests whose tokens differ, in any run, from the first run with reuse off."""
    want = runs[(name, "reuse_off", 1)]["requests"]
    return sorted({i for (n, _, _), run in runs.items() if n == name
                   for i, (a, b) in enumerate(zip(run["requests"], want)) if a["token_ids"] != b["token_ids"]})


def _pair_ratios(rows: dict, name: str) -> list[tuple[float | None, float | None]]:
    """(TTFT p50 off/on, throughput on/off) of each (on, off) pair, in run order."""
    pairs = sorted({k for (n, _, k) in rows if n == name})
    return [(ratio(rows[(name, "reuse_off", k)]["ttft_p50_s"], rows[(name, "reuse_on", k)]["ttft_p50_s"]),
             ratio(rows[(name, "reuse_on", k)]["tokens_per_s"], rows[(name, "reuse_off", k)]["tokens_per_s"]))
            for k in pairs]


def _least(values: list) -> float | None:
    return None if not values or None in values else min(values)


def ideal_parked_bytes(setup: Setup, row: dict) -> int:
    """What sharing needs parked: the K/V of each group's aligned shared tokens, once, and one
    recurrent state per group (its branch point)."""
    from actors.presets import PRESETS

    config = PRESETS[setup.model]
    groups = row["reuse"].values()
    return sum(g["aligned_shared"] for g in groups) * config.kv_bytes_per_token(4) + \
        len(groups) * config.state_bytes_per_slot(4)


def _parked_targets(setup: Setup, rows: dict) -> dict:
    """`shared`: parked bytes over what sharing needs (`ideal_parked_bytes`), with the default
    config (prompt-end and finished-turn points kept for chats' next turns, until the budget
    evicts them) and with `turn_points: false` (single-turn traffic)."""
    out = {}
    for mode, name in (("reuse_on", "shared_parked_over_needed"),
                       (NO_TURNS, "shared_parked_over_needed_without_turn_points")):
        on = [r for (n, m, _), r in rows.items() if n == "shared" and m == mode]
        worst = max((r["state_cache_bytes"] / ideal_parked_bytes(setup, r) for r in on), default=None)
        if worst is not None:
            out[name] = {"value": worst, "target": "<= 1.5", "met": worst <= 1.5}
    return out


def _targets(setup: Setup, rows: dict, mismatches: dict) -> dict:
    pairs = _pair_ratios(rows, "shared")
    ttft, tput = _least([t for t, _ in pairs]), _least([x for _, x in pairs])
    shared = _least([_fraction(r["reuse"].values()) for (n, m, _), r in rows.items() if n == "shared" and m == "reuse_on"])
    out = {
        "shared_ttft_p50_off_over_on": {"value": ttft, "target": ">= 5 in every pair", "met": bool(ttft and ttft >= 5)},
        "shared_throughput_on_over_off": {"value": tput, "target": ">= 2 in every pair", "met": bool(tput and tput >= 2)},
        "shared_aligned_prefix_reused": {"value": shared, "target": ">= 0.95", "met": bool(shared and shared >= 0.95)},
    }
    for k, (t, x) in enumerate(pairs, 1):
        out[f"shared_pair{k}_ttft_p50_off_over_on"] = {"value": t, "target": "pair " + str(k), "met": None}
        out[f"shared_pair{k}_throughput_on_over_off"] = {"value": x, "target": "pair " + str(k), "met": None}
    for group, g in rows[("trap", "reuse_on", 1)]["reuse"].items():
        out[f"trap_{group}_aligned_prefix_reused"] = {"value": g["fraction"], "target": ">= 0.90",
                                                      "met": bool(g["fraction"] and g["fraction"] >= 0.9)}
    out.update(_grid_targets(rows))
    out.update(_parked_targets(setup, rows))
    n = sum(len(v) for v in mismatches.values())
    out["same_tokens"] = {"value": n, "target": "0 mismatched requests", "met": n == 0}
    return out


def _grid_targets(rows: dict) -> dict:
    """`system300`: the least any follower cached of the shared 300 tokens; `repeat`: the
    aligned part (all but the last block) reused by every follower. Present in a full run."""
    out = {}
    on = [r for (n, m, _), r in rows.items() if n == "system300" and m == "reuse_on"]
    if on:
        least = _least([g["least_of_shared"] for r in on for g in r["reuse"].values()])
        out["system300_least_shared_cached"] = {"value": least, "target": ">= 0.90 on every follower",
                                                "met": bool(least and least >= 0.9)}
    on = [r for (n, m, _), r in rows.items() if n == "repeat" and m == "reuse_on"]
    if on:
        least = _least([g["fraction"] for r in on for g in r["reuse"].values()])
        out["repeat_all_but_last_block_reused"] = {"value": least, "target": "1.0", "met": least == 1.0}
    return out


def _fraction(groups) -> float | None:
    groups = list(groups)
    total = sum(g["aligned_shared"] * g["requests"] for g in groups)
    return sum(g["reused"] for g in groups) / total if total else None


def _result(setup: Setup, runs: dict) -> dict:
    rows = {key: _row(*key, run, setup.chunk) for key, run in runs.items()}  # key: (workload, mode, pair)
    mismatches = {name: _mismatches(runs, name) for name in setup.workloads}
    return {"model": setup.model, "workers": 2, "chunk_tokens": setup.chunk,
            "workloads": {n: [g.__dict__ | {"unique": list(g.unique)} for g in gs] for n, gs in setup.workloads.items()},
            "machine": machine(), "modes": list(rows.values()), "targets": _targets(setup, rows, mismatches),
            "mismatched_requests": mismatches,
            "per_request": {f"{n}/{m}/{k}": [{x: v for x, v in r.items() if x != "token_ids"} for r in run["requests"]]
                            for (n, m, k), run in runs.items()}}


# ---------------------------------------------------------------------------- output
def _print(result: dict) -> None:
    print(f"prefix: model {result['model']}, 2 workers, prefill chunk {result['chunk_tokens']}")
    cols = [Column("workload", "workload"), Column("pair", "pair", "d"), Column("mode", "mode"),
            Column("tokens/s", "tokens_per_s", ".1f"),
            Column("time s", "duration_s", ".1f"), Column("TTFT p50 s", "ttft_p50_s", ".2f"),
            Column("TTFT p99 s", "ttft_p99_s", ".2f"), Column("prefilled", "prefilled_tokens", "d"),
            Column("hits", "state_cache_hits", "d"), Column("chunk/prompt/fin", "split"),
            Column("same wkr/node/other", "where"), Column("reused", "reused"),
            Column("points", "state_cache_points", "d"), Column("blocks", "state_cache_chunks", "d"),
            Column("parked MB", "parked_mb", ".1f"), Column("of it turn pts MB", "turn_mb", ".1f"),
            Column("load", "load_avg_1m", ".1f")]
    rows = [{**r, "split": f"{r['state_cache_hits_chunk']}/{r['state_cache_hits_prompt']}/"
                           f"{r['state_cache_hits_finished']}",
             "where": f"{r['state_cache_hits_same_worker']}/{r['state_cache_hits_same_node']}/"
                      f"{r['state_cache_hits_other_node']}",
             "reused": " ".join(f"{g['fraction']:.0%}" if g["fraction"] is not None else "-" for g in r["reuse"].values()),
             "parked_mb": r["state_cache_bytes"] / 1e6,
             "turn_mb": (r["state_cache_bytes_prompt"] + r["state_cache_bytes_finished"]) / 1e6}
            for r in sorted(result["modes"], key=lambda r: (r["workload"], r["pair"], r["mode"]))]
    print_table("", cols, rows)
    print_targets(result["targets"])


def _figure(result: dict, plt: Any) -> Any:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name in zip(axes, ("shared", "trap")):
        plot_ttft_cdf(ax, {mode: [r["ttft_s"] for r in result["per_request"][f"{name}/{mode}/1"]] for mode in MODES},
                      f"{name} ({result['model']}, 2 workers)")
    return fig



if __name__ == "__main__":
    main()
