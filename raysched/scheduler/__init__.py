"""The scheduler: one Ray actor (`Scheduler`, a thin facade) over parts with one job each.

    actor.py       the actor facade: builds the parts, hands each call to its owner
    table.py       the request table: submit, validate, wait, stream, abort, forget
    dispatch.py    the dispatch-and-apply loop: one task per worker, decide -> call -> apply
    retraction.py  the retraction ledger: retract mode, snapshot budget, bytes in flight
    recovery.py    starting workers, worker failure, replacement, a restarted scheduler
    prefix_cache.py prefix reuse around each call: lookups, placement, parked points taken over
    state_cache.py the prefix index (points and shared K/V blocks in a radix tree of token blocks)
    fleet.py       the workers as the scheduler sees them (handles, facts, pool mirrors)
    planner.py     pure decisions: victims, resumes, admissions, decode steps
    roles.py       worker roles (prefill / decode / both): the one place the idea lives
    policy.py      pure policy: victim order, retract-mode cost model
    autoscale.py   pure policy: when to grow or shrink the worker set (`autoscale:` config)
    faults.py      fault injection, the one seam
    heap.py        keeps a long-lived process's heap from hoarding freed memory

Every part but `actor.py` runs without Ray (worker handles are opaque), so each has unit tests
that build it directly (tests/test_scheduler_parts.py).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"Scheduler": "raysched.scheduler.actor", "WorkerSlot": "raysched.scheduler.fleet"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """`Scheduler` and `WorkerSlot`, imported on first use (the pure parts need no Ray)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raysched.scheduler' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
