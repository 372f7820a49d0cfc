"""The turn-cache glue: between the dispatcher and the `StateCache` (see `state_cache`).

Before a call: which admitted requests restore a parked state (their prompt starts with one).
After it: count hits and misses, drop parked states a worker could not use, and take over the
states the call parked (`Worker.take_parked` returns them, so the scheduler owns them). With the
cache off every answer is empty.

No Ray import: worker handles are opaque.
"""

from __future__ import annotations

import logging

from raysched.messages import StepResult
from raysched.request import Request, State
from raysched.scheduler.fleet import WorkerSlot
from raysched.scheduler.planner import Decision
from raysched.scheduler.state_cache import Parked, StateCache
from raysched.scheduler.table import RequestTable
from raysched.stats import Counters

log = logging.getLogger("raysched.scheduler")


class TurnCacheGlue:
    def __init__(self, cache: StateCache | None, table: RequestTable, counters: Counters) -> None:
        self.cache = cache
        self.table = table
        self.counters = counters
        self._prefix_of: dict[str, Parked] = {}  # admitted request id -> parked state it restores

    def park_min_tokens(self) -> int:
        """What a step plan asks the worker to park (0: nothing)."""
        return self.cache.min_tokens if self.cache is not None else 0

    def prefix_hits(self, admitted: list[Request]) -> list[tuple[Request, Parked]]:
        """(request, parked state) for each new request whose prompt starts with a parked state."""
        if self.cache is None:
            return []
        hits = []
        for r in admitted:
            entry = self.cache.lookup(r.prompt_ids) if not r.num_generated else None
            if entry is not None:
                hits.append((r, entry))
                self._prefix_of[r.request_id] = entry
        return hits

    def forget_lookups(self, admitted: list[Request]) -> None:
        """The call failed: these are looked up again when admitted again."""
        for r in admitted:
            self._prefix_of.pop(r.request_id, None)

    def on_result(self, w: WorkerSlot, decision: Decision, result: StepResult) -> None:
        """Count hits and misses of the admitted requests, forget parked states that could not
        be used, and take over the states this call parked."""
        cache = self.cache
        if cache is None:
            return
        for r in decision.admit:
            entry = self._prefix_of.pop(r.request_id, None)
            if r.request_id in result.not_admitted:
                continue  # looked up again when it is admitted
            r.cached_tokens = result.cached.get(r.request_id, 0)
            r.cache_kind = entry.kind if entry is not None and r.cached_tokens else None
            self.counters.on_cache_lookup(r.cached_tokens, r.cache_kind)
            if r.request_id in result.prefix_failed and entry is not None:
                log.warning("parked state for %s not used on worker %d (%s); prefilled in full",
                            r.request_id, w.index, result.prefix_failed[r.request_id])
                cache.drop(entry.tokens)
                self.counters.state_cache_fallbacks += 1
        if result.parked:
            self._take_parked(w, result.parked)

    def _take_parked(self, w: WorkerSlot, parked: list[tuple[str, str, int, int]]) -> None:
        """`Worker.take_parked` hands the copies over as return values: the scheduler owns them,
        they stay in the worker node's store, and outlive the worker process."""
        keys = [(rid, kind) for rid, kind, _, _ in parked]
        refs = w.handle.take_parked.options(num_returns=len(keys)).remote(keys)
        refs = [refs] if len(keys) == 1 else refs
        for (rid, kind, num_tokens, nbytes), ref in zip(parked, refs):
            req = self.table.requests.get(rid)
            if req is not None and req.state is State.RUNNING and len(req.token_ids) > num_tokens:
                self.cache.park(req.token_ids[:num_tokens], ref, nbytes, kind, w.info.node_id)

    def stats(self) -> dict:
        cache = self.cache
        return {"state_cache_bytes": cache.bytes if cache else 0,
                "state_cache_entries": len(cache) if cache else 0,
                "state_cache_evictions": cache.evictions if cache else 0,
                "state_cache_budget_bytes": cache.budget_bytes if cache else 0,
                "state_cache_inline_bytes": cache.inline_bytes if cache else 0}  # in the scheduler's memory

    def clear(self) -> None:
        if self.cache is not None:
            self.cache.clear()
