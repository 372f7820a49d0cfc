"""The simulated data plane (`data_plane: sim`): workers with the real interface and pool
accounting, no model, no torch.

A `SimWorker` answers the same calls as `actors.worker.Worker` (info, usage, running_ids,
is_idle, retract, retract_pending, step, step_stream, interrupt, join, take_parked, ...) with the same pool bookkeeping
(`actors.accounting.PoolLedger`: KV pages and one state slot per request), so it runs out of room,
stalls, is retracted and resumed exactly as a real worker of that size would. What it does not do
is compute:

- tokens are pseudo-random, a function of (seed, request id, position): a request's recurrent
  "state" is a 64-bit digest that starts from (seed, request id) and folds in each token it
  generates, and token n is drawn from (state, n). A resume from a snapshot restores the digest,
  a recompute replays it from the token history: either way the tokens that follow are the ones
  an uninterrupted run would have produced, and a lost or zeroed state (`debug_drop_state`)
  produces other tokens, so the exactness checks and their negative control work unchanged;
- a step call's time is modeled (`SimConfig.step_ms`): `SimHost` sleeps that long before the
  reply, holding the worker's turn, so calls to one worker never overlap; a streamed step call
  (`SimHost.stream`) sends its prefills' first tokens and each decode step's tokens at their
  modeled times. Each decode step is computed when the one before it has gone out, so an
  interrupt (`SimHost.interrupt`, beside the call, as the worker actor's) ends the call there
  (a call with one reply sleeps in slices of ~40 ms, and ends at the end of the slice under way);
- snapshots are small objects that carry their *nominal* byte size (`SimConfig.kv_bytes_per_token`
  per cached token + `state_bytes`) and a checksum over what they do carry;
- prompts are prefilled whole in one call (no chunking), and no turn-cache state is parked.

`SimHost` holds many simulated workers in one process (`sim.workers_per_process`), so a fleet of
hundreds fits in a few GiB; the control plane addresses each through a handle with the worker
actor's methods (`raysched.workers.SimWorkerHandle`). Fault injection goes through the same seam
as the real worker (`actors.faults.with_faults`); a simulated worker "dies" by raising
`SimWorkerDied` from then on, its process and neighbours stay up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from actors.accounting import PageLedger, PoolLedger, SlotLedger
from actors.joins import JoinBox, goes_on_past_finish, notify_finished
from actors.sinks import Sinks
from raysched.config import ServeConfig
from raysched.messages import NOTICE_SEQ, FaultPoint, FinishNotice, PrefillItem, StepPlan, StepResult, StepTokens, Usage, WorkerInfo
from raysched.sampling import SamplingParams

MASK64 = (1 << 64) - 1
NOMINAL_COPY_BYTES_PER_S = 10e9  # for the auto retract mode's cost model


def mix64(x: int) -> int:
    """SplitMix64's finalizer: a 64-bit integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def initial_state(seed: int, request_id: str) -> int:
    return mix64(seed ^ zlib.crc32(request_id.encode()))


def draw(state: int, position: int, vocab_size: int) -> int:
    """The token at `position` of a request whose state is `state`: mix64(state ^ position)
    modulo the vocabulary (written out: this runs once per simulated token)."""
    x = ((state ^ position) + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) % vocab_size


