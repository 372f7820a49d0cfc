"""The readers' sinks of the requests a worker runs: each step's tokens go straight to them.

A streamed request's reader has a `raysched.sink.TokenSink` (an actor in the reader's process);
its handle comes with the request in the step plan (`PrefillItem.sink`, `StepPlan.sinks`). After
each step the worker sends every sink the step's tokens of its requests in one fire-and-forget
`push` (with each request's position, so the sink takes each token once), without waiting for
the scheduler, from a sender thread of its own (so the Ray call costs the step nothing: 0.868 ->
0.948-0.975 of the bare engine's tokens/s with streamed reads, `bench overhead`); steps queued
while a push was going out go out as one push; a call's reply waits until its pushes went out.
A plan's items each bring their own copy of a sink's handle: pushes are grouped by the actor
the handles name (Ray's handles of one actor are equal). Both workers (`actors.worker`,
`actors.sim`) use this table.

    sinks = Sinks()
    sinks.note_plan(plan)                                 # at the start of a step call
    sinks.send({"req-0": [17]}, finished={})             # after each step
    sinks.flush()                                         # before its reply
    sinks.keep_only(live_ids)                             # at its end
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from typing import Any

from raysched.messages import PrefillItem, StepPlan


class Sinks:
    def __init__(self, threaded: bool = False) -> None:
        self.by_request: dict[str, list] = {}  # id -> [its reader's sink, tokens sent to it so far]
        self.threaded = threaded  # pushes from a sender thread (the model worker); False: at once
        #   (the simulated host, an async actor whose steps are sleeps)
        self._out: queue.Queue = queue.Queue()  # (sink, pieces), sent in order by this thread:
        self._sender: threading.Thread | None = None  # a push (a Ray call) then costs the step's
        #   thread nothing (torch releases the GIL while the step computes); `flush` before a
        #   call's reply, so no token reaches the scheduler's history before its push went out

    def _push(self, sink: Any, pieces: dict) -> None:
        if not self.threaded:
            sink.push.remote(pieces)
            return
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, name="sink-pushes", daemon=True)
            self._sender.start()
        self._out.put((sink, pieces))

    def _send_loop(self) -> None:
        """Send what is queued; steps queued while a push was going out (steps shorter than a
        push: a small model, a GPU) go out together, one push per sink (`merge_pushes`)."""
        while True:
            batch = [self._out.get()]
            while True:
                try:
                    batch.append(self._out.get_nowait())
                except queue.Empty:
                    break
            try:
                for sink, pieces in merge_pushes(batch):
                    sink.push.remote(pieces)
            finally:
                for _ in batch:
                    self._out.task_done()

    def flush(self) -> None:
        """Return once every push queued so far has gone out (a call's reply waits for it)."""
        if self._sender is not None:
            self._out.join()

    def note_plan(self, plan: StepPlan) -> None:
        """Learn the sinks a step plan names (its prefills', and `StepPlan.sinks`)."""
        self.note_items(plan.prefill)
        for rid, sink, start in plan.sinks:
            self.by_request[rid] = [sink, start]

    def note_items(self, items: Iterable[PrefillItem]) -> None:
        """Prefill items (new, recomputed, joined): each starts at the outputs it carries."""
        for item in items:
            if item.sink is not None:
                self.by_request[item.request_id] = [item.sink, len(item.token_ids) - item.prompt_len]

    def wants(self, new_tokens: dict[str, list[int]]) -> bool:
        """Do any of these tokens go to a sink?"""
        return bool(self.by_request) and any(rid in self.by_request for rid in new_tokens)

    def send(self, new_tokens: dict[str, list[int]], finished: dict[str, str]) -> int:
        """Push one step's tokens: one `push` per sink; returns how many pushes went out."""
        if not self.by_request:
            return 0
        batches: dict[Any, dict] = {}  # by sink: Ray's handles are equal when they name the same
        #   actor (each plan item brings its own copy of the handle)
        for rid, tokens in new_tokens.items():
            entry = self.by_request.get(rid)
            if entry is None or not tokens:
                continue
            sink, start = entry
            batches.setdefault(sink, {})[rid] = (start, list(tokens), finished.get(rid))
            entry[1] = start + len(tokens)
            if rid in finished:
                del self.by_request[rid]
        for sink, pieces in batches.items():
            self._push(sink, pieces)
        return len(batches)

    def keep_only(self, live: Iterable[str]) -> None:
        """Forget the sinks of requests no longer here (finished, dropped, retracted, not admitted)."""
        live = set(live)
        for rid in [rid for rid in self.by_request if rid not in live]:
            del self.by_request[rid]


def merge_pushes(batch: list[tuple[Any, dict]]) -> list[tuple[Any, dict]]:
    """Consecutive pushes to one sink as one: a request's pieces that follow each other join
    (positions contiguous, the earlier not its end); any other piece starts another push."""
    if len(batch) == 1:  # (the usual case: the sender kept up)
        return batch
    merged: dict[Any, list[dict]] = {}
    for sink, pieces in batch:
        parts = merged.setdefault(sink, [{}])
        last = parts[-1]
        if not all(_follows(last.get(rid), piece) for rid, piece in pieces.items()):
            last = {}
            parts.append(last)
        for rid, (start, tokens, reason) in pieces.items():
            prev = last.get(rid)
            last[rid] = (start, list(tokens), reason) if prev is None else (prev[0], prev[1] + list(tokens), reason)
    return [(sink, part) for sink, parts in merged.items() for part in parts if part]


def _follows(prev: tuple | None, piece: tuple) -> bool:
    return prev is None or (prev[2] is None and prev[0] + len(prev[1]) == piece[0])
