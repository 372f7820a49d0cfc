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
import atexit
import threading
from dataclasses import dataclass, field
from typing import Any

from raysched.background import detached_task

FORGOTTEN_KEPT = 4096
POLL_WAIT_S = 1.0  # a `SinkReader`'s call waits this long for news before it asks again
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
        self.forgotten: dict[str, None] = {}  # read to their end (the last FORGOTTEN_KEPT): late
        #   pieces for them are dropped
        self.pushes = 0
        self.reads = 0  # `next` and `next_many` calls
        self.version = 0  # counts pushes, ends, opens and pokes: waiting reads wake when it moves
        self.changed = asyncio.Event()

    def _moved(self) -> None:
        self.version += 1
        self.changed.set()

    def _get(self, rid: str) -> Received:
        got = self.received.get(rid)
        if got is None:
            got = self.received[rid] = Received()
        return got

    def push(self, pieces: dict[str, Piece]) -> None:
        """One worker step's tokens for this reader's requests: id -> (start, tokens, reason)."""
        self.pushes += 1
        for rid, (start, tokens, reason) in pieces.items():
            if rid in self.forgotten:
                continue
            got = self._get(rid)
            stopped = got.stopped
            got.add(start, tokens, reason)
            if got.stopped and not stopped:
                self._tell_stop(rid, got)
        self._moved()

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
            self._moved()

    def _tell_stop(self, rid: str, got: Received) -> None:
        if got.scheduler is not None:
            got.scheduler.stop.remote(rid, list(got.tokens))

    def end(self, rid: str, count: int | None, reason: str, error: str | None = None) -> None:
        """The scheduler ended `rid` (an abort, a failure, or its last reply: `count` tokens)."""
        if rid in self.forgotten:
            return
        self._get(rid).end(count, reason, error)
        self._moved()

    async def next(self, rid: str, cursor: int, wait_s: float) -> tuple[list[int], bool, str | None]:
        """(tokens after `cursor`, done, error), waiting up to `wait_s` for one (nothing new and
        not done after it: ([], False, None), so the reader can look for the scheduler)."""
        self.reads += 1
        got = self._get(rid)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while len(got.tokens) <= cursor and not got.done and deadline > loop.time():
            await self._moves_within(deadline - loop.time())
        return got.tokens[cursor:], got.done, got.error

    async def next_many(self, cursors: dict[str, int], seen: int, wait_s: float) -> tuple[dict, int]:
        """Many streams in one call (`SinkReader`): ({id: (tokens after its cursor, done, error)}
        for those with news, the sink's version). Waits up to `wait_s` while none has news and
        nothing moved since version `seen` (a push for another stream, a `poke`, returns it)."""
        self.reads += 1
        news = self._news(cursors)
        if not news and self.version == seen:
            await self._moves_within(wait_s)
            news = self._news(cursors)
        return news, self.version

    async def _moves_within(self, wait_s: float) -> None:
        """Return when the version next moves, or after `wait_s`."""
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), wait_s)
        except asyncio.TimeoutError:
            pass

    def _news(self, cursors: dict[str, int]) -> dict[str, tuple[list[int], bool, str | None]]:
        news = {}
        for rid, cursor in cursors.items():
            got = self.received.get(rid)
            if got is not None and (len(got.tokens) > cursor or got.done):
                news[rid] = (got.tokens[cursor:], got.done, got.error)
        return news

    def poke(self) -> None:
        """A reader has a new stream to read: its `next_many` in flight returns, to ask again."""
        self._moved()

    def history(self, rid: str) -> list[int]:
        return list(self._get(rid).tokens)

    def forget(self, rid: str) -> None:
        """The reader is done with `rid`."""
        self.received.pop(rid, None)
        self.forgotten[rid] = None
        while len(self.forgotten) > FORGOTTEN_KEPT:
            del self.forgotten[next(iter(self.forgotten))]

    def stats(self) -> dict:
        return {"requests": len(self.received), "pushes": self.pushes, "reads": self.reads,
                "mismatches": sum(r.mismatches for r in self.received.values())}


class _Mirror:
    """What a reader process holds of the streams it reads from its sink: each stream's tokens,
    end and error as the sink had them at its last answer, and that answer's version. The
    bookkeeping of `AsyncSinkReader` (no Ray, no waiting)."""

    def __init__(self) -> None:
        self.streams: dict[str, list] = {}  # id -> [tokens, done, error]
        self.version = -1

    def open(self, rid: str) -> bool:
        """Read `rid` from now on; True when it is new (a call in flight does not ask for it)."""
        if rid in self.streams:
            return False
        self.streams[rid] = [[], False, None]
        return True

    def ask(self) -> tuple[dict[str, int], int]:
        """The next `TokenSink.next_many`'s cursors and seen version: every live stream."""
        return {rid: len(got[0]) for rid, got in self.streams.items() if not got[1]}, self.version

    def take(self, cursors: dict[str, int], news: dict, version: int) -> None:
        self.version = version
        for rid, (tokens, done, error) in news.items():
            got = self.streams.get(rid)
            if got is not None and len(got[0]) == cursors[rid]:  # not forgotten (and reopened) meanwhile
                got[0].extend(tokens)
                got[1], got[2] = done, error

    def has_news(self, rid: str, cursor: int) -> bool:
        got = self.streams.get(rid)
        return got is None or len(got[0]) > cursor or got[1]

    def answer(self, rid: str, cursor: int) -> tuple[list[int], bool, str | None]:
        """`TokenSink.next`'s answer from what is held (a forgotten stream: nothing)."""
        tokens, done, error = self.streams.get(rid, ([], False, None))
        return tokens[cursor:], done, error


