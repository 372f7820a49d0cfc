"""A drain says where each request of the drained worker went (issue 36: "moved 0 request(s)"
with 40 requests queued said nothing).

`Migrator.drain` over fake workers (no Ray): each request on the worker is moved by its own
path (a decoding one live, or by snapshot when the live move stays; a prefilling one by
snapshot, or requeued without one; one that ends meanwhile), and the report's counts must
equal what those paths did, request by request; the queue it found is reported apart.
Control: draining the other worker, which holds nothing, moves nothing and still reports the
same queue (the queued requests are not counted as moved).
"""

from __future__ import annotations

import asyncio

from raysched.config import MigrationConfig, ServeConfig
from raysched.request import Request, State
from raysched.scheduler.migration import Migrator, drain_report
from tests.test_scheduler_parts import LIMITS, FakeWorker, parts, running_request

OUTCOMES = {  # generated tokens -> (what its live move answers, what its snapshot retraction answers)
    5: ("live", None),
    6: ("stayed", "snapshot"),
    0: (None, "snapshot"),  # still prefilling: no live move is tried
    1: ("stayed", "requeued"),  # no room for a snapshot: recomputed
    2: ("ended", None),
}


def _drain(index: int) -> tuple[dict, dict[str, str]]:
    """Drain worker `index` of a 2-worker fleet whose worker 0 holds one request per OUTCOMES
    entry and whose queue holds 3; returns the report and each request's path."""
    async def scenario() -> tuple[dict, dict[str, str]]:
        p = parts(ServeConfig(workers=2), [FakeWorker(0), FakeWorker(1)])
        w0 = p["fleet"].slots[0]
        reqs = {running_request(p, w0, generated).request_id: generated for generated in OUTCOMES}
        for _ in range(3):
            p["table"].submit([1, 2, 3], {"max_new_tokens": 4}, LIMITS)
        mig = Migrator(MigrationConfig(), p["table"], p["fleet"], p["counters"], p["recovery"], p["faults"],
                       p["ledger"])
        went: dict[str, str] = {}

        def off(req: Request, mode: str) -> str:  # what the source's loop does once the move is decided
            w0.view.running.remove(req)
            req.state = State.FINISHED if mode == "ended" else State.RETRACTED
            went[req.request_id] = mode
            return mode

        async def migrate(request_id: str, worker: int | None = None, mode: str = "live") -> dict:
            live = OUTCOMES[reqs[request_id]][0]
            req = p["table"].requests[request_id]
            return {"mode": live if live == "stayed" else off(req, live)}

        async def retract_by_snapshot(req: Request, recompute: bool = False) -> str:
            return off(req, OUTCOMES[reqs[req.request_id]][1])

        mig.migrate, mig.retract_by_snapshot = migrate, retract_by_snapshot
        return await mig.drain(index), went

    return asyncio.run(scenario())


def test_drain_reports_where_each_request_went_and_the_queue_apart() -> None:
    report, went = _drain(0)
    paths = list(went.values())
    assert sorted(paths) == sorted(["live", "snapshot", "snapshot", "requeued", "ended"])  # each by its own path
    want = {mode: paths.count(mode) for mode in ("live", "snapshot", "requeued", "ended")}
    assert {k: report[k] for k in want} == want
    assert (report["moved"], report["fallbacks"], report["queued"]) == (4, 3, 3)


def test_control_draining_an_empty_worker_moves_nothing_but_reports_the_queue() -> None:
    report, went = _drain(1)
    assert went == {}
    assert (report["moved"], report["live"], report["snapshot"], report["requeued"], report["queued"]) == (0, 0, 0, 0, 3)


def test_a_failed_live_move_counts_as_requeued() -> None:
    """`migrate` answers "recovered" when the source died mid-copy: the request is recomputed."""
    assert drain_report(["recovered", "live"], 0, 0.1)["requeued"] == 1
