"""The worker actor: one per GPU (or CPU), owning one engine and its hybrid pool.

It follows step plans from the scheduler and never decides anything itself. Snapshots it takes
are the *return values* of `retract_pending` (parked turn states those of `take_parked`), so the
caller (the scheduler) owns them in the object store and they outlive this process. This class
has no fault-injection code: `actors.faults.with_faults` derives the class that honours the
`FaultPoint`s calls carry, overriding the hook methods `_restore_one`, `_decode` and
`retract_pending` (the scheduler starts it only when faults are configured).

    worker = ray.remote(num_gpus=1)(Worker).remote(config, index=0)
    info = ray.get(worker.info.remote())

The scheduler starts it through `raysched.workers.Worker`, a shell that imports this module only
in the worker's own process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import ray
import torch

from actors.engine import Engine, Sequence, StepOutput, build_engine
from actors.joins import JoinBox, goes_on_past_finish, notify_finished
from actors.sinks import Sinks
from actors.model import matrix_kernel
from actors.snapshot import KVBlock, Snapshot, SnapshotError
from raysched.config import ServeConfig
from raysched.messages import (SNAPSHOT_LOST, FaultPoint, ParkedPoint, PrefillItem, StepPlan, StepResult, StepTokens,
                               Usage, WorkerInfo)
from raysched.sampling import SamplingParams


class Worker:
    def __init__(self, config: ServeConfig, index: int) -> None:
        self.index = index
        self.config = config
        self.engine: Engine = build_engine(config.model, config.dtype, config.device,
                                           pool_config=config.pool, invariant_tile=config.invariant_tile,
                                           seed=config.seed,
                                           fixed_shape_decode=config.fixed_shape_decode)
        self._speeds: tuple[float, float] | None = None
        self._parked: dict[tuple[str, str, int], Snapshot | KVBlock] = {}  # ParkedPoint keys ->
        #   copies, until taken or discarded
        self._interrupted = 0  # the `StepPlan.call_id` whose decoding is to end early
        self._joins = JoinBox()  # requests sent to start inside a long call (`join`)
        self.sinks = Sinks(threaded=True)  # streamed requests' readers: each step's tokens go there

    # ------------------------------------------------------------------ queries
    def info(self) -> WorkerInfo:
        e = self.engine
        itemsize = e.pool.k.element_size()
        copy_bps, prefill_tps = self._measure_speeds() if self.config.scheduler.retract == "auto" else (0.0, 0.0)
        return WorkerInfo(self.index, _node_id(), str(e.device), e.fingerprint, e.config.vocab_size,
                          e.config.max_position_embeddings, self.usage(),
                          e.config.kv_bytes_per_token(itemsize), e.config.state_bytes_per_slot(itemsize),
                          copy_bps, prefill_tps, matrix_kernel(e.model), joins=True, prefix_grid=e.prefix_grid)

    def usage(self) -> Usage:
        return self.engine.usage()

    def running_ids(self) -> list[str]:
        """Requests holding slots here: decoding and prefilling."""
        return sorted([*self.engine.running, *self.engine.prefilling])

    def is_idle(self) -> bool:
        """True when no request is running and every slot is back in the free lists."""
        return not self.running_ids() and not self.engine.reserved and self.engine.pool.is_empty()

    # ------------------------------------------------------------------ commands
    def retract(self, request_id: str) -> Snapshot:
        """Snapshot the request and free its slots; the snapshot is this call's return value.

        A request mid-prefill gives the state of the chunks it has fed (`Snapshot.computed`);
        its resume goes on prefilling from there. One that has not fed a chunk yet has nothing
        to give: its slots are freed and the call raises SnapshotError (the scheduler resumes
        it by recompute, which here costs nothing more).
        """
        try:
            return self.engine.snapshot(request_id)
        except SnapshotError:  # nothing fed yet: free its slots all the same
            self.engine.release(request_id)
            raise

    def retract_pending(self, request_id: str, fault: FaultPoint | None = None) -> tuple[Snapshot, int]:
        """`retract` for a call made with ``num_returns=2``: (snapshot, its payload bytes).

        The scheduler queues the request at once with the first ref (a destination worker reads
        the bytes from where they lie, see `_fetch`) and awaits only the small second one.
        `fault` is for the class `actors.faults.with_faults` derives (None from a scheduler
        without faults).
        """
        snap = self.retract(request_id)
        return snap, int(snap.nbytes)

    def step(self, plan: StepPlan, *snapshots: Snapshot | list) -> StepResult:
        """Execute one plan: drop, resume, prefill, then `decode_steps` decode steps. The
        snapshots: one per `plan.resume`, then one per `plan.prefix` (parked prompt prefixes)."""
        *_, result = self.step_stream(plan, *snapshots)
        return result

    def step_stream(self, plan: StepPlan, *snapshots: Snapshot | list) -> Iterator[StepTokens | StepResult]:
        """`step`, sending tokens as they come (a Ray streaming generator): a `StepTokens` with
        the first token of each prefill that completed, one per decode step, then the call's
        `StepResult` (which lists every token again). Either way, each piece's tokens of a
        streamed request go to its reader's sink as the piece is made (`actors.sinks`)."""
        t0 = time.perf_counter()
        result = StepResult()
        self.sinks.note_plan(plan)
        for rid in plan.drop:
            if rid in self.engine.running or rid in self.engine.prefilling:
                self.engine.release(rid)
        for rid in (*plan.resume, *(item.request_id for item in plan.prefill)):
            if rid in self.engine.reserved:  # the room of a live migration that was abandoned
                self.engine.unreserve(rid)  # (its source died): this plan starts the request anew
        out = StepOutput()
        self.engine.hold_finished = plan.park_min_tokens > 0 and plan.park_turns
        self.engine.trail_calls, self.engine.trail_min_tokens = plan.trail_calls, plan.park_min_tokens
        self._park_passed(plan, result)
        n = len(plan.resume)
        self._resume(plan, snapshots[:n], result, out)
        prefilled = self._prefill(plan, snapshots[n:], result)
        self._park_prompts(prefilled, plan, result)
        out.merge(prefilled)
        if prefilled.new_tokens:
            yield self._piece(prefilled, plan, out)
        if plan.decode_steps:
            for decoded in self._decode(plan):
                out.merge(decoded)
                if decoded.new_tokens:
                    yield self._piece(decoded, plan, out)
                if plan.interrupted_by(self._interrupted) or (decoded.finished and not goes_on_past_finish(plan)):
                    break  # the scheduler needs a decision: the steps that ran are the reply
                joined = self._take_joins(plan, result)  # they decode from the next step on
                out.merge(joined)
                if joined.new_tokens:
                    yield self._piece(joined, plan, out)
        out.not_admitted.extend(self._joins.close(plan))
        self._park_finished(plan, result)
        self.sinks.flush()
        self.sinks.keep_only(self.running_ids())
        yield self._result(result, out, time.perf_counter() - t0)

    def _piece(self, made: StepOutput, plan: StepPlan, out: StepOutput) -> StepTokens:
        """One piece of a call's tokens: sent to the readers' sinks now, and to the caller; a
        call that goes on past its finished requests tells the scheduler of them (`notices`:
        after their readers' pushes went out). `out`: the call's output so far, this piece in it."""
        self.sinks.send(made.new_tokens, made.finished)
        if made.finished and plan.notices is not None:
            self.sinks.flush()
            notify_finished(plan, self.index, made.finished, out.new_tokens)
        return StepTokens(made.new_tokens, made.finished)

    def interrupt(self, call_id: int) -> None:
        """End the decoding of step call `call_id` (its `StepPlan.call_id`) after the step under
        way; nothing if that call is over. The actor runs this call beside the step call (its own
        concurrency group, `raysched.workers`): it only sets a number the step loop reads."""
        self._interrupted = call_id

    def join(self, call_id: int, items: list[PrefillItem]) -> None:
        """Start `items` inside step call `call_id` (a long call sent with `StepPlan.joins`):
        the call prefills them between two of its decode steps (by the plan's chunk and budget),
        and they decode with its other requests from the next step on; its reply lists them in
        `StepResult.joined` (one that did not fit, or came after its decoding ended, in
        `not_admitted`). Runs beside the step call, as `interrupt` does."""
        self._joins.put(call_id, items)

    def _take_joins(self, plan: StepPlan, result: StepResult) -> StepOutput:
        """Prefill, between two decode steps of the call `plan`, what was sent to join it since
        the last step, then the next chunks of the call's joins still prefilling (a prompt
        longer than the plan's chunk or budget), within the plan's budget: a joined prompt is
        fed a chunk a step and decodes inside the call, instead of waiting for its end."""
        items = self._joins.take(plan)
        unfed = [rid for rid in result.joined if rid in self.engine.prefilling]
        if not items and not unfed:
            return StepOutput()
        self.sinks.note_items(items)
        joined = self.engine.prefill([_sequence(item) for item in items] + unfed, plan.prefill_chunk_tokens or None,
                                     plan.prefill_budget_tokens or None)
        result.joined.extend(item.request_id for item in items if item.request_id not in joined.not_admitted)
        return joined

    def take_parked(self, keys: list[tuple[str, str, int]]) -> Snapshot | KVBlock | tuple:
        """Hand over copies listed in `StepResult.parked` (points and the blocks they offer, by
        `ParkedPoint.key` / `block_key`), as this call's return values (so the caller, the
        scheduler, owns them); call it with ``num_returns=len(keys)``."""
        snaps = tuple(self._parked.pop(tuple(k)) for k in keys)
        return snaps[0] if len(snaps) == 1 else snaps

    def discard_parked(self, keys: list[tuple[str, str, int]]) -> None:
        """Drop copies the scheduler does not want (blocks parked already, points refused)."""
        for k in keys:
            self._parked.pop(tuple(k), None)

    # ------------------------------------------------------------------ live migration
    def migrate_out(self, request_id: str, start: int, block_tokens: int, final: bool,
                    fault: FaultPoint | None = None) -> tuple[tuple[KVBlock, ...] | Snapshot, tuple[int, int, int]]:
        """A migration stage on the source, for a call made with ``num_returns=2``: (payload,
        (its bytes, the token it covers to, the tokens the request holds now)); the caller owns
        the payload.

        A pre-copy stage (not `final`) copies the K/V of the whole `block_tokens` blocks the
        request (decoding here, and going on) completed from token `start` on, as one `KVBlock`. The stop-and-copy (`final`) takes the request's state with K/V from `start` on
        (`Snapshot.kv_from`) and frees its slots; with `start` 0 it is a plain retraction
        snapshot (a prefilling request gives its computed part). `fault`: see
        `actors.faults`. Raises KeyError for a request not decoding here (a pre-copy stage)."""
        if final and not start:
            snap = self.retract(request_id)
            return snap, (int(snap.nbytes), snap.num_cached_tokens, snap.num_cached_tokens)
        seq = self.engine.running.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not decoding on worker {self.index}")
        if final:
            snap = self.engine.copy_state(request_id, start)
            self.engine.release(request_id)
            return snap, (int(snap.nbytes), snap.num_cached_tokens, snap.num_cached_tokens)
        end = max(start, seq.num_cached // block_tokens * block_tokens)  # whole blocks only
        blocks = (self.engine.copy_span(request_id, start, end),) if end > start else ()
        return blocks, (sum(b.nbytes for b in blocks), end, seq.num_cached)

    def reserve(self, request_id: str, num_tokens: int, fault: FaultPoint | None = None) -> bool:
        """Pre-allocate room for a request migrating in (`Engine.reserve`); False: no room."""
        return self.engine.reserve(request_id, num_tokens)

    def migrate_in(self, request_id: str, blocks: list, fault: FaultPoint | None = None) -> bool:
        """Write a pre-copy stage's blocks (`[ref]` of `migrate_out`'s payload) into the
        reservation (`Engine.receive_blocks`); False: no room for them."""
        return self.engine.receive_blocks(request_id, tuple(_fetch_all(blocks)[0]))

    def commit(self, snapshot: list, fault: FaultPoint | None = None) -> bool:
        """The stop-and-copy's arrival (`[ref]` of the final `migrate_out`): the request decodes
        here from the next step call on (`Engine.commit`); False: no room."""
        return self.engine.commit(_fetch(snapshot))

    def unreserve(self, request_id: str) -> bool:
        """Free a reservation that will not be committed (`Engine.unreserve`)."""
        return self.engine.unreserve(request_id)

    # ------------------------------------------------------------------ turn cache
    def _prefill(self, plan: StepPlan, prefixes: tuple, result: StepResult) -> StepOutput:
        """Start the plan's new items, then continue every request still prefilling (oldest
        first), in one forward: each by at most `plan.prefill_chunk_tokens` (0: to the end of its
        prompt), in all at most `plan.prefill_budget_tokens` (0: no cap; whole chunks, see
        `Engine.prefill`). New items with a parked prefix restore it first
        (`Engine.restore_prefix`) and feed only the rest of their prompt."""
        items = self._prefill_items(plan, prefixes, result)
        if not items:
            return StepOutput()
        before = {rid: s.num_computed for rid, s in self.engine.prefilling.items()}
        out = self.engine.prefill(items, plan.prefill_chunk_tokens or None, plan.prefill_budget_tokens or None)
        paused = self._park_boundaries(before, plan, result)
        while paused:  # chunks cut at a branch point (`StepPlan.park_at`) go on to their end
            before = {rid: s.num_computed for rid, s in self.engine.prefilling.items()}  # (the others
            #   stand still: their boundaries reached above are parked once)
            out.merge(self.engine.prefill(paused, plan.prefill_chunk_tokens or None))
            paused = self._park_boundaries(before, plan, result)
        return out

    def _prefill_items(self, plan: StepPlan, prefixes: tuple, result: StepResult) -> list[Sequence | str]:
        """The plan's new items (restored from their parked prefix where one came, by id then),
        then the requests still prefilling; each with its branch points (`StepPlan.park_at`)."""
        if len(plan.prefix) != len(prefixes):
            raise ValueError(f"step plan names {len(plan.prefix)} prefixes but {len(prefixes)} snapshots came")
        by_id, stops = dict(zip(plan.prefix, prefixes)), _stops(plan)
        waiting: list[Sequence | str] = list(self.engine.prefilling)  # before this call's new ones join
        for rid in waiting:
            self.engine.prefilling[rid].stops += stops.get(rid, ())
        items: list[Sequence | str] = []
        for item in plan.prefill:
            seq = _sequence(item)
            seq.stops = stops.get(item.request_id, ())
            snap = by_id.get(item.request_id)
            if snap is not None and self._restore_prefix(snap, seq, result):
                items.append(seq.request_id)  # continues from the restored state
            else:
                items.append(seq)
        return items + waiting

    def _park_boundaries(self, before: dict[str, int], plan: StepPlan, result: StepResult) -> list[str]:
        """A point at each prefill chunk boundary and each branch point (`Sequence.stops`)
        reached in this call, for prompts of at least `park_min_tokens` whose state is an
        uncached chunked prefill's (`Sequence.exact`). Returns the requests paused at a branch
        point inside a chunk (the rest of that chunk is still to feed in this call)."""
        b, paused = plan.prefill_chunk_tokens, []
        for rid, seq in self.engine.prefilling.items():
            if seq.num_computed <= before.get(rid, 0):
                continue
            at_stop = seq.num_computed in seq.stops
            if at_stop and (not b or seq.num_computed % b):
                paused.append(rid)
            wanted = plan.park_min_tokens and seq.exact and seq.prompt_len >= plan.park_min_tokens
            if wanted and (at_stop or (b and seq.num_computed % b == 0)):
                self._park(rid, "chunk", seq.num_computed // b if b else 0, b, True, result)
        return paused

    def _park_passed(self, plan: StepPlan, result: StepResult) -> None:
        """Branch points asked for after the request's prefill reached them (`StepPlan.park_at`
        at or below its computed tokens: the second prompt came while the first one's call
        ran): parked from the pool when its prefill stands there, else from the states one of
        its recent calls kept (`Engine.copy_state_at`). One no call kept is not parked (the
        scheduler stops waiting for it when this call returns)."""
        b = plan.prefill_chunk_tokens
        for rid, at in plan.park_at:
            seq = self.engine.sequence(rid)
            if seq is None or at > seq.num_computed or not seq.exact:
                continue
            standing = rid in self.engine.prefilling and at == seq.num_computed
            self._park(rid, "chunk", at // b if b else 0, b, True, result, None if standing else at)

    def _restore_prefix(self, snap: Snapshot | list, seq: Sequence, result: StepResult) -> bool:
        try:
            *blocks, point = _fetch_all(snap)
            ok = self.engine.restore_prefix(point, seq, tuple(blocks))
        except SnapshotError as err:
            result.prefix_failed[seq.request_id] = str(err)
            return False
        except SnapshotLost as err:
            result.prefix_failed[seq.request_id] = f"{SNAPSHOT_LOST}: {err}"
            return False
        if ok:
            result.cached[seq.request_id] = seq.num_computed
        return ok  # no room: the plain prefill reports it not admitted

    def _park_prompts(self, prefilled: StepOutput, plan: StepPlan, result: StepResult) -> None:
        """Park each prompt whose prefill completed in this call (in whichever call its last
        chunk ran), unless it was a recompute (history with outputs): at the last grid point
        before its end that the prefill's kept scan states hold (exact: a repeat of the prompt
        restores all but its last grid block; none when a chunk point is there), else, with no
        kept states, the state at its end (exact only on a chunk boundary of an exact prefill)."""
        min_tokens, b = plan.park_min_tokens, plan.prefill_chunk_tokens
        if not plan.park_turns:
            return
        for rid in prefilled.new_tokens:
            seq = self.engine.running.get(rid) or self.engine.held.get(rid)
            if not min_tokens or seq is None or seq.num_generated != 1 or seq.prompt_len < min_tokens:
                continue
            at = self.engine.last_state_before(rid, seq.prompt_len)
            if at is not None:
                if not b or at % b:
                    self._park(rid, "prompt", at // b if b else 0, b, True, result, at)
            elif not self.engine.trail_calls or not seq.exact:
                exact = seq.exact and bool(b) and seq.prompt_len % b == 0
                self._park(rid, "prompt", _exact_blocks(seq, b), b, exact, result)

    def _park_finished(self, plan: StepPlan, result: StepResult) -> None:
        """Copy the final state of each finished request (all tokens but the last), then free it."""
        b = plan.prefill_chunk_tokens
        for rid, seq in list(self.engine.held.items()):
            if seq.num_cached >= plan.park_min_tokens:  # (held only with `plan.park_turns`)
                self._park(rid, "finished", _exact_blocks(seq, b), b, False, result)
            self.engine.release(rid)

    def _park(self, rid: str, kind: str, num_blocks: int, block_tokens: int, exact: bool,
              result: StepResult, at: int | None = None) -> None:
        """Copy a point: the request's state now (`at`: after its first `at` tokens, a state a
        recent prefill call kept), with the K/V of its tokens after its first `num_blocks`
        blocks; and those blocks it has not offered yet, one copy each. Nothing when no call kept
        the state at `at`."""
        seq = self.engine.sequence(rid)
        kv_from = num_blocks * block_tokens
        snap = (self.engine.copy_state(rid, kv_from, exact) if at is None  # right after prefill it covers the prompt
                else self.engine.copy_state_at(rid, at, kv_from))
        if snap is None:
            return
        first = min(seq.parked_blocks, num_blocks)
        blocks = self.engine.copy_blocks(rid, first, num_blocks, block_tokens) if block_tokens else []
        seq.parked_blocks = max(seq.parked_blocks, num_blocks)
        point = ParkedPoint(rid, kind, snap.num_cached_tokens, int(snap.nbytes), kv_from, exact,
                            tuple((first + i, blk.nbytes) for i, blk in enumerate(blocks)))
        self._parked[point.key] = snap
        for i, blk in enumerate(blocks):
            self._parked[point.block_key(first + i)] = blk
        result.parked.append(point)

    def _decode(self, plan: StepPlan) -> Iterator[StepOutput]:
        """The plan's decode steps, each step's output as it completes (a hook: `actors.faults`
        dies part-way)."""
        return self.engine.decode_steps(plan.decode_steps)

    def _resume(self, plan: StepPlan, snapshots: tuple, result: StepResult, out: StepOutput) -> None:
        if len(plan.resume) != len(snapshots):
            raise ValueError(f"step plan names {len(plan.resume)} resumes but {len(snapshots)} snapshots came")
        for rid, snap in zip(plan.resume, snapshots):
            ok = self._restore_one(plan, rid, snap, result)
            if ok is False:
                out.not_admitted.append(rid)

    def _restore_one(self, plan: StepPlan, rid: str, snap: Snapshot | list, result: StepResult) -> bool | None:
        """Restore one snapshot into the pools: True, False (no room), or None (refused or lost:
        the reason is in `result.resume_failed`). A hook: `actors.faults` dies right after, or
        drops the state."""
        return result.record_restore(rid, lambda: self.engine.restore(_fetch(snap), rid), SnapshotError, SnapshotLost)

    def _result(self, result: StepResult, out: StepOutput, busy_s: float) -> StepResult:
        result.new_tokens, result.finished = out.new_tokens, out.finished
        result.stalled, result.not_admitted = out.stalled, out.not_admitted
        result.allocated = {rid: self.engine.pool.kv.num_request_tokens(rid) for rid in self.running_ids()}
        result.usage = self.usage()
        result.busy_s = busy_s
        return result

    # ------------------------------------------------------------------ cost model inputs
    def _measure_speeds(self) -> tuple[float, float]:
        """(bytes/s of a plain copy, prefill tokens/s) on this device, measured once."""
        if self._speeds is None:
            self._speeds = (_copy_speed(self.engine.device), _prefill_speed(self.engine))
        return self._speeds


class SnapshotLost(Exception):
    """The snapshot's object could not be read (its node died, or its retraction failed)."""


def _fetch(snap: Snapshot | list) -> Snapshot:
    """A snapshot passed by value, or `[ref]` (a nested ref Ray does not resolve): read it here,
    from the node where it lies, turning a lost object into `SnapshotLost`."""
    return _fetch_all(snap)[-1]


def _fetch_all(arg: Snapshot | list) -> list:
    """`_fetch` for a list of objects and refs (a point's blocks, then the point): all of them,
    read in one `ray.get`."""
    items = [arg] if isinstance(arg, (Snapshot, KVBlock)) else list(arg)
    refs = [i for i in items if isinstance(i, ray.ObjectRef)]
    try:
        got = iter(ray.get(refs)) if refs else iter(())
    except (ray.exceptions.RayError, OSError) as err:
        raise SnapshotLost(type(err).__name__) from None
    return [next(got) if isinstance(i, ray.ObjectRef) else i for i in items]


def _exact_blocks(seq: Sequence, block_tokens: int) -> int:
    """Leading blocks of a request's history whose K/V is an uncached chunked prefill's: every
    whole block of the prompt for an exact request, else the blocks it was restored with."""
    if not block_tokens:
        return 0
    return seq.prompt_len // block_tokens if seq.exact else seq.parked_blocks


def _stops(plan: StepPlan) -> dict[str, tuple[int, ...]]:
    """`plan.park_at` by request: the token counts where each one's prefill pauses to park."""
    stops: dict[str, tuple[int, ...]] = {}
    for rid, at in plan.park_at:
        stops[rid] = stops.get(rid, ()) + (at,)
    return stops


def _sequence(item: PrefillItem) -> Sequence:
    return Sequence(item.request_id, list(item.token_ids), item.prompt_len,
                    SamplingParams.from_dict(item.sampling))


def _node_id() -> str:
    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # not inside Ray (direct use, tests)
        return "local"


def _copy_speed(device: torch.device, nbytes: int = 32 << 20) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - t0)


def _prefill_speed(engine: Engine, num_tokens: int = 256) -> float:
    if not engine.can_prefill(num_tokens):
        num_tokens = max(2, engine.usage().kv_free_tokens // 2)
    seq = Sequence("__speed__", [1] * num_tokens, num_tokens, SamplingParams(max_new_tokens=2))
    t0 = time.perf_counter()
    engine.prefill([seq])
    elapsed = time.perf_counter() - t0
    if "__speed__" in engine.running:
        engine.release("__speed__")
    return num_tokens / elapsed
