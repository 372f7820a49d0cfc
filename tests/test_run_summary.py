"""`raysched run`'s summary counts every way a request moved between workers.

Seen in the README walk (stop 53): "resumed elsewhere: req-0014 on workers 1 -> 0" beside
"retractions 0" and "migrations 0". The rebalancer had moved the running request live
(`Migrator.migrate`); `migrations` counts only resumes on another worker after a retraction,
and the summary showed no count of live moves. The summary is built here from the scheduler's
own `Counters` (no Ray): a live move and a move by snapshot, as `Migrator` records them, must
show in the "running moved" row beside the request the record lists. Control: counters with
no move give 0 live and 0 by snapshot, and "resumed elsewhere" lists nothing.
"""

from __future__ import annotations

from raysched.runner import build_report, format_summary
from raysched.stats import Counters


def _record(rid: str, workers: list[int]) -> dict:
    return {"request_id": rid, "prompt_ids": [1, 2], "token_ids": [3, 4], "state": "finished", "error": None,
            "workers": workers, "retractions": 0, "ttft_s": 0.1, "latency_s": 0.2, "finish_reason": "length"}


def _summary_lines(counters: Counters, records: list[dict]) -> dict[str, str]:
    stats = counters.summary({"running": 0}, [])
    lines: list[str] = []
    format_summary(build_report(records, stats, 1.0, {})["summary"], echo=lines.append)
    rows = {}
    for line in lines:
        name, _, value = line.strip().partition("  ")
        rows[name.strip()] = value.strip()
    return rows


def test_live_and_snapshot_moves_of_running_requests_show_in_the_summary():
    counters = Counters()
    counters.rebalance_moves += 1  # what `Migrator.rebalance` counts before its move
    counters.on_migration("live", 4096, 512, 0.01)
    counters.on_migration("snapshot", 0, 8192, 0.05)
    rows = _summary_lines(counters, [_record("req-0", [1, 0]), _record("req-1", [0])])
    assert rows["migrations"] == "0 (0 across nodes)"  # no resume after a retraction
    assert rows["running moved"] == "1 live, 1 by snapshot (1 by the rebalancer)"
    assert rows["resumed elsewhere"] == "req-0 on workers 1 -> 0"


def test_control_no_move_counts_nothing_and_lists_nothing():
    rows = _summary_lines(Counters(), [_record("req-0", [1]), _record("req-1", [0])])
    assert rows["running moved"] == "0 live, 0 by snapshot (0 by the rebalancer)"
    assert rows["resumed elsewhere"] == "-"
