"""Tokens go from the worker to the reader directly (`raysched.sink`, `actors.sinks`), not through
the scheduler: a stream goes on while the scheduler's event loop is blocked (the negative
control: a stream read through the scheduler stops), its tokens are those of an uninterrupted
run, a stop string matched at the reader ends the request on the token that completes it and
frees its slots, and a worker killed mid-stream still gives every token exactly once.

The scheduler's own death with streams read through sinks is `tests/test_faults.py`
(`test_streams_keep_their_tokens_across_a_scheduler_restart`); an HTTP reader that disconnects
aborts its request in `tests/test_serve.py`; a Python reader whose sink dies, here.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import ray

from actors.sim import SimWorker
from actors.sinks import Sinks
from raysched.config import load_serve_config
from raysched.messages import PrefillItem, StepPlan
from raysched.sink import Received
from raysched.tokenizer import load_tokenizer
from tests.conftest import wait_until

SIM = {"decode_ms": 20.0, "vocab_size": 512, "max_context": 4096}


def sim_config(**extra: Any) -> Any:
    raw = {"data_plane": "sim", "pool": {"kv_tokens": 4096, "state_slots": 4}, "state_cache": {"enabled": False},
           "object_store_memory": 80 << 20, "sim": {**SIM, "workers_per_process": 2}, **extra}
    return load_serve_config(raw)


def reference(rid: str, prompt: list[int], max_new: int) -> list[int]:
    """One in-process simulated worker, never interrupted, no Ray."""
    w = SimWorker(load_serve_config({"data_plane": "sim", "pool": {"kv_tokens": 4096, "state_slots": 4},
                                     "sim": {**SIM, "decode_ms": 0.0}}), 0)
    out = w.step(StepPlan(prefill=(PrefillItem(rid, tuple(prompt), len(prompt), {"max_new_tokens": max_new}),),
                          decode_steps=max_new))
    return out.new_tokens[rid]


class Reader:
    """Reads one handle's stream in a thread."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.tokens, self.error = handle, [], None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for t in self.handle.stream():
                self.tokens.append(t)
        except Exception as err:  # noqa: BLE001 - shown by the test
            self.error = repr(err)


# ---------------------------------------------------------------------------- no Ray

def test_a_sink_takes_each_token_once_whatever_order_pieces_come_in() -> None:
    """Pieces carry positions: a re-sent piece (a recomputed request) adds nothing, a piece
    after a gap waits for it. Negative control: a re-sent piece that differs is counted."""
    want = list(range(100, 112))
    got = Received()
    got.add(4, want[4:8], None)  # ahead of the gap: waits
    assert got.tokens == []
    got.add(0, want[0:4], None)
    got.add(2, want[2:10], None)  # overlaps what it has
    got.add(10, want[10:12], "length")
    assert got.tokens == want and got.done and got.mismatches == 0
    bad = Received()
    bad.add(0, want[:6], None)
    bad.add(3, [1, 2, 3], None)
    assert bad.tokens == want[:6] and bad.mismatches == 3


def test_a_sink_ended_by_count_waits_for_the_rest_and_ignores_more() -> None:
    got = Received()
    got.add(0, [1, 2], None)
    got.end(4, "length")
    assert not got.done
    got.add(2, [3, 4, 5, 6], None)  # a worker that decoded on after the end: cut there
    assert got.done and got.tokens == [1, 2, 3, 4]
    aborted = Received()
    aborted.add(0, [1, 2], None)
    aborted.end(None, "abort")
    aborted.add(2, [3], None)
    assert aborted.done and aborted.tokens == [1, 2]


class FakeSink:
    """A sink handle; its copies (as each plan item brings one) are equal to it, as Ray's handles
    of one actor are, and share its pushes."""

    def __init__(self, pushes: list | None = None) -> None:
        self.pushes: list[dict] = [] if pushes is None else pushes
        self.push = self

    def copy(self) -> "FakeSink":
        return FakeSink(self.pushes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeSink) and other.pushes is self.pushes

    def __hash__(self) -> int:
        return id(self.pushes)

    def remote(self, pieces: dict) -> None:
        self.pushes.append(pieces)


