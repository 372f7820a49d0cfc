"""A reader's token sink: where workers send streamed requests' tokens, past the scheduler.

One small async actor per reader process (a `Client`, a Serve replica), made by the reader and
owned by it. Its handle travels with each streamed request to the worker that runs it (in the
`PrefillItem`, or `StepPlan.sinks`); after each decode step the worker sends the step's tokens to
every sink concerned, one fire-and-forget `push` per sink per step. The sink keeps what each
request received, and that is what a reader reads and what a request resubmitted after the
scheduler's death continues from (`RequestHandle.received`). The scheduler sees none of it:
it gets each call's tokens once, in the call's reply. A sink that dies (its reader's process
exited) has its requests aborted by the scheduler within a second (`Scheduler._watch_readers`).

Tokens carry their position in the request's output, so the sink takes each token exactly once:
a worker that recomputes a request after a failure sends tokens the sink holds already (they are
dropped, and counted as mismatches if they differ), and pieces that arrive out of order (the
scheduler's seed and a worker's first step, after a late `attach_sink`) wait for the gap.

Stop strings are matched here, on the text, as tokens arrive (`open`): the request ends on the
token that completes one, and the sink tells the scheduler (`Scheduler.stop`), which drops it
from its worker as an abort does.

    sink = new_sink()                                   # in the reader's process
    sink.push.remote({"req-0": (0, [17, 42], None)})     # a worker, after a step
    tokens, done, error = ray.get(sink.next.remote("req-0", 0, 1.0))
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

FORGOTTEN_KEPT = 4096
Piece = tuple[int, list[int], "str | None"]  # (position of the first token, tokens, finish reason or None)


@dataclass
class Received:
    """One request's tokens as its reader receives them (no Ray, no asyncio: testable alone)."""

    tokens: list[int] = field(default_factory=list)
    pending: dict[int, tuple[list[int], str | None]] = field(default_factory=dict)  # start -> piece
    reason: str | None = None  # why it ended ("length", "stop", "abort", ...); None while live
    end_count: int | None = None  # it is done once it holds this many tokens (None: at once)
    error: str | None = None
    mismatches: int = 0  # re-sent tokens that differed from those received (must stay 0)
    text: Any = None  # raysched.tokenizer.TextStream: stop strings matched on the text
    stopped: bool = False  # a stop string ended it here (the scheduler is told once)
    scheduler: Any = None  # whom to tell of a stop (`TokenSink.open`)

    @property
    def done(self) -> bool:
        return self.reason is not None and (self.end_count is None or len(self.tokens) >= self.end_count)

    def add(self, start: int, tokens: list[int], reason: str | None) -> bool:
        """Take a piece; True when it (or a waiting piece it unblocked) added tokens or ended it."""
        if self.reason is not None and self.end_count is None:
            return False  # aborted or failed: nothing more
        if start > len(self.tokens):
            self.pending[start] = (list(tokens), reason)
            return False
        changed = self._take(start, tokens, reason)
        while self.pending and min(self.pending) <= len(self.tokens):
            first = min(self.pending)
            changed = self._take(first, *self.pending.pop(first)) or changed
        return changed

    def _take(self, start: int, tokens: list[int], reason: str | None) -> bool:
        """A piece that starts at or before the end of what was received."""
        have = self.tokens[start:start + len(tokens)]
        self.mismatches += sum(a != b for a, b in zip(have, tokens))
        new = tokens[len(have):]
        if self.reason is not None:  # ended by count: take only up to it
            new = new[:max(0, (self.end_count or 0) - len(self.tokens))]
        elif self.text is not None and new:
            self.text.add(new)
            if self.text.stopped is not None:  # a stop string: end on the token that completes it
                new = new[:self.text.num_tokens - len(self.tokens)]
                self.stopped, self.reason = True, "stop"
                self.end_count = len(self.tokens) + len(new)
        self.tokens.extend(new)
        if reason is not None and self.reason is None and len(new) == len(tokens) - len(have):
            self.reason, self.end_count = reason, start + len(tokens)
        return bool(new) or self.reason is not None

    def end(self, count: int | None, reason: str, error: str | None = None) -> None:
        """The scheduler ended it: done once `count` tokens are here (None: now, as received)."""
        if self.reason is not None:
            return
        self.reason, self.error = reason, error
        self.end_count = count
        if count is not None and len(self.tokens) > count:
            del self.tokens[count:]

    def watch(self, text: Any) -> None:
        """Match stop strings on the text of the tokens received so far and from now on."""
        self.text = text
        held, self.tokens = self.tokens, []
        if held:
            self._take(0, held, None)