class AsyncSinkReader:
    """Every stream a process reads from its sink, in one long-poll (`TokenSink.next_many`) made
    by one task, instead of a call per stream per step: with 16 streams a step costs the sink and
    the reader one round trip, not 16. Used as it is by an asyncio reader (the HTTP server's
    replica), through `SinkReader` by a threaded one (a `Client`). A failed call (the sink died)
    is raised to every reader."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.mirror = _Mirror()
        self._waiting = 0
        self._wanted = asyncio.Event()  # some handler waits
        self._answered = asyncio.Event()  # set, then replaced, at each answer
        self._error: BaseException | None = None
        self._task: asyncio.Task | None = None

    async def next(self, rid: str, cursor: int, wait_s: float) -> tuple[list[int], bool, str | None]:
        """(tokens after `cursor`, done, error), waiting up to `wait_s` for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        if self.mirror.open(rid):
            self.sink.poke.remote()
        if self._task is None or (self._task.done() and self._error is None):  # (ended by a bug: again)
            self._task = detached_task(self._run())  # not the first handler's: its polls would be
            #   that request's calls, cancelled when its client leaves (every stream's poll)
        self._waiting += 1
        self._wanted.set()
        try:
            while not self.mirror.has_news(rid, cursor) and self._error is None:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._answered.wait(), left)
                except asyncio.TimeoutError:
                    break
        finally:
            self._waiting -= 1
        if self._error is not None:
            raise self._error
        return self.mirror.answer(rid, cursor)

    def forget(self, rid: str) -> None:
        """Done with `rid` (the sink forgets it too)."""
        self.drop(rid)
        self.sink.forget.remote(rid)

    def drop(self, rid: str) -> None:
        """Forget what is held of `rid` here (an id submitted again is read afresh)."""
        self.mirror.streams.pop(rid, None)

    async def close(self) -> None:
        """End the poll task; readers still waiting raise."""
        self._error = self._error or RuntimeError("the reader's client was shut down")
        self._answered.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it is over either way
                pass

    async def _run(self) -> None:
        while True:
            while not self._waiting:
                self._wanted.clear()
                await self._wanted.wait()
            cursors, seen = self.mirror.ask()
            try:
                news, version = await self.sink.next_many.remote(cursors, seen, POLL_WAIT_S)
            except Exception as err:  # the sink is gone: every handler hears it
                self._error = err
                self._answered.set()
                return
            self.mirror.take(cursors, news, version)
            answered, self._answered = self._answered, asyncio.Event()
            answered.set()


class SinkReader:
    """`AsyncSinkReader` for a threaded reader (a `Client`, whose streams are read from any
    thread): its poll task runs on an event loop of its own, in one daemon thread. `next` has
    `TokenSink.next`'s answer; a stream is read from its first `next` until `forget`."""

    def __init__(self, sink: Any) -> None:
        self.reader = AsyncSinkReader(sink)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="raysched-sink-reader", daemon=True).start()
        atexit.register(_close, self._loop, self.reader)  # (a client dropped without shutdown: its
        #   loop runs on, and its pending task would be reported at exit)

    def next(self, rid: str, cursor: int, wait_s: float) -> tuple[list[int], bool, str | None]:
        """(tokens after `cursor`, done, error), waiting up to `wait_s` for one."""
        return asyncio.run_coroutine_threadsafe(self.reader.next(rid, cursor, wait_s), self._loop).result()

    def forget(self, rid: str) -> None:
        """Done with `rid` (the sink forgets it too)."""
        self._loop.call_soon_threadsafe(self.reader.forget, rid)

    def drop(self, rid: str) -> None:
        """Forget what is held of `rid` here (an id submitted again is read afresh)."""
        self._loop.call_soon_threadsafe(self.reader.drop, rid)

    def close(self) -> None:
        """Readers still waiting raise; then the loop ends."""
        _close(self._loop, self.reader)


def _close(loop: asyncio.AbstractEventLoop, reader: AsyncSinkReader, timeout_s: float = 2.0) -> None:
    if not loop.is_running():
        return
    try:
        asyncio.run_coroutine_threadsafe(reader.close(), loop).result(timeout_s)
    except Exception:  # noqa: BLE001 - closing regardless
        pass
    loop.call_soon_threadsafe(loop.stop)


def new_sink(wait: bool = True) -> Any:
    """A `TokenSink` actor owned by this process (it ends with it): no CPU reserved, many waits.
    `wait`: returned once it has started (~1 s for a new process): pushes sent to an actor still
    starting queue up, so a streamed request would get its first tokens all at once."""
    import ray

    sink = ray.remote(TokenSink).options(num_cpus=0, max_concurrency=10_000, enable_task_events=False).remote()
    if wait:
        ray.get(sink.__ray_ready__.remote())
    return sink