@pytest.mark.parametrize("threaded", [False, True], ids=["at-once", "sender-thread"])
def test_a_worker_sends_one_push_per_sink_per_step_with_positions(threaded: bool) -> None:
    """One push per sink per step, with positions, in order, also when the plan's items bring
    copies of one sink's handle (Ray deserialises one per item); from the model worker's sender
    thread too, where `flush` (before a call's reply) returns once every push has gone out."""
    a, b = FakeSink(), FakeSink()
    sinks = Sinks(threaded=threaded)
    sinks.note_plan(StepPlan(prefill=(PrefillItem("x", (1, 2, 7, 8), 2, {}, a), PrefillItem("y", (1,), 1, {}, a.copy())),
                             sinks=(("z", b, 5),)))
    assert sinks.send({"x": [9], "y": [3], "z": [4], "w": [0]}, {}) == 2
    sinks.flush()  # (else the sender thread may merge the two steps: the test below)
    assert sinks.send({"x": [10], "z": [5]}, {"z": "length"}) == 2
    sinks.flush()
    assert a.pushes == [{"x": (2, [9], None), "y": (0, [3], None)}, {"x": (3, [10], None)}]
    assert b.pushes == [{"z": (5, [4], None)}, {"z": (6, [5], "length")}]
    sinks.keep_only(["y"])
    assert list(sinks.by_request) == ["y"]


# ---------------------------------------------------------------------------- on Ray, simulated workers

def test_a_stream_reaches_its_reader_while_the_scheduler_is_blocked(tmp_path) -> None:
    """Two streamed requests on simulated workers (20 ms steps, long calls of up to `fold_calls`
    x 16 steps: a call needs the scheduler only when it ends); once both are in their long calls the
    scheduler's event loop is blocked (`Scheduler.debug_block`). The one read through the
    client's sink gets 20 more tokens while it stays blocked; the negative control, read through the
    scheduler (`Client.direct_tokens = False`, the old path), gets at most what was in flight.
    Both then end with the tokens of an uninterrupted run."""
    import raysched

    client = raysched.launch(sim_config(workers=2, scheduler={"decode_steps_per_call": 16},
                                        pool={"kv_tokens": 4096, "state_slots": 1},  # one request each,
                                        sim={**SIM, "workers_per_process": 1}))  # each in its own process
    flag = str(tmp_path / "block")
    try:
        direct = client.submit([3, 1, 4], {"max_new_tokens": 300}, stream=True)
        client.direct_tokens = False
        old = client.submit([3, 1, 5], {"max_new_tokens": 300}, stream=True)
        readers = [Reader(direct), Reader(old)]
        wait_until(lambda: all(len(r.tokens) >= 40 for r in readers), 60, "both streams in long calls")
        open(flag, "w").close()
        blocked = client.scheduler.debug_block.remote(flag)
        wait_until(lambda: os.path.exists(flag + ".on"), 60, "the scheduler blocked")
        before = [len(r.tokens) for r in readers]
        wait_until(lambda: len(readers[0].tokens) >= before[0] + 20, 60, "20 direct tokens")
        during = [len(r.tokens) - b for r, b in zip(readers, before)]
        still_blocked = not ray.wait([blocked], timeout=0)[0]
        os.remove(flag)
        blocked_s = ray.get(blocked, timeout=60)
        for r in readers:
            r.thread.join(120)
        idle = client.check_idle()
    finally:
        if os.path.exists(flag):
            os.remove(flag)
        client.shutdown()
    print(f"\nwhile the scheduler was blocked ({blocked_s:.2f} s): direct +{during[0]} tokens, "
          f"through the scheduler +{during[1]}")
    assert still_blocked and during[0] >= 20
    assert during[1] <= 4  # negative control: at most one reply that was in flight
    assert [r.error for r in readers] == [None, None]
    assert readers[0].tokens == reference(direct.request_id, [3, 1, 4], 300)
    assert readers[1].tokens == reference(old.request_id, [3, 1, 5], 300)
    assert idle["workers_idle"] and idle["tables"]["requests"] == 0


def _stop_string(tokens: list[int]) -> tuple[str, int]:
    """A stop string from the middle of the text of `tokens`, and how many tokens it takes for
    the text to contain it (found here by decoding prefixes, not by the code under test)."""
    tok = load_tokenizer("tiny")
    text = tok.decode(tokens)
    for i in range(len(text) // 3, len(text) - 2):
        stop = text[i:i + 2]
        if "\ufffd" not in stop and stop.strip() and text.find(stop) == i:
            n = next(k for k in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:k]))
            return stop, n
    raise AssertionError("no usable stop string in the reference text")


def test_a_stop_string_at_the_reader_ends_the_request_on_its_token_and_frees_its_slots() -> None:
    """The sink matches the stop string on the text (not the scheduler): the stream ends on
    the token that completes it (found by decoding the reference's prefixes), the record agrees
    (finish_reason "stop"), and the worker's pools end empty. Negative control: the same
    request (same id, so the same tokens) without the stop runs its full length."""
    import raysched

    prompt, max_new = [7, 2, 9], 120
    want = reference("s", prompt, max_new)
    stop, n = _stop_string(want)
    client = raysched.launch(sim_config(workers=1, model="tiny"))
    try:
        full_tokens = list(client.submit(prompt, {"max_new_tokens": max_new}, request_id="s", stream=True).stream())
        cut = client.submit(prompt, {"max_new_tokens": max_new, "stop": [stop]}, request_id="s", stream=True)
        cut_tokens = list(cut.stream())
        record = cut.result(timeout=60)
        wait_until(lambda: client.check_idle()["workers_idle"], 60, "the stopped request's slots freed")
        idle = client.check_idle()
    finally:
        client.shutdown()
    assert full_tokens == want and len(want) == max_new  # negative control: no stop, full length
    assert n < max_new and cut_tokens == want[:n], (stop, n, len(cut_tokens))
    assert record["finish_reason"] == "stop" and record["token_ids"] == cut_tokens, record
    assert idle["tables"]["requests"] == 0


