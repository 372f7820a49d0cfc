"""The request table: every live request, the two queues, and what clients wait on (no Ray).

It owns the `Request` records (by id), the waiting queue (new requests, priority order) and the
retracted queue (requests to resume), one progress event per live request, and the records of
ended requests already read once. Clients submit, abort, wait and stream through it; the
dispatcher adds tokens and ends requests through `finish`.

    table = RequestTable(counters)
    rid = table.submit([1, 2, 3], {"max_new_tokens": 8}, limits=Limits(vocab_size=256, ...))
    record = await table.wait(rid)     # forgets it; the record stays readable for a while

A fatal error (every worker lost, a crashed loop) is recorded with `fail`: every waiter wakes
and raises it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from raysched.request import Request, State, enqueue
from raysched.sampling import (RequestError, RequestIdInUseError, SamplingParams, UnknownRequestError, check_priority,
                               validate_prompt)
from raysched.scheduler.heap import trim_heap
from raysched.scheduler.planner import WorkerView
from raysched.stats import Counters

ENDED_RECORDS_KEPT = 4096  # ended requests already read once, still readable by a late reader
TRIM_EVERY_REQUESTS = 200  # hand freed heap memory back to the system after this many requests


@dataclass(frozen=True)
class Limits:
    """What a request must fit: the model's vocabulary and context, the largest worker pool."""

    vocab_size: int
    max_context: int
    largest_pool_tokens: int


