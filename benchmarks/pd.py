"""`raysched bench pd`: prefill/decode roles against colocated workers with chunked prefill.

Workload: steady decoding streams start at t=0; long prompts (2k-4k tokens on `small`) arrive
every few seconds while they decode. Two modes on one embedded Ray instance, the same requests:

- `colocated`: 2 workers, each prefills and decodes; a long prompt prefills in chunks
               (`prefill_chunk_tokens`) between the decode steps of the streams beside it;
- `roles`:     1 prefill worker + 1 decode worker; the long prompt prefills on the prefill worker
               and is handed over (a snapshot through the object store) to the decode worker.

Measured: each stream's inter-token gap as its client sees it (the time between two tokens
arriving; tokens of one call arrive together), the long prompts' TTFT (the scheduler's clock),
and throughput. Targets: stream gap p99 at least 3x lower with roles; long-prompt TTFT at most
1.3x higher; the same tokens in both modes (greedy and seeded-sampled requests).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (Column, load_average, local_ray, machine, measured_client, percentile, plain_setup,
                               print_table, print_targets, report, warm_up)
from raysched.config import PoolConfig, RolesConfig, SchedulerConfig, ServeConfig
from raysched.sampling import SamplingParams

MODES = ("colocated", "roles")


@dataclass(frozen=True)
class Setup:
    model: str
    kv_tokens: int  # per worker
    state_slots: int  # per worker
    streams: int  # decoding streams, started at t=0
    stream_prompt: int
    stream_new: int
    long: int  # long prompts
    long_prompt: tuple[int, int]
    long_new: int
    first_long_s: float
    long_every_s: float
    chunk_tokens: int  # prefill_chunk_tokens (and budget) of both modes
    vocab: int


FULL = Setup("small", kv_tokens=12288, state_slots=8, streams=4, stream_prompt=64, stream_new=320, long=4,
             long_prompt=(2048, 4096), long_new=8, first_long_s=2.0, long_every_s=4.0, chunk_tokens=512, vocab=8192)
QUICK = Setup("tiny", kv_tokens=2048, state_slots=6, streams=2, stream_prompt=16, stream_new=48, long=2,
              long_prompt=(300, 400), long_new=4, first_long_s=0.3, long_every_s=0.5, chunk_tokens=64, vocab=512)


@dataclass(frozen=True)
class Item:
    rid: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    arrival_s: float
    is_long: bool


def workload(setup: Setup) -> list[Item]:
    rng = random.Random(11)
    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(setup.vocab) for _ in range(n))
    items = []
    for i in range(setup.streams):  # every other stream samples (seeded), the rest are greedy
        sp = SamplingParams(max_new_tokens=setup.stream_new, temperature=0.8 if i % 2 else 0.0, top_p=0.9, seed=100 + i)
        items.append(Item(f"stream-{i}", prompt(setup.stream_prompt), sp, 0.0, False))
    for i in range(setup.long):
        sp = SamplingParams(max_new_tokens=setup.long_new)
        items.append(Item(f"long-{i}", prompt(rng.randint(*setup.long_prompt)), sp,
                          setup.first_long_s + i * setup.long_every_s, True))
    return items


def serve_config(setup: Setup, mode: str) -> ServeConfig:
    sched = SchedulerConfig(prefill_chunk_tokens=setup.chunk_tokens, prefill_budget_tokens=setup.chunk_tokens)
    roles = RolesConfig(prefill=1, decode=1) if mode == "roles" else None
    return ServeConfig(model=setup.model, workers=2, device="cpu", roles=roles, scheduler=sched,
                       pool=PoolConfig(kv_tokens=setup.kv_tokens, state_slots=setup.state_slots))


def main(out_dir: Path = Path("bench-out"), quick: bool = False) -> dict:
    load_start = load_average()
    setup = QUICK if quick else FULL
    items = workload(setup)
    with local_ray(num_cpus=3):
        runs = {mode: run_mode(setup, mode, items) for mode in MODES}
    result = _result(setup, runs)
    result["load_avg_1m_start"] = load_start
    return report(out_dir, "pd", result, _print, _figure)


def run_mode(setup: Setup, mode: str, items: list[Item]) -> dict:
    with measured_client(serve_config(setup, mode)) as (client, costs):
        warm_up(client)
        t0 = time.monotonic()
        records = drive(client, items)
        duration = time.monotonic() - t0
        cost = costs()
        stats = client.stats()
    tokens = sum(len(r["token_ids"]) for r in records.values())
    print(f"{mode:>10}: {tokens / duration:.1f} tokens/s in {duration:.1f} s, {stats['handovers']} hand-overs, "
          f"worker CPU {cost['worker_cpu_s'] or 0:.1f} s", flush=True)
    return {"records": records, "stats": stats, "duration_s": duration, "tokens": tokens, **cost}


def drive(client: Any, items: list[Item]) -> dict[str, dict]:
    """Submit each item at its arrival time from its own thread; streams record when each of
    their tokens arrived. Returns request id -> its record (plus `arrivals` for streams)."""
    records: dict[str, dict] = {}
    t0 = time.monotonic()

    def one(item: Item) -> None:
        time.sleep(max(0.0, t0 + item.arrival_s - time.monotonic()))  # the item's arrival time
        handle = client.submit(list(item.prompt), item.sampling)
        arrivals = []
        for _ in handle.stream():
            arrivals.append(time.monotonic())
        record = handle.result(timeout=600)
        record["arrivals"] = arrivals
        records[item.rid] = record

    threads = [threading.Thread(target=one, args=(item,)) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


# ---------------------------------------------------------------------------- analysis
def gaps(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def _row(mode: str, run: dict, items: list[Item], reference: dict) -> dict:
    recs = run["records"]
    stream_gaps = [g for it in items if not it.is_long for g in gaps(recs[it.rid]["arrivals"])]
    long_ttft = [recs[it.rid]["ttft_s"] for it in items if it.is_long]
    st = run["stats"]
    return {"mode": mode, "tokens_per_s": run["tokens"] / run["duration_s"], "duration_s": run["duration_s"],
            "gap_p50_s": percentile(stream_gaps, 50), "gap_p99_s": percentile(stream_gaps, 99),
            "gap_max_s": max(stream_gaps, default=None),
            "long_ttft_p50_s": percentile(long_ttft, 50), "long_ttft_max_s": max(long_ttft, default=None),
            "handovers": st["handovers"], "handover_bytes": st["handover_bytes"],
            "handover_p50_s": st["handover_latency_p50_s"], "handover_p99_s": st["handover_latency_p99_s"],
            "prefill_tokens_by_role": st["prefill_tokens_by_role"], "retractions": st["retractions"],
            "worker_cpu_s": run["worker_cpu_s"], "worker_busy_s": run["worker_busy_s"],
            "mismatches": sum(recs[it.rid]["token_ids"] != reference[it.rid] for it in items),
            "requests": len(items), "one_token_requests": sum(it.sampling.max_new_tokens == 1 for it in items),
            "prefilled_then_decoded": sum(_prefilled_then_decoded(recs[it.rid]["workers"]) for it in items)}


def _prefilled_then_decoded(workers: list[int]) -> bool:
    """Did a request start on the prefill worker (0) and end on the decode worker (1)?"""
    return workers[:1] == [0] and workers[-1:] == [1]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _targets(rows: dict) -> dict:
    gap = _ratio(rows["colocated"]["gap_p99_s"], rows["roles"]["gap_p99_s"])
    ttft = _ratio(rows["roles"]["long_ttft_p50_s"], rows["colocated"]["long_ttft_p50_s"])
    tput = _ratio(rows["roles"]["tokens_per_s"], rows["colocated"]["tokens_per_s"])
    return {
        "stream_gap_p99_colocated_over_roles": {"value": gap, "target": ">= 3", "met": bool(gap and gap >= 3)},
        "long_ttft_p50_roles_over_colocated": {"value": ttft, "target": "<= 1.3", "met": bool(ttft and ttft <= 1.3)},
        "throughput_roles_over_colocated": {"value": tput, "target": "(informational)", "met": None},
        "same_tokens_both_modes": {"value": rows["roles"]["mismatches"], "target": "0 mismatched requests",
                                   "met": rows["roles"]["mismatches"] == 0},
    }


def _result(setup: Setup, runs: dict) -> dict:
    items = workload(setup)
    reference = {rid: r["token_ids"] for rid, r in runs["colocated"]["records"].items()}
    rows = {m: _row(m, runs[m], items, reference) for m in MODES}
    return {"model": setup.model, "workers": 2,
            "setup": plain_setup(setup),
            "machine": machine(), "modes": list(rows.values()), "targets": _targets(rows),
            "stream_gaps": {m: [g for it in items if not it.is_long for g in gaps(runs[m]["records"][it.rid]["arrivals"])]
                            for m in MODES}}


# ---------------------------------------------------------------------------- output
def _print(result: dict) -> None:
    s = result["setup"]
    print(f"pd: model {result['model']}, 2 workers; {s['streams']} streams ({s['stream_new']} tokens each) from t=0, "
          f"{s['long']} prompts of {s['long_prompt']} tokens from t={s['first_long_s']} s every {s['long_every_s']} s; "
          f"chunk {s['chunk_tokens']} tokens")
    cols = [Column("mode", "mode"), Column("tokens/s", "tokens_per_s", ".1f"), Column("time s", "duration_s", ".1f"),
            Column("gap p50 ms", "gap_p50_s", ".1f", 1e3), Column("gap p99 ms", "gap_p99_s", ".1f", 1e3),
            Column("gap max ms", "gap_max_s", ".1f", 1e3), Column("long TTFT p50 s", "long_ttft_p50_s", ".2f"),
            Column("long TTFT max s", "long_ttft_max_s", ".2f"), Column("hand-overs", "handovers", "d"),
            Column("hand-over MB", "handover_bytes", ".1f", 1e-6), Column("hand-over p50 ms", "handover_p50_s", ".1f", 1e3),
            Column("hand-over p99 ms", "handover_p99_s", ".1f", 1e3), Column("worker CPU s", "worker_cpu_s", ".1f"),
            Column("mismatches", "mismatches", "d")]
    print_table("", cols, result["modes"])
    print_targets(result["targets"])


def _figure(result: dict, plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, values in result["stream_gaps"].items():
        xs = sorted(g * 1e3 for g in values if g > 0)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=mode, drawstyle="steps-post")
    ax.set_xscale("log")
    ax.set_xlabel("stream inter-token gap, client side (ms)")
    ax.set_ylabel("fraction of gaps")
    ax.set_title(f"decode streams beside long prompts ({result['model']} preset, 2 workers)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig



if __name__ == "__main__":
    main()