def test_a_worker_killed_mid_stream_gives_every_token_exactly_once() -> None:
    """Streams read through sinks; the worker dies inside a long call after 20 of its decode
    steps (`kill_in_step`). Its requests are recomputed on the replacement from the scheduler's
    history, which the readers had already passed: the sinks drop what they hold (no token
    twice, none differing) and every stream equals the uninterrupted run."""
    import raysched

    faults = [{"kind": "kill_in_step", "worker": 0, "after_steps": 1, "folded": True, "after_decode_steps": 20}]
    client = raysched.launch(sim_config(workers=1, faults=faults,
                                        scheduler={"decode_steps_per_call": 4, "fold_calls": 8}))
    try:
        handles = [client.submit([5, 5, i], {"max_new_tokens": 80}, stream=True) for i in range(3)]
        readers = [Reader(h) for h in handles]
        for r in readers:
            r.thread.join(180)
        stats = client.stats()
        sink = ray.get(client.sink.stats.remote())
    finally:
        client.shutdown()
    assert stats["worker_failures"] == 1 and stats["recovered"] >= 1, stats
    assert sink["mismatches"] == 0, sink
    for h, r in zip(handles, readers):
        assert r.error is None
        assert r.tokens == reference(h.request_id, [5, 5, int(h.prompt_ids[-1])], 80)


@pytest.mark.parametrize("fold", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["folded-calls", "pipelined-calls"])
def test_a_reader_attached_late_gets_every_token_through_its_sink_by_the_end(fold: bool) -> None:
    """A request submitted without a sink and read from midway (`attach_sink`, as `stream()` on
    a handle submitted without `stream=True` does), while its worker runs long calls, folded or
    pipelined (a successor call in flight when the sink is attached: the seed is sent with the
    first plan after both replies were applied, so no token falls between the seed and the
    worker's first push). The sink itself holds every token, with the request's end, once the
    request has ended: its reader needs no record from the scheduler. Control: a sink opened
    for the request but never attached gets no token."""
    import raysched
    from raysched.sink import new_sink

    prompt, max_new = [2, 7, 1], 240
    client = raysched.launch(sim_config(workers=1, scheduler={"decode_steps_per_call": 4, "fold_calls": 8,
                                                              "fold_successor": fold}))
    try:
        handle = client.submit(prompt, {"max_new_tokens": max_new})
        rid = handle.request_id
        wait_until(lambda: client.stats()["tokens"] >= 40, 60, "40 tokens before the reader comes")
        late, never = new_sink(), new_sink()
        ray.get(never.open.remote(rid))
        assert client._call("attach_sink", rid, late)
        record = handle.result(timeout=120)

        def sink_done() -> bool:
            return ray.get(late.next.remote(rid, 0, 1.0))[1]

        wait_until(sink_done, 30, "the late sink holds the request's end")
        tokens, done, error = ray.get(late.next.remote(rid, 0, 1.0))
        control = ray.get(never.next.remote(rid, 0, 0.1))
    finally:
        client.shutdown()
    assert done and error is None
    assert tokens == record["token_ids"] == reference(rid, prompt, max_new)
    assert control == ([], False, None)


def test_a_reader_that_goes_away_aborts_its_requests() -> None:
    """Two streamed requests, each read through its own sink; one sink dies (as it does when
    its reader's process exits: the sink is fate-shared with it) after 10 tokens. The scheduler
    notices within a check (`Scheduler._watch_readers`) and aborts that request long before its
    2,000 tokens; its worker drops it and the pools end empty. Control: the request whose reader
    stays runs its full length with the reference tokens."""
    import raysched
    from raysched.sink import new_sink

    client = raysched.launch(sim_config(workers=1, scheduler={"decode_steps_per_call": 4}))
    try:
        gone_sink, kept_sink = new_sink(), new_sink()
        gone = client._call("submit", [4, 4, 1], {"max_new_tokens": 2000}, None, 0, True, gone_sink)
        kept = client._call("submit", [4, 4, 2], {"max_new_tokens": 200}, None, 0, True, kept_sink)
        wait_until(lambda: len(ray.get(gone_sink.next.remote(gone, 0, 1.0))[0]) >= 10, 60, "10 tokens read")
        ray.kill(gone_sink)
        gone_record = ray.get(client.scheduler.wait.remote(gone), timeout=60)
        kept_record = ray.get(client.scheduler.wait.remote(kept), timeout=60)
        wait_until(lambda: client.check_idle()["workers_idle"], 60, "the aborted request's slots freed")
        stats, idle = client.stats(), client.check_idle()
    finally:
        client.shutdown()
    assert gone_record["finish_reason"] == "abort" and len(gone_record["token_ids"]) < 2000, gone_record
    assert kept_record["finish_reason"] == "length"
    assert kept_record["token_ids"] == reference(kept, [4, 4, 2], 200)
    assert stats["readers_lost"] == 1 and stats["aborted"] == 1, stats
    assert idle["tables"]["requests"] == 0