class RequestTable:
    def __init__(self, counters: Counters, id_prefix: str = "req-") -> None:
        self.counters = counters
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.retracted: deque[Request] = deque()
        self.fatal: str | None = None
        self._progress: dict[str, asyncio.Event] = {}
        self._ended: dict[str, Request] = {}  # read once, out of the live table; oldest first
        self._next_id = 0
        self._forgotten = 0
        self._id_prefix = id_prefix
        self.sinks: dict[str, Any] = {}  # id -> its reader's `raysched.sink.TokenSink`: its
        #   workers send its tokens there directly (see `attach`)
        self.sink_at: dict[str, int] = {}  # id -> the worker its sink was last sent to
        self.seed_due: set[str] = set()  # sinks attached late: seed them with the tokens so far

    # ------------------------------------------------------------------ submit
    def submit(self, prompt_ids: list[int], sampling: dict | None, limits: Limits,
               request_id: str | None = None, priority: int = 0, shared_prefix: int = 0) -> Request:
        """Validate and queue a request. Bad input raises RequestError naming what is wrong."""
        self.raise_if_fatal()
        priority = check_priority(priority)
        params = SamplingParams.from_dict(sampling or {})
        prompt = validate_request(prompt_ids, params, limits)
        if isinstance(shared_prefix, bool) or not isinstance(shared_prefix, int) or not 0 <= shared_prefix <= len(prompt):
            raise RequestError(f"shared_prefix must be an integer in [0, {len(prompt)}] (the prompt's length), "
                               f"got {shared_prefix!r}")
        rid = request_id or f"{self._id_prefix}{self._next_id}"
        self._next_id += 1
        if rid in self.requests:
            raise RequestIdInUseError(f"request id {rid!r} is already in use")
        req = Request(rid, prompt, params, priority, shared_prefix=shared_prefix)
        self.requests[rid] = req
        self._progress[rid] = asyncio.Event()
        enqueue(self.waiting, req)
        self.counters.submitted += 1
        return req

    def continue_from(self, req: Request, generated: list[int]) -> None:
        """A resubmitted request that already has `generated` tokens: it resumes by recompute,
        from the retracted queue (ahead of new admissions)."""
        self.waiting.remove(req)
        req.output_ids, req.recompute, req.state = [int(t) for t in generated], True, State.RETRACTED
        if req.text_stream is not None:  # stop strings: the text so far, as the client saw it
            req.text_stream.add(req.output_ids)
        reason = ended_by(req)
        if reason is not None:  # the client had every token but not the end (the scheduler died)
            self.finish(req, State.FINISHED, reason)
        else:
            enqueue(self.retracted, req)

    # ------------------------------------------------------------------ end
    def finish(self, req: Request, state: State, reason: str) -> None:
        """Mark a request ended and wake its readers (the caller updates the worker's view). A
        request read through a sink is told there and forgotten here (its record stays readable)."""
        req.state, req.finish_reason, req.finish_s = state, reason, time.monotonic()
        self.counters.on_finish(req)
        self.notify(req.request_id)
        sink = self.sinks.get(req.request_id)
        if sink is not None:
            if req.request_id in self.seed_due:  # attached late, ended before a plan seeded it
                sink.push.remote({req.request_id: (0, list(req.output_ids), None)})
            count = len(req.output_ids) if state is State.FINISHED else None
            sink.end.remote(req.request_id, count, reason, req.error)
            self.forget(req)

    def abort(self, request_id: str) -> Request | None:
        """Abort a request at any stage; returns it, or None if it is unknown or had ended. One a
        worker still holds stays in that worker's view until its next call drops it."""
        req = self.requests.get(request_id)
        if req is None or req.state.is_done:
            return None
        if req.state is State.WAITING:
            self.waiting.remove(req)
        elif req.state is State.RETRACTED and req in self.retracted:
            self.retracted.remove(req)
        req.snapshot_ref = None  # releases the snapshot from the object store
        self.finish(req, State.ABORTED, "abort")
        return req

    def unrun(self, req: Request, view: WorkerView) -> None:
        """Undo `req`'s start on the worker of `view` (it did not fit, or the worker failed
        before it ran): back to the head of the queue it came from, waiting if it never ran."""
        if req in view.running:
            view.running.remove(req)
        if req.workers and req.workers[-1] == view.index:
            req.workers.pop()
        fresh = req.num_generated == 0 and not req.retractions
        req.state = State.WAITING if fresh else State.RETRACTED
        enqueue(self.waiting if fresh else self.retracted, req, front=True)

    # ------------------------------------------------------------------ readers
    def attach(self, req: Request, sink: Any, late: bool) -> None:
        """Read `req` through `sink` (`raysched.sink`): its workers send each step's tokens there
        from their next call on (`StepPlan.sinks`, `PrefillItem.sink`); `late`: it may have tokens
        already, which its next plan seeds the sink with."""
        self.sinks[req.request_id] = sink
        self.sink_at.pop(req.request_id, None)
        if late:
            self.seed_due.add(req.request_id)

    def sink_for(self, req: Request, worker: int, starts: bool = False) -> Any:
        """`req`'s sink if `worker` must be sent it (noting that it now is), else None: a request
        that `starts` there (admitted, resumed) always; a running one whose worker has not had it
        (attached late, or moved there by a live migration)."""
        rid = req.request_id
        sink = self.sinks.get(rid)
        if sink is None or (self.sink_at.get(rid) == worker and not starts):
            return None
        self.sink_at[rid] = worker
        if rid in self.seed_due:  # attached late: the tokens it had before go first
            self.seed_due.discard(rid)
            sink.push.remote({rid: (0, list(req.output_ids), None)})
        return sink

    def readers(self) -> dict[Any, Any]:
        """The live sinks, one per reader: its key (`reader_of`) -> a handle to it (each request
        carries a handle of its own to the same actor)."""
        return {reader_of(sink): sink for sink in self.sinks.values()}

    def read_by(self, key: Any) -> list[str]:
        """The ids whose sink is still the reader `key`'s."""
        return [rid for rid, sink in self.sinks.items() if reader_of(sink) == key]

    def status(self, request_id: str) -> str:
        """"live", "ended" (its record is readable), or "unknown" (never here, or long gone)."""
        if request_id in self.requests:
            return "ended" if self.requests[request_id].state.is_done else "live"
        return "ended" if request_id in self._ended else "unknown"

    async def wait(self, request_id: str, timeout: float | None = None) -> dict:
        """Wait for the request to end; returns its record and forgets it (see `forget`)."""
        req = self.get(request_id)
        progress = self._progress.get(request_id)  # a local: a concurrent reader may forget it
        while not req.state.is_done:
            self.raise_if_fatal()
            await asyncio.wait_for(progress.wait(), timeout)
            progress.clear()
        self.forget(req)
        return req.result()

    async def next_tokens(self, request_id: str, cursor: int) -> tuple[list[int], bool]:
        """Tokens generated after `cursor` (waits for at least one unless the request ended).
        The call that reports the end forgets the request, like `wait`."""
        req = self.get(request_id)
        req.streaming = True  # from its worker's next call on, each decode step's tokens come as they are made
        progress = self._progress.get(request_id)
        while len(req.output_ids) <= cursor and not req.state.is_done:
            self.raise_if_fatal()
            await progress.wait()
            progress.clear()
        if req.state.is_done:
            self.forget(req)
        return req.output_ids[cursor:], req.state.is_done

    def get(self, request_id: str) -> Request:
        req = self.requests.get(request_id) or self._ended.get(request_id)
        if req is None:
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        return req

    def forget(self, req: Request) -> None:
        """Move an ended request out of the live tables. Its record stays readable for a while
        (the last ENDED_RECORDS_KEPT), so a stream and `result()` of one request both succeed,
        in either order or at once, and a stream-only request does not linger in the tables."""
        rid = req.request_id
        if self.requests.get(rid) is req:
            del self.requests[rid]
            self._progress.pop(rid, None)
        req.snapshot_ref = None
        self.sinks.pop(rid, None)
        self.sink_at.pop(rid, None)
        self.seed_due.discard(rid)
        self._ended.pop(rid, None)
        self._ended[rid] = req
        self._forgotten += 1
        if self._forgotten % TRIM_EVERY_REQUESTS == 0:
            trim_heap()
        while len(self._ended) > ENDED_RECORDS_KEPT:
            del self._ended[next(iter(self._ended))]

    # ------------------------------------------------------------------ events
    def notify(self, request_id: str) -> None:
        """Wake the readers of one request (new tokens, or its end)."""
        event = self._progress.get(request_id)
        if event is not None:
            event.set()

    def fail(self, message: str) -> None:
        """Record a fatal error: every reader wakes and raises it."""
        self.fatal = message
        for event in self._progress.values():
            event.set()
        for rid, sink in self.sinks.items():
            sink.end.remote(rid, None, "error", message)

    def raise_if_fatal(self) -> None:
        if self.fatal:
            raise RuntimeError(self.fatal)

    def sizes(self, running: int) -> dict:
        return {"requests": len(self.requests), "waiting": len(self.waiting), "retracted": len(self.retracted),
                "snapshots_held": sum(r.snapshot_ref is not None for r in self.requests.values()),
                "running": running}