def advance(state: int, token: int) -> int:
    """The state after feeding `token` (as a model's state folds in each token it reads):
    mix64(state ^ (token << 1) ^ 1), written out as in `draw`."""
    x = ((state ^ (token << 1) ^ 1) + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class SnapshotError(ValueError):
    """A simulated snapshot cannot be restored here: another fleet, or corrupted bytes."""


class SnapshotLost(Exception):
    """The snapshot's object could not be read (`SimHost` resolves refs before the call)."""


@dataclass(frozen=True)
class SimSnapshot:
    """A request's complete (simulated) state. `nbytes` is the nominal size a real snapshot of
    this many cached tokens would have; `payload` is what the checksum covers."""

    request_id: str
    token_ids: tuple[int, ...]
    prompt_len: int
    sampling: dict
    fingerprint: str
    payload: bytes  # the state digest and a digest of the tokens
    checksum: int
    nbytes: int

    @property
    def num_cached_tokens(self) -> int:
        return len(self.token_ids) - 1


@dataclass
class SimSequence:
    request_id: str
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    state: int

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass(frozen=True)
class Lost:
    """Stands in for a snapshot whose object could not be read (why)."""

    reason: str


class SimEngine:
    """The engine's bookkeeping without a model: sequences, the pool ledger, pseudo-tokens."""

    def __init__(self, config: ServeConfig) -> None:
        sim, pool = config.sim, config.pool.resolve(config.sim.kv_bytes_per_token, config.sim.state_bytes)
        self.sim = sim
        self.seed = config.seed
        self.pool = PoolLedger(PageLedger(pool.kv_tokens, pool.page_size), SlotLedger(pool.state_slots))
        self.fingerprint = f"sim-v{sim.vocab_size}-s{config.seed}"
        self.running: dict[str, SimSequence] = {}

    def prefill(self, items: list[PrefillItem], out: StepResult) -> int:
        """Start each item (history replayed into its state); returns the prompt tokens fed."""
        fed = 0
        for item in items:
            if not self.pool.admit(item.request_id, len(item.token_ids)):
                out.not_admitted.append(item.request_id)
                continue
            params = SamplingParams.from_dict(item.sampling)
            seq = SimSequence(item.request_id, list(item.token_ids), item.prompt_len, params,
                              initial_state(self.seed ^ params.seed, item.request_id))
            for token in seq.token_ids[seq.prompt_len:]:  # a recompute: replay the outputs
                seq.state = advance(seq.state, token)
            self.running[seq.request_id] = seq
            fed += len(item.token_ids)
            self._sample(seq, out)
        return fed

    def decode(self, num_steps: int, out: StepResult | None = None) -> dict[str, list[int]]:
        """`num_steps` decode steps of every running sequence (a sequence that gets no KV room
        for its next token is listed in `out.stalled` and skipped); the tokens made, which
        `out.new_tokens` gets too."""
        out = out if out is not None else StepResult()
        made: dict[str, list[int]] = {}
        for _ in range(num_steps):
            for seq in list(self.running.values()):
                rid = seq.request_id
                if not self.pool.extend(rid, len(seq.token_ids)):
                    if rid not in out.stalled:
                        out.stalled.append(rid)
                    continue
                token = self._sample(seq, out)
                if rid in made:
                    made[rid].append(token)
                else:
                    made[rid] = [token]
        return made

    def _sample(self, seq: SimSequence, out: StepResult) -> int:
        token = draw(seq.state, seq.num_generated, self.sim.vocab_size)
        seq.state = advance(seq.state, token)
        seq.token_ids.append(token)
        toks = out.new_tokens.get(seq.request_id)
        if toks is None:
            out.new_tokens[seq.request_id] = [token]
        else:
            toks.append(token)
        reason = seq.sampling.finish_reason(token, seq.num_generated)
        if reason is not None:
            out.finished[seq.request_id] = reason
            self.release(seq.request_id)
        return token

    def release(self, request_id: str) -> None:
        self.running.pop(request_id)
        self.pool.release(request_id)

    def snapshot(self, request_id: str) -> SimSnapshot:
        """Take the request's state out and free its slots."""
        seq = self.running[request_id]
        payload = struct.pack("<QQ", seq.state, zlib.crc32(struct.pack(f"<{len(seq.token_ids)}q", *seq.token_ids)))
        nbytes = (len(seq.token_ids) - 1) * self.sim.kv_bytes_per_token + self.sim.state_bytes
        snap = SimSnapshot(request_id, tuple(seq.token_ids), seq.prompt_len, seq.sampling.to_dict(),
                           self.fingerprint, payload, zlib.crc32(payload), nbytes)
        self.release(request_id)
        return snap

    def restore(self, snap: SimSnapshot, request_id: str) -> bool:
        """Put a snapshot's request back; False (nothing taken) if it does not fit."""
        if snap.fingerprint != self.fingerprint:
            raise SnapshotError(f"snapshot of fleet {snap.fingerprint!r}, this worker is {self.fingerprint!r}")
        if zlib.crc32(snap.payload) != snap.checksum:
            raise SnapshotError("snapshot checksum mismatch (corrupted payload)")
        if not self.pool.admit(request_id, snap.num_cached_tokens, zero_state=False):
            return False
        state, _ = struct.unpack("<QQ", snap.payload)
        self.running[request_id] = SimSequence(request_id, list(snap.token_ids), snap.prompt_len,
                                               SamplingParams.from_dict(snap.sampling), state)
        return True


class SimWorker:
    """A simulated worker: the interface of `actors.worker.Worker` (see the module doc)."""

    def __init__(self, config: ServeConfig, index: int, node_id: str = "local") -> None:
        self.index = index
        self.config = config
        self.node_id = node_id
        self.engine = SimEngine(config)
        self.last_step_ms = 0.0  # the modeled time of the last step call
        self.dead = False
        self._interrupted = 0  # the `StepPlan.call_id` whose decoding is to end early
        self._joins = JoinBox()  # requests sent to start inside a long call (`join`)
        self.sinks = Sinks()  # streamed requests' readers (`actors.sinks`): `SimHost` sends each
        #   piece's tokens to them at its modeled time
        self._call: tuple[StepPlan, StepResult] | None = None  # the step call under way, its result so far
        self.notify: FinishNotice | None = None  # how finish notices leave: its host's batched replies
        #   (`SimHost`, with `sim.batch_calls`); None: a Ray call to the plan's `notices`

    # ------------------------------------------------------------------ queries
    def info(self) -> WorkerInfo:
        sim = self.config.sim
        prefill_tps = 1000.0 / sim.prefill_ms_per_token if sim.prefill_ms_per_token else 1e9
        return WorkerInfo(self.index, self.node_id, "sim", self.engine.fingerprint, sim.vocab_size,
                          sim.max_context, self.usage(), sim.kv_bytes_per_token, sim.state_bytes,
                          NOMINAL_COPY_BYTES_PER_S, prefill_tps, joins=True)

    def usage(self) -> Usage:
        return self.engine.pool.usage()

    def running_ids(self) -> list[str]:
        return sorted(self.engine.running)

    def is_idle(self) -> bool:
        return not self.engine.running and self.engine.pool.is_empty()

    # ------------------------------------------------------------------ commands
    def retract(self, request_id: str) -> SimSnapshot:
        return self.engine.snapshot(request_id)

    def retract_pending(self, request_id: str, fault: FaultPoint | None = None) -> tuple[SimSnapshot, int]:
        snap = self.retract(request_id)
        return snap, snap.nbytes

    def step(self, plan: StepPlan, *snapshots: Any) -> StepResult:
        """Drop, resume, prefill (whole prompts), decode; `last_step_ms` is the modeled time."""
        return self._timeline(plan, *snapshots)[-1][1]

    def step_stream(self, plan: StepPlan, *snapshots: Any) -> Iterator[StepTokens | StepResult]:
        """`step`, its tokens first as `actors.worker.Worker.step_stream` sends them (in-process
        use; `SimHost.stream` sends them at their modeled times)."""
        for _, piece in self._run(plan, *snapshots):
            self._deliver(piece)
            yield piece

    def _deliver(self, piece: StepTokens | StepResult) -> None:
        """A piece has gone out: its tokens go to the readers' sinks too (`actors.sinks`), and
        its finished requests to the scheduler if the call goes on past them (`notices`)."""
        if isinstance(piece, StepTokens):
            self.sinks.send(piece.new_tokens, piece.finished)
            if piece.finished and self._call is not None:
                notify_finished(self._call[0], self.index, piece.finished, self._call[1].new_tokens, self.notify)

    def interrupt(self, call_id: int) -> None:
        """End step call `call_id`'s decoding after the step under way (`Worker.interrupt`)."""
        self._interrupted = call_id

    def join(self, call_id: int, items: list[PrefillItem]) -> None:
        """Start `items` inside step call `call_id` (`StepPlan.joins`) before its next decode step
        (`Worker.join`); beside the calls, not in their order."""
        self._joins.put(call_id, items)

    def _take_joins(self, plan: StepPlan, result: StepResult) -> int:
        """Prefill what was sent to join this call; returns the prompt tokens fed."""
        items = self._joins.take(plan)
        if not items:
            return 0
        before = len(result.not_admitted)
        self.sinks.note_items(items)
        fed = self.engine.prefill(items, result)
        no_room = set(result.not_admitted[before:])
        result.joined.extend(item.request_id for item in items if item.request_id not in no_room)
        return fed

    def _timeline(self, plan: StepPlan, *snapshots: Any) -> list[tuple[float, StepTokens | StepResult]]:
        return list(self._run(plan, *snapshots))

    def _run(self, plan: StepPlan, *snapshots: Any) -> Iterator[tuple[float, StepTokens | StepResult]]:
        """The step call, one decode step at a time, as the pieces `step_stream` sends, each with
        its modeled time in ms after the one before: the prefills' first tokens, each decode
        step's tokens, the `StepResult`; the times add up to `last_step_ms`. Each step is
        computed when the piece before it has gone, so an interrupt that came meanwhile ends
        the decoding there (the reply covers the steps that ran), as does a finished request
        with `plan.end_at_finish` (unless the call tells the scheduler: `plan.notices`), and
        a step with nothing left to decode and no join waiting."""
        result = StepResult()
        self._call = (plan, result)
        fed, rows = self._start(plan, snapshots, result)
        sim, sent_ms, steps = self.config.sim, 0.0, plan.decode_steps
        prefilled = {item.request_id for item in plan.prefill} - set(result.not_admitted)
        first = {rid: toks[:1] for rid, toks in result.new_tokens.items() if rid in prefilled and toks}
        if first:
            sent_ms = sim.step_ms(fed, 0, rows)
            yield sent_ms, StepTokens(first, _ended(first, result))
        one_step = dataclasses.replace(plan, decode_steps=1, fault=None)  # (the fault fires here)
        joined_ms = 0.0  # the modeled time of the prefills of joins
        for k in range(plan.decode_steps):
            if plan.interrupted_by(self._interrupted) or not (self.engine.running or self._joins.pending(plan)):
                steps = k  # (nothing left to decode ends it, as `Engine.decode_steps` does)
                break
            finished = len(result.finished)
            toks, join_fed = self._decode_step(plan, one_step, k, result)
            if join_fed:
                joined_ms += sim.step_ms(join_fed, 0, 0)
            if toks:
                ms = sim.step_ms(join_fed + (0 if sent_ms else fed), 1, rows)
                sent_ms += ms
                yield ms, StepTokens(toks, _ended(toks, result))
            if not goes_on_past_finish(plan) and len(result.finished) > finished:
                steps = k + 1
                break
        result.not_admitted.extend(self._joins.close(plan))
        self.sinks.keep_only(self.engine.running)
        if plan.fault is not None and plan.fault.after_decode_steps >= steps:
            self._die_at(plan.fault, "kill_in_step")  # after the call's last step
        self.last_step_ms = sim.step_ms(fed, steps, rows) + joined_ms
        result.allocated = {rid: self.engine.pool.kv.num_request_tokens(rid) for rid in self.engine.running}
        result.usage = self.usage()
        result.busy_s = self.last_step_ms / 1000.0
        yield self.last_step_ms - sent_ms, result

    def _start(self, plan: StepPlan, snapshots: tuple, result: StepResult) -> tuple[int, int]:
        """Drop, resume, prefill; (prompt tokens fed, rows decoding)."""
        self.sinks.note_plan(plan)
        for rid in plan.drop:
            if rid in self.engine.running:
                self.engine.release(rid)
        for rid, snap in zip(plan.resume, snapshots[:len(plan.resume)]):
            if self._restore_one(plan, rid, snap, result) is False:
                result.not_admitted.append(rid)
        fed = self.engine.prefill(list(plan.prefill), result)
        return fed, len(self.engine.running)

    def _decode_step(self, plan: StepPlan, one_step: StepPlan, k: int,
                     result: StepResult) -> tuple[dict[str, list[int]], int]:
        """Decode step `k` of the call (`one_step`: its plan for one step, without the fault: a
        `kill_in_step` fault fires here, before the step it names), after starting what joined
        the call (`join`); the tokens it made (a joined request's first with them), and the
        prompt tokens the joins fed."""
        if plan.fault is not None and plan.fault.after_decode_steps == k:
            self._die_at(plan.fault, "kill_in_step")
        joined = len(result.joined)
        fed = self._take_joins(plan, result)
        made = self._decode(one_step, result)
        for rid in result.joined[joined:]:  # their first tokens, from the prefill
            made[rid] = result.new_tokens[rid][:1] + made.get(rid, [])
        return made, fed

    def take_parked(self, keys: list[tuple[str, str]]) -> Any:
        raise KeyError(f"a simulated worker parks no states; asked for {keys}")

    def discard_parked(self, keys: list[tuple[str, str]]) -> None:
        """Nothing is parked here (the same interface as the real worker's)."""

    # ------------------------------------------------------------------ live migration: not modelled
    def migrate_out(self, request_id: str, start: int, block_tokens: int, final: bool,
                    fault: FaultPoint | None = None) -> Any:
        raise NotImplementedError("a simulated worker does not model live migration")

    def reserve(self, request_id: str, num_tokens: int, fault: FaultPoint | None = None) -> bool:
        """Refused (no room): a live migration to a simulated worker leaves the request where it is."""
        return False

    def migrate_in(self, request_id: str, blocks: list, fault: FaultPoint | None = None) -> bool:
        raise NotImplementedError("a simulated worker does not model live migration")

    def commit(self, snapshot: list, fault: FaultPoint | None = None) -> bool:
        raise NotImplementedError("a simulated worker does not model live migration")

    def unreserve(self, request_id: str) -> bool:
        return False

    # ------------------------------------------------------------------ hooks (see actors.faults)
    def _decode(self, plan: StepPlan, result: StepResult | None = None) -> dict[str, list[int]]:
        return self.engine.decode(plan.decode_steps, result)

    def _restore_one(self, plan: StepPlan, rid: str, snap: Any, result: StepResult) -> bool | None:
        return result.record_restore(rid, lambda: self.engine.restore(_fetch(snap), rid), SnapshotError, SnapshotLost)

    def _zero_state(self, rid: str) -> None:
        self.engine.running[rid].state = 0

    def _die_at(self, fault: FaultPoint | None, kind: str) -> None:
        """A simulated worker dies alone: it raises now and on every later call."""
        if fault is not None and fault.kind == kind:
            self.dead = True
            raise SimWorkerDied(f"fault injection: {kind}: simulated worker {self.index} died")


def _ended(tokens: dict[str, list[int]], result: StepResult) -> dict[str, str]:
    """Those of a piece's requests that finished (their reason), for their readers' sinks."""
    return {rid: result.finished[rid] for rid in tokens if rid in result.finished} if result.finished else {}


class SimWorkerDied(RuntimeError):
    """A simulated worker was killed (fault injection); its calls fail from then on."""


def _fetch(snap: Any) -> SimSnapshot:
    if isinstance(snap, Lost):
        raise SnapshotLost(snap.reason)
    if isinstance(snap, list):  # an unresolved nested ref (in-process use passes snapshots)
        snap = snap[0]
    if not isinstance(snap, SimSnapshot):
        raise SnapshotError(f"not a simulated snapshot: {type(snap).__name__}")
    return snap


SLEEP_SLICE_MS = 40.0  # a step call with one reply sleeps its modeled time in slices this long


class SimHost:
    """Many simulated workers in one (async actor) process. Every call names its worker and its
    sequence number (the order the scheduler sent it in); calls to one worker run one at a time,
    in that order, and a step call holds the worker's turn for its modeled time."""

    def __init__(self, config: ServeConfig, node_id: str = "local") -> None:
        self.config = config
        self.node_id = node_id
        self.workers: dict[int, SimWorker] = {}
        self._turn: dict[int, int] = {}
        self._changed = asyncio.Condition()
        self._replies: list[tuple[int, int, bool, Any]] = []  # batched step calls' replies, not collected yet
        self._replied = asyncio.Event()
        self._running: set[asyncio.Task] = set()

    async def add(self, index: int) -> None:
        from actors.faults import needs_faults, with_faults

        cls = with_faults(SimWorker) if needs_faults(self.config) else SimWorker
        async with self._changed:
            self.workers[index] = cls(self.config, index, self.node_id)
            if self.config.sim.batch_calls:  # its finish notices go with the replies `collect` brings back
                self.workers[index].notify = self._notice
            self._turn[index] = 0
            self._changed.notify_all()

    async def call(self, index: int, seq: int, method: str, *args: Any) -> Any:
        """Run worker `index`'s `method` as call number `seq` (snapshot refs among a step's
        arguments are read first, outside the turn); a step call takes its modeled time."""
        if method == "step":
            return await self._step(index, seq, *args)
        await self._wait_turn(index, seq)
        try:
            return getattr(self._alive(index), method)(*args)
        finally:
            await self._end_turn(index, seq)

    def submit(self, items: list[tuple]) -> None:
        """What the scheduler sent together (`raysched.workers.HostChannel`), in its order:
        ("step", worker index, sequence number, the step's arguments), started here, its reply
        kept for `collect`; ("interrupt", worker index, call id) and ("join", worker index, call
        id, items), done at once."""
        for kind, index, *rest in items:
            if kind in ("interrupt", "join"):
                getattr(self, kind)(index, *rest)
                continue
            task = asyncio.get_running_loop().create_task(self._reply(index, *rest))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def collect(self) -> list[tuple[int, int, bool, Any]]:
        """Every reply ready, at least one: (index, seq, ok, the StepResult or the exception)."""
        await self._replied.wait()
        replies, self._replies = self._replies, []
        self._replied.clear()
        return replies

    def _notice(self, worker: int, notice_id: int, ended: dict) -> None:
        """A worker's finish notice, sent with the replies (`HostChannel` routes it by its
        sequence number, `NOTICE_SEQ`), at the modeled time of its piece."""
        self._replies.append((worker, NOTICE_SEQ, True, (notice_id, ended)))
        self._replied.set()

    async def _reply(self, index: int, seq: int, args: tuple) -> None:
        try:
            reply = (index, seq, True, await self._step(index, seq, *args))
        except Exception as err:  # the worker died: its caller recovers, as from a failed call
            reply = (index, seq, False, err)
        self._replies.append(reply)
        self._replied.set()

    async def stream(self, index: int, seq: int, plan: StepPlan, *snapshots: Any) -> AsyncIterator[Any]:
        """Worker `index`'s `step_stream` as call number `seq` (a Ray streaming generator):
        each piece of `SimWorker._run` at its modeled time."""
        snapshots = tuple([await _resolve(s) for s in snapshots])
        await self._wait_turn(index, seq)
        try:
            for ms, piece in self._alive(index)._run(plan, *snapshots):
                if ms > 0:
                    await asyncio.sleep(ms / 1000.0)
                self._alive(index)._deliver(piece)  # (killed while the call was running: no more pieces)
                yield piece
        finally:
            await self._end_turn(index, seq)

    async def _step(self, index: int, seq: int, plan: StepPlan, *snapshots: Any) -> StepResult:
        """A step call with one reply: `SimWorker._run`, sleeping its modeled time in slices of
        about `SLEEP_SLICE_MS` (a wake-up per decode step per worker cost a fleet of 256 more
        CPU than everything else); an interrupt ends it at the end of the slice under way. A piece
        with tokens for a reader's sink is slept to its own time and sent then (a streamed
        request gets each step as it completes)."""
        snapshots = tuple([await _resolve(s) for s in snapshots])
        await self._wait_turn(index, seq)
        try:
            pending_ms, out, held = 0.0, None, []
            worker = self._alive(index)
            for ms, out in worker._run(plan, *snapshots):
                pending_ms += ms
                held.append(out)
                streamed = isinstance(out, StepTokens) and worker.sinks.wants(out.new_tokens)
                if pending_ms >= SLEEP_SLICE_MS or isinstance(out, StepResult) or streamed:
                    await asyncio.sleep(pending_ms / 1000.0)
                    pending_ms = 0.0
                    for piece in held:
                        self._alive(index)._deliver(piece)  # (killed while the call was running: no reply)
                    held = []
            return out
        finally:
            await self._end_turn(index, seq)

    def interrupt(self, index: int, call_id: int) -> None:
        """`SimWorker.interrupt`, at once (not in the worker's order of calls)."""
        worker = self.workers.get(index)
        if worker is not None:  # (not added yet: it has no call to end)
            worker.interrupt(call_id)

    def join(self, index: int, call_id: int, items: list[PrefillItem]) -> None:
        """`SimWorker.join`, at once (as `interrupt`)."""
        worker = self.workers.get(index)
        if worker is not None and not worker.dead:
            worker.join(call_id, items)

    async def _wait_turn(self, index: int, seq: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._turn.get(index) == seq)

    async def _end_turn(self, index: int, seq: int) -> None:
        async with self._changed:
            self._turn[index] = seq + 1
            self._changed.notify_all()

    def _alive(self, index: int) -> SimWorker:
        worker = self.workers[index]
        if worker.dead:
            raise SimWorkerDied(f"simulated worker {index} was killed")
        return worker

    def kill(self, index: int) -> None:
        self.workers[index].dead = True


async def _resolve(snap: Any) -> Any:
    """A step's snapshot argument read here: `[ref]` (or a bare ref, inside a batch of calls) ->
    the object, or `Lost` if unreadable."""
    import ray

    if not isinstance(snap, (list, ray.ObjectRef)):
        return snap
    try:
        return await (snap[0] if isinstance(snap, list) else snap)
    except Exception as err:  # its node died with it, or its retraction failed
        return Lost(type(err).__name__)
