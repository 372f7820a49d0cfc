"""Drive a workload through a client: submit at arrival times, show progress, build the report."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import ray

from raysched.client import Client, RequestHandle, SchedulerDiedError, _get
from raysched.sampling import RequestError
from raysched.stats import percentile
from raysched.tokenizer import output_text
from raysched.workload import RequestSpec


def run_workload(client: Client, specs: list[RequestSpec], progress: bool = True) -> dict:
    """Submit every request at its arrival time, wait for all, return the report dict.

    If the scheduler dies and Ray restarts it, the requests still pending are resubmitted to it
    (each completes once, with the tokens it would have had); if it is gone for good, this
    raises `SchedulerDiedError`. An interrupt (KeyboardInterrupt, or the CLI's SIGTERM) ends
    the run early: the report holds what finished, and its summary says `interrupted: true` and
    how many requests did not finish (`unfinished`); the final stats are then asked for with a
    short timeout (Ray's own processes may have been signalled too), else left out."""
    start = time.monotonic()
    records: list[dict] = []
    interrupted = False
    try:
        _drive(client, specs, records, start, progress)
    except KeyboardInterrupt:
        interrupted = True
    duration_s = time.monotonic() - start  # before the stats calls, which can take a while
    timeout = INTERRUPTED_STATS_TIMEOUT_S if interrupted else None
    try:
        stats, idle = _ask(client.scheduler.stats.remote(True), timeout), _ask(client.scheduler.check_idle.remote(), timeout)
    except KeyboardInterrupt:  # while asking: the report of what finished, without the stats
        interrupted, stats, idle = True, {}, {}
    report = build_report(records, stats, duration_s, idle)
    if interrupted:
        report["summary"].update(interrupted=True, unfinished=len(specs) - len(records))
    return report


def interrupted_report(total: int | None, duration_s: float) -> dict:
    """The report of a run interrupted before its workload started (in the cluster's start-up):
    no request finished, all `total` are `unfinished` (None: not known yet), no scheduler stats
    (an empty report is still a report)."""
    report = build_report([], {}, duration_s, {})
    report["summary"].update(interrupted=True, unfinished=total)
    return report


INTERRUPTED_STATS_TIMEOUT_S = 5.0


def _ask(ref: Any, timeout: float | None) -> dict:
    """A scheduler call's answer; with a timeout (after an interrupt), {} when none comes in time."""
    if timeout is None:
        return _get(ref)
    try:
        return _get(ref, timeout)
    except Exception:
        return {}


def _drive(client: Client, specs: list[RequestSpec], records: list[dict], start: float, progress: bool) -> None:
    """The arrival-and-wait loop of `run_workload`; finished requests' records go to `records`."""
    pending: dict[Any, RequestHandle] = {}
    order = sorted(specs, key=lambda s: s.arrival_s)
    i, last_print = 0, 0.0
    while i < len(order) or pending:
        now = time.monotonic() - start
        while i < len(order) and order[i].arrival_s <= now:
            _submit(client, order[i], pending, records)
            i += 1
        wait_s = 0.25 if i >= len(order) else max(0.0, min(0.25, order[i].arrival_s - now))
        if pending:
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
            for ref in done:
                handle = pending.pop(ref)
                try:
                    records.append(_with_text(client, handle, _get(ref)))
                except SchedulerDiedError:
                    handle.resubmit()  # to the restarted scheduler; raises if there is none
                    pending[client.scheduler.wait.remote(handle.request_id)] = handle
        else:
            time.sleep(wait_s)
        if progress and time.monotonic() - last_print > 1.0:
            last_print = time.monotonic()
            _print_progress(client, len(records), len(specs), time.monotonic() - start)


def _submit(client: Client, spec: RequestSpec, pending: dict, records: list[dict]) -> None:
    try:
        try:
            handle = client.submit(list(spec.prompt_ids), spec.sampling, spec.request_id,
                                   priority=spec.priority)
        except SchedulerDiedError:  # died while this submit was in flight: submit to its restarted self
            handle = client.submit(list(spec.prompt_ids), spec.sampling, spec.request_id,
                                   priority=spec.priority)
    except RequestError as err:
        records.append({"request_id": spec.request_id, "prompt_ids": list(spec.prompt_ids),
                        "token_ids": [], "state": "rejected", "error": str(err), "workers": [],
                        "retractions": 0, "ttft_s": None, "latency_s": None, "finish_reason": None})
        return
    pending[client.scheduler.wait.remote(handle.request_id)] = handle


def _with_text(client: Client, handle: RequestHandle, record: dict) -> dict:
    """The record, plus its output text (cut at a stop string) when the model has a tokenizer."""
    tok = client.tokenizer
    if tok is not None:
        p = handle.params
        record["text"] = output_text(tok, record["token_ids"], p.stop, p.min_tokens)
    return record


def _print_progress(client: Client, done: int, total: int, elapsed: float) -> None:
    s = client.stats()
    print(f"\r[{elapsed:6.1f}s] done {done}/{total}  tokens {s['tokens']}  "
          f"retractions {s['retractions']}  migrations {s['migrations']}  "
          f"running {s['tables']['running']}  retracted {s['tables']['retracted']}   ",
          end="", file=sys.stderr, flush=True)


def build_report(records: list[dict], stats: dict, duration_s: float, idle: dict) -> dict:
    finished = [r for r in records if r["state"] == "finished"]
    lat = [r["latency_s"] for r in finished if r["latency_s"] is not None]
    ttft = [r["ttft_s"] for r in finished if r["ttft_s"] is not None]
    tokens = sum(len(r["token_ids"]) for r in finished)
    summary = {
        "requests": len(records), "finished": len(finished),
        "rejected": sum(r["state"] == "rejected" for r in records),
        "failed": sum(r["state"] in ("failed", "aborted") for r in records),
        "tokens": tokens, "duration_s": round(duration_s, 3),
        "tokens_per_s": round(tokens / duration_s, 2) if duration_s > 0 else None,
        "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
    }
    for key in ("retractions", "retractions_snapshot", "retractions_recompute", "resumes", "migrations",
                "cross_node_migrations", "live_migrations", "snapshot_migrations", "rebalance_moves",
                "snapshot_bytes", "snapshot_bytes_held_peak", "store_pressure_fallbacks",
                "snapshots_refused", "worker_failures", "workers_replaced", "recovered", "calls",
                "scheduler_restarted", "resubmitted", "resubmitted_tokens", "snapshots_lost", "preemptions",
                "state_cache_hits", "state_cache_tokens_reused", "resume_bytes_moved"):
        summary[key] = stats.get(key)
    summary["idle_after"] = idle
    summary.update({k: v for k, v in stats.items() if k.startswith("object_store")})
    records.sort(key=lambda r: r["request_id"])
    moved = [r for r in records if len(set(r.get("workers") or ())) > 1]
    summary["moved_examples"] = [f"{r['request_id']} on workers {' -> '.join(map(str, r['workers']))}"
                                 for r in moved[:3]]
    return {"summary": summary, "requests": records}


def format_summary(summary: dict, echo: Callable[[str], None] = print) -> None:
    summary = {k: "-" if v is None else v for k, v in summary.items()}  # a stat the run never got
    rows = [("requests", summary["requests"]), ("finished", summary["finished"]),
            ("rejected", summary["rejected"]), ("tokens", summary["tokens"]),
            ("duration", f"{summary['duration_s']:.2f} s"), ("throughput", f"{summary['tokens_per_s']} tokens/s"),
            ("retractions", f"{summary['retractions']} (snapshot {summary['retractions_snapshot']}, "
                            f"recompute {summary['retractions_recompute']})"),
            ("migrations", f"{summary['migrations']} ({summary['cross_node_migrations']} across nodes)"),
            ("running moved", f"{summary['live_migrations']} live, {summary['snapshot_migrations']} by snapshot "
                              f"({summary['rebalance_moves']} by the rebalancer)"),
            ("resumed elsewhere", ", ".join(summary.get("moved_examples") or ()) or "-"),
            ("snapshot bytes", summary["snapshot_bytes"]),
            ("store fallbacks", summary["store_pressure_fallbacks"]),
            ("latency p50 / p99", _pair(summary["latency_p50_s"], summary["latency_p99_s"])),
            ("ttft p50 / p99", _pair(summary["ttft_p50_s"], summary["ttft_p99_s"])),
            ("worker failures", summary["worker_failures"])]
    if summary.get("interrupted"):
        rows.insert(0, ("interrupted", f"{summary['unfinished']} requests did not finish"))
    echo("summary")
    for name, value in rows:
        echo(f"  {name:<20} {value}")


def _pair(a: float | None, b: float | None) -> str:
    fmt = lambda x: "-" if x in (None, "-") else f"{x * 1000:.0f} ms"  # noqa: E731
    return f"{fmt(a)} / {fmt(b)}"