def validate_request(prompt_ids: list[int], params: SamplingParams, limits: Limits) -> tuple[int, ...]:
    """The prompt as a tuple of ints, or RequestError: bad tokens, bad sampling parameters, or a
    request that could never fit the context or any worker's pool. A pool must hold prompt +
    max_new_tokens tokens: what the planner asks of a worker before it admits or resumes a request
    (the last token's K/V is never stored, but its room is asked for). A message about the prompt
    alone starts with "prompt:" (HTTP's `param` is then `prompt`)."""
    prompt = validate_prompt(prompt_ids, limits.vocab_size)
    params.validate(limits.vocab_size)
    n, new, pool = len(prompt), params.max_new_tokens, limits.largest_pool_tokens
    if n >= limits.max_context:
        raise RequestError(f"prompt: {n} tokens leave no room for a generated token in the model context "
                           f"of {limits.max_context} tokens")
    if n >= pool:
        raise RequestError(f"prompt: {n} tokens leave no room for a generated token in the largest worker "
                           f"pool ({pool} KV tokens); it could never finish")
    if n + new > limits.max_context:
        raise RequestError(f"prompt ({n}) + max_new_tokens ({new}) = {n + new} exceeds the model context of "
                           f"{limits.max_context} tokens")
    if n + new > pool:
        raise RequestError(f"prompt ({n}) + max_new_tokens ({new}) = {n + new} tokens, more than the largest "
                           f"worker pool ({pool} KV tokens); at most {pool - n} new tokens fit after this prompt")
    return prompt


def validate_generated(generated: list[int], params: SamplingParams, vocab_size: int) -> None:
    """Tokens a resubmitting client says it received: token ids, fewer than the budget."""
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in generated):
        raise RequestError(f"generated tokens must be token ids in [0, {vocab_size})")
    if len(generated) > params.max_new_tokens:
        raise RequestError(f"{len(generated)} tokens were generated, more than max_new_tokens "
                           f"({params.max_new_tokens})")


def ended_by(req: Request) -> str | None:
    """Why a request whose output is already `req.output_ids` has ended ("stop", "length"), or
    None: its last token ends it, or its text holds a stop string."""
    if req.text_stream is not None and req.text_stream.stopped is not None:
        return "stop"
    if not req.output_ids:
        return None
    return req.sampling.finish_reason(req.output_ids[-1], len(req.output_ids))


def reader_of(sink: Any) -> Any:
    """One key per reader: its sink actor's id (handles to it deserialized apart are other objects)."""
    return getattr(sink, "_actor_id", None) or id(sink)