class TokenSink:
    """The reader's end of its requests' token streams (see the module doc). An async actor:
    `next` waits without holding up `push`."""

    def __init__(self) -> None:
        self.received: dict[str, Received] = {}
        self.events: dict[str, asyncio.Event] = {}
        self.forgotten: dict[str, None] = {}  # read to their end (the last FORGOTTEN_KEPT): late
        #   pieces for them are dropped
        self.pushes = 0

    def _get(self, rid: str) -> Received:
        got = self.received.get(rid)
        if got is None:
            got = self.received[rid] = Received()
            self.events[rid] = asyncio.Event()
        return got

    def push(self, pieces: dict[str, Piece]) -> None:
        """One worker step's tokens for this reader's requests: id -> (start, tokens, reason)."""
        self.pushes += 1
        for rid, (start, tokens, reason) in pieces.items():
            if rid in self.forgotten:
                continue
            got = self._get(rid)
            stopped = got.stopped
            if got.add(start, tokens, reason):
                self.events[rid].set()
            if got.stopped and not stopped:
                self._tell_stop(rid, got)

    def open(self, rid: str, model: Any = None, stop: tuple[str, ...] = (), min_tokens: int = 0,
             scheduler: Any = None) -> None:
        """The scheduler will send `rid` here (sent before its first plan). An id read to its end
        before is taken afresh (a reused id); one with tokens and no end (resubmitted after a
        scheduler restart) keeps them. With `stop` strings they are matched on `rid`'s text (the
        model's tokenizer); a match ends the request here and is sent to `scheduler`
        (`Scheduler.stop`)."""
        self.forgotten.pop(rid, None)
        if rid in self.received and self.received[rid].done:
            self.forget(rid)
            self.forgotten.pop(rid, None)
        got = self._get(rid)
        if not stop:
            return
        from raysched.tokenizer import require_tokenizer

        got.scheduler = scheduler
        got.watch(require_tokenizer(model).text_stream(list(stop), min_tokens))
        if got.stopped:
            self._tell_stop(rid, got)
            self.events[rid].set()

    def _tell_stop(self, rid: str, got: Received) -> None:
        if got.scheduler is not None:
            got.scheduler.stop.remote(rid, list(got.tokens))

    def end(self, rid: str, count: int | None, reason: str, error: str | None = None) -> None:
        """The scheduler ended `rid` (an abort, a failure, or its last reply: `count` tokens)."""
        if rid in self.forgotten:
            return
        self._get(rid).end(count, reason, error)
        self.events[rid].set()

    async def next(self, rid: str, cursor: int, wait_s: float) -> tuple[list[int], bool, str | None]:
        """(tokens after `cursor`, done, error), waiting up to `wait_s` for one (nothing new and
        not done after it: ([], False, None), so the reader can look for the scheduler)."""
        got, event = self._get(rid), self.events.get(rid)
        if len(got.tokens) <= cursor and not got.done:
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        return got.tokens[cursor:], got.done, got.error

    def history(self, rid: str) -> list[int]:
        return list(self._get(rid).tokens)

    def forget(self, rid: str) -> None:
        """The reader is done with `rid`."""
        self.received.pop(rid, None)
        self.events.pop(rid, None)
        self.forgotten[rid] = None
        while len(self.forgotten) > FORGOTTEN_KEPT:
            del self.forgotten[next(iter(self.forgotten))]

    def stats(self) -> dict:
        return {"requests": len(self.received), "pushes": self.pushes,
                "mismatches": sum(r.mismatches for r in self.received.values())}


def new_sink(wait: bool = True) -> Any:
    """A `TokenSink` actor owned by this process (it ends with it): no CPU reserved, many waits.
    `wait`: returned once it has started (~1 s for a new process): pushes sent to an actor still
    starting queue up, so a streamed request would get its first tokens all at once."""
    import ray

    sink = ray.remote(TokenSink).options(num_cpus=0, max_concurrency=10_000, enable_task_events=False).remote()
    if wait:
        ray.get(sink.__ray_ready__.remote())
    return sink
