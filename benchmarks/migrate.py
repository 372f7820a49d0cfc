"""`raysched bench migrate`: move one decoding request between two workers, live (pre-copy +
stop-and-copy) vs a blocking snapshot copy vs recompute, at contexts of 256 to 4k tokens
(`small` preset; `--quick`: `tiny`, 256 and 1k), side by side in one run.

A scheduler with two workers (1 CPU each, embedded Ray), one decode step per call so every token
is its own arrival at the client. Per context n and mode, a request with an n-token prompt
streams; after `MOVE_AFTER` tokens the driver calls `client.migrate(rid, mode=...)`. The client
records each token's arrival time: the downtime is the largest gap between consecutive tokens
from the call to 8 tokens after it, against the median gap before the call (one decode step as
the client sees it). The source's slowdown during the pre-copy: the median gap between tokens
that arrived from the call until the stop-and-copy began (the request still decodes on its
source while its blocks are copied), against that median gap before. Every mode's tokens must
equal an unmoved run's. Before measuring, one warm-up migration per mode.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Column, label_axes, load_average, local_ray, machine, print_table, random_prompt, report
from raysched.config import MigrationConfig, PoolConfig, SchedulerConfig, ServeConfig, StateCacheConfig

FULL_LENGTHS = (256, 1024, 4096, 16384)
QUICK_LENGTHS = (256, 1024)
MODES = ("live", "snapshot", "recompute")
MOVE_AFTER = 12  # tokens streamed before the move
AFTER = 24  # tokens after it
TARGET_STEP_RATIO, TARGET_FLATNESS, TARGET_SOURCE_SLOWDOWN = 2.0, 1.5, 1.05


def main(out_dir: Path = Path("bench-out"), quick: bool = False) -> dict:
    import raysched

    load_start = load_average()
    model, lengths = ("tiny", QUICK_LENGTHS) if quick else ("small", FULL_LENGTHS)
    config = ServeConfig(model=model, workers=2, device="cpu",
                         pool=PoolConfig(kv_tokens=max(lengths) + 2 * (MOVE_AFTER + AFTER + 16), state_slots=4),
                         scheduler=SchedulerConfig(decode_steps_per_call=1, prefill_chunk_tokens=0,
                                                   prefill_budget_tokens=0),
                         state_cache=StateCacheConfig(enabled=False), migration=MigrationConfig())
    with local_ray(num_cpus=3):
        client = raysched.launch(config)
        try:
            vocab = client.vocab_size()
            for mode in MODES:  # warm-up: first calls pay lazy initialisation on both sides
                _move_one(client, random_prompt(64, vocab, seed=1), mode)
            rows = [_row(client, n, vocab) for n in lengths]
            stats = client.stats()
        finally:
            client.shutdown()
    result = _result(model, rows, stats)
    result["load_avg_1m_start"], result["load_avg_1m_end"] = load_start, load_average()
    return report(out_dir, "migrate", result, _print, _figure)


def _row(client: Any, n: int, vocab: int) -> dict:
    prompt = random_prompt(n, vocab, seed=n)
    ref = client.submit(prompt, {"max_new_tokens": MOVE_AFTER + AFTER}).result()["token_ids"]
    row: dict = {"tokens": n}
    for mode in MODES:
        got = _move_one(client, prompt, mode)
        row[f"{mode}_gap_s"] = got["gap_s"]
        row[f"{mode}_same"] = got["tokens"] == ref
        row["step_s"] = got["step_s"] if mode == "live" else row.get("step_s")
        if mode == "live":
            row.update(live_stages=got["moved"]["stages"], live_precopy_bytes=got["moved"]["precopy_bytes"],
                       live_final_bytes=got["moved"]["final_bytes"], live_downtime_s=got["moved"]["downtime_s"],
                       precopy_step_s=got["precopy_step_s"], precopy_gaps=got["precopy_gaps"])
    row["live_gap_steps"] = row["live_gap_s"] / row["step_s"]
    row["precopy_slowdown"] = None if row["precopy_step_s"] is None else row["precopy_step_s"] / row["step_s"]
    return row


def _move_one(client: Any, prompt: list[int], mode: str) -> dict:
    """Stream a request, move it after MOVE_AFTER tokens; its tokens, arrival gaps and the move."""
    handle = client.submit(prompt, {"max_new_tokens": MOVE_AFTER + AFTER}, stream=True)
    arrivals: list[float] = []
    tokens: list[int] = []
    enough = threading.Event()

    def read() -> None:
        for tok in handle.stream():
            tokens.append(tok)
            arrivals.append(time.perf_counter())
            if len(tokens) == MOVE_AFTER:
                enough.set()
        enough.set()

    reader = threading.Thread(target=read)
    reader.start()
    enough.wait()
    t_call = time.perf_counter()
    print(f"  moving a request of {len(prompt)} prompt tokens ({mode}) after {len(tokens)} tokens", flush=True)
    moved = client.migrate(handle.request_id, mode=mode)
    precopy_end = time.perf_counter() - moved["downtime_s"]  # the stop-and-copy began about then
    print(f"  -> {moved}", flush=True)
    reader.join()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    first_after = next(i for i, t in enumerate(arrivals) if t > t_call)
    before = gaps[1:max(2, first_after - 1)]
    around = gaps[max(0, first_after - 1):first_after + 8]
    precopy = [b - a for a, b in zip(arrivals, arrivals[1:]) if a >= t_call and b <= precopy_end]
    return {"tokens": tokens, "moved": moved, "gap_s": max(around), "step_s": statistics.median(before),
            "precopy_step_s": statistics.median(precopy) if precopy else None, "precopy_gaps": len(precopy)}


def _result(model: str, rows: list[dict], stats: dict) -> dict:
    first, last = rows[0], rows[-1]
    targets = {
        "live downtime <= 2 decode steps (largest context)": {
            "value": last["live_gap_steps"], "target": TARGET_STEP_RATIO,
            "met": last["live_gap_steps"] <= TARGET_STEP_RATIO},
        f"live downtime at {last['tokens']} / at {first['tokens']} tokens <= 1.5": {
            "value": last["live_gap_s"] / first["live_gap_s"], "target": TARGET_FLATNESS,
            "met": last["live_gap_s"] / first["live_gap_s"] <= TARGET_FLATNESS},
        "source's decode steps during pre-copy <= 1.05x its steps before (largest context)": {
            "value": last["precopy_slowdown"], "target": TARGET_SOURCE_SLOWDOWN,
            "met": None if last["precopy_slowdown"] is None else last["precopy_slowdown"] <= TARGET_SOURCE_SLOWDOWN},
        "tokens identical in every mode": {
            "value": None, "target": True, "met": all(r[f"{m}_same"] for r in rows for m in MODES)},
    }
    return {"model": model, "machine": machine(), "rows": rows, "targets": targets,
            "migration_downtime_s": stats["migration_downtime_s"], "live_migrations": stats["live_migrations"]}


def _print(result: dict) -> None:
    cols = [Column("tokens", "tokens"), Column("step ms", "step_s", ".1f", 1e3),
            Column("live gap ms", "live_gap_s", ".1f", 1e3), Column("live/step", "live_gap_steps", ".2f"),
            Column("stop-copy ms", "live_downtime_s", ".1f", 1e3), Column("stages", "live_stages"),
            Column("pre-copy step ms", "precopy_step_s", ".1f", 1e3), Column("(gaps)", "precopy_gaps"),
            Column("precopy KB", "live_precopy_bytes", ".0f", 1e-3), Column("final KB", "live_final_bytes", ".0f", 1e-3),
            Column("snapshot gap ms", "snapshot_gap_s", ".1f", 1e3),
            Column("recompute gap ms", "recompute_gap_s", ".1f", 1e3),
            Column("same", "live_same"), Column("same snap", "snapshot_same"), Column("same recomp", "recompute_same")]
    print_table(f"migrate one decoding request, model {result['model']}: largest token gap at the client "
                "around the move", cols, result["rows"])
    for name, t in result["targets"].items():
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        verdict = "not measured: no token arrived during the pre-copy" if t["met"] is None else (
            "met" if t["met"] else "MISSED")
        print(f"target {name}: {value} ({verdict})")


def _figure(result: dict, plt: Any) -> Any:
    rows = result["rows"]
    xs = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for mode, marker in zip(MODES, "os^"):
        ax.loglog(xs, [r[f"{mode}_gap_s"] * 1e3 for r in rows], marker + "-", label=f"{mode}: largest gap")
    ax.loglog(xs, [r["step_s"] * 1e3 for r in rows], "k--", label="median gap (one decode step)")
    label_axes(ax, "context length (tokens)", "ms", f"downtime of a moved request at the client ({result['model']})",
               which="both")
    return fig



if __name__ == "__main__":
    main()