def test_a_client_reads_all_its_streams_in_one_call_per_step() -> None:
    """A client's streams are read by one long-poll for all of them (`raysched.sink.SinkReader`),
    not a call per stream per step: 8 streams of 60 tokens, read in 8 threads, cost the client's
    sink far fewer reads than tokens, and each stream has the tokens of an uninterrupted run.
    Negative control: the same kind of requests read through a sink that is not the client's own
    (`TokenSink.next` per stream, as before) cost several times as many reads."""
    import raysched
    from raysched.client import RequestHandle
    from raysched.sink import new_sink

    streams, max_new = 8, 60
    client = raysched.launch(sim_config(workers=1, pool={"kv_tokens": 4096, "state_slots": streams}))
    try:
        handles = [client.submit([6, 1, i], {"max_new_tokens": max_new}, stream=True) for i in range(streams)]
        readers = [Reader(h) for h in handles]
        for r in readers:
            r.thread.join(120)
        own = ray.get(client.sink.stats.remote())
        other = new_sink()
        ids = [client._call("submit", [6, 2, i], {"max_new_tokens": max_new}, None, 0, True, other)
               for i in range(streams)]
        controls = [Reader(RequestHandle(client, rid, [6, 2, i], {"max_new_tokens": max_new}, sink=other))
                    for i, rid in enumerate(ids)]
        for r in controls:
            r.thread.join(120)
        theirs = ray.get(other.stats.remote())
    finally:
        client.shutdown()
    for h, r in zip(handles, readers):
        assert r.error is None and r.tokens == reference(h.request_id, [6, 1, int(h.prompt_ids[-1])], max_new)
    for i, (rid, r) in enumerate(zip(ids, controls)):
        assert r.error is None and r.tokens == reference(rid, [6, 2, i], max_new)
    print(f"\nreads of the sink for {streams} streams x {max_new} tokens: one long-poll {own['reads']}, "
          f"a call per stream {theirs['reads']}")
    assert own["reads"] < streams * max_new / 3, own
    assert own["pushes"] < 2 * max_new, own  # one per step for all 8 (each brought its own handle copy)
    assert theirs["reads"] >= 2 * own["reads"], (own, theirs)  # negative control (8x here)


def test_steps_queued_behind_a_slow_push_go_out_as_one_push() -> None:
    """The sender thread merges what queued up while a push was going out (steps shorter than a
    push): one push per sink, each request's pieces joined in order, its end kept; a piece that
    does not follow on (a gap) starts another push. Control: sent at once (no sender thread),
    each step is a push of its own."""
    from actors.sinks import merge_pushes

    gate, entered = threading.Event(), threading.Event()

    class SlowSink(FakeSink):
        def remote(self, pieces: dict) -> None:
            entered.set()
            gate.wait(10)
            super().remote(pieces)

    for threaded in (True, False):
        gate.clear()
        sink = SlowSink()
        sinks = Sinks(threaded=threaded)
        sinks.note_plan(StepPlan(prefill=(PrefillItem("x", (1, 2), 2, {}, sink), PrefillItem("y", (1,), 1, {}, sink))))
        if not threaded:
            gate.set()
        for step in range(4):  # the first push blocks (threaded): the next three queue behind it
            sinks.send({"x": [10 + step], "y": [20 + step]}, {"y": "length"} if step == 3 else {})
            if step == 0:
                assert entered.wait(10)
        gate.set()
        sinks.flush()
        if threaded:
            assert sink.pushes == [{"x": (0, [10], None), "y": (0, [20], None)},
                                   {"x": (1, [11, 12, 13], None), "y": (1, [21, 22, 23], "length")}]
        else:  # control
            assert len(sink.pushes) == 4
    a = FakeSink()
    assert merge_pushes([(a, {"x": (0, [1], None)}), (a, {"x": (3, [4], None)})]) == \
        [(a, {"x": (0, [1], None)}), (a, {"x": (3, [4], None)})]  # a gap: two pushes
