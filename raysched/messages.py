"""The small messages between the scheduler and a worker: a step plan in, tokens and counts out.

Only ids, token ids and integers cross the wire every step; snapshots travel as Ray object refs
passed as extra arguments of `Worker.step`, in the order of `StepPlan.resume`, each wrapped in a
one-element list so that the worker reads it itself (from the node where it lies, zero-copy on
the same node) and a lost one fails only its own resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GRID_TOKENS = 32  # the grid of exact prefix points a worker reports unless it says another
#   (`WorkerInfo.prefix_grid`; the CPU's, `actors.engine.prefix_grid`)

SNAPSHOT_LOST = "snapshot lost"  # prefix of a `StepResult.resume_failed` reason: recompute, no blame


@dataclass(frozen=True)
class PrefillItem:
    """A request to prefill: a new one, or one resumed by recompute (history includes outputs)."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt + tokens generated so far
    prompt_len: int
    sampling: dict  # SamplingParams.to_dict()
    sink: Any = None  # the reader's `raysched.sink.TokenSink` handle: the worker sends it each
    #   step's tokens of this request directly (None: the tokens go in the call's reply only)


@dataclass(frozen=True)
class StepPlan:
    """What one worker does in one call, in this order: drop, resume, prefill, decode.

    The prefill starts the new requests in `prefill`, then continues those the worker is still
    prefilling (prompts longer than earlier calls' chunks), oldest first, each by one chunk,
    until `prefill_budget_tokens` are fed; decode runs the others.
    """

    drop: tuple[str, ...] = ()  # free without snapshot (abort, retract-by-recompute)
    resume: tuple[str, ...] = ()  # restore from the snapshots passed alongside, same order
    prefill: tuple[PrefillItem, ...] = ()
    decode_steps: int = 0
    prefix: tuple[str, ...] = ()  # prefill items that start from a parked state (turn cache),
    #   passed after the resume snapshots, same order; the worker prefills only the rest
    park_min_tokens: int = 0  # > 0: copy the state of requests covering at least this many
    #   tokens at their prefill chunk boundaries and branch points, and (`park_turns`) at their
    #   prompt point (the last grid point before its end) and when they finish (`Worker.take_parked`)
    park_turns: bool = True  # with park_min_tokens: the prompt and finished-turn points too
    park_at: tuple[tuple[str, int], ...] = ()  # (request id, tokens): that request's prefill
    #   pauses after this many prompt tokens (a branch point: a multiple of the scan grid that
    #   another prompt shares) and parks an exact point there, then goes on in the same call; a
    #   point its prefill already passed is parked from the states kept by `trail_calls`
    trail_calls: int = 0  # > 0: keep the scan-grid states of this many recent prefill calls
    #   (`Engine.state_at`) for such late branch points
    fault: FaultPoint | None = None  # fault injection only: die inside this call
    prefill_chunk_tokens: int = 0  # each prefilling request (new or continued) advances by at
    #   most this many tokens in this call; 0 = to the end of its prompt
    prefill_budget_tokens: int = 0  # most prompt tokens this call feeds, in whole chunks (at
    #   least one request advances); 0 = every prefilling request advances
    call_id: int = 0  # > 0: `Worker.interrupt(call_id)` ends this call's decoding after the step
    #   under way (the scheduler needs a decision); its reply then covers the steps that ran
    end_at_finish: bool = False  # end the decoding after a step in which a request finished (a
    #   long call: its client hears at once, and its room is the scheduler's to give)
    joins: bool = False  # a long call that takes `Worker.join(call_id, items)` before each decode
    #   step: new requests start inside it (`StepResult.joined`), where it would otherwise be
    #   interrupted for them; items it did not take by its end come back in `not_admitted`
    notices: Any = None  # a long call that takes joins and replies once: instead of ending at a
    #   finish (`end_at_finish`), it goes on and the worker tells this handle at once
    #   (`Scheduler.call_finished(worker, notice_id, {id: (why, its tokens of this call)})`):
    #   the finished request's room then takes joins, and the call's other streams see no gap
    notice_id: int = 0  # names this call in its notices (unique per scheduler: a stale one is dropped)

    sinks: tuple[tuple[str, Any, int], ...] = ()  # (request id, its reader's sink, tokens it
    #   has generated so far) for requests not started by a `PrefillItem` that carries its sink:
    #   resumed from a snapshot, or read from now on (`Scheduler.attach_sink`)

    def is_empty(self) -> bool:
        return not (self.drop or self.resume or self.prefill or self.decode_steps)

    def interrupted_by(self, call_id: int) -> bool:
        """Does an interrupt for `call_id` (`Worker.interrupt`) end this call's decoding?"""
        return bool(self.call_id) and call_id == self.call_id


@dataclass(frozen=True)
class FaultPoint:
    """Fault injection (the `faults:` config): where the worker process dies inside the call that
    carries it, as if it crashed there (`os._exit`, no clean-up, no reply), or what it breaks.
    Only the worker class `actors.faults.with_faults` derives acts on it.

    kill_in_step: after `after_decode_steps` decode steps of the step call (or after all of
    them, if the call runs fewer); kill_in_join: in the step call, right after it fed a chunk of
    a prompt that joined it while the rest of that prompt is still to be fed; kill_in_restore:
    in the step call, right after restoring its
    first snapshot into the pools; kill_in_retract: in the retract call, after the gather (the
    slots are freed, the snapshot built), before the snapshot is returned; corrupt_snapshot (a
    retract call): one payload byte of the snapshot is flipped after its checksum was taken.
    kill_migration_source / kill_migration_dest (a migration call): the worker dies in it, after
    its copy and before its reply; refuse_migration (a reservation): refused as if full.
    """

    kind: str  # kill_in_step | kill_in_join | kill_in_restore | kill_in_retract | corrupt_snapshot | kill_migration_*
    after_decode_steps: int = 0


@dataclass(frozen=True)
class Usage:
    """A worker's pool: free/total KV tokens and recurrent-state slots; what the scheduler plans with
    (`actors.pools.HybridPool.usage` fills it)."""

    kv_free_tokens: int
    kv_total_tokens: int
    state_free_slots: int
    state_total_slots: int
    page_size: int


FinishNotice = Callable[[int, int, dict], None]  # (worker, `StepPlan.notice_id`, {id: (why, its tokens of
#   the call)}): where a long call's finish notice goes (`Scheduler.call_finished`, a host's replies)
NOTICE_SEQ = -1  # the sequence number of a simulated host's reply that is a finish notice, not a
#   step call's (`SimHost.collect` brings both; `raysched.workers.HostChannel` routes it)


@dataclass(frozen=True)
class StepTokens:
    """A step call's tokens so far, sent ahead of its `StepResult` (`Worker.step_stream`): the
    first token of each prefill that completed, then each decode step's tokens, as that step
    completes. The `StepResult` that ends the call still lists all of them."""

    new_tokens: dict[str, list[int]]
    finished: dict[str, str] = field(default_factory=dict)  # id -> why, for those that ended here


@dataclass
class StepResult:
    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)  # id -> "length" | "stop"
    stalled: list[str] = field(default_factory=list)  # could not get KV room for the next token
    not_admitted: list[str] = field(default_factory=list)  # prefill or resume did not fit
    resume_failed: dict[str, str] = field(default_factory=dict)  # id -> why the snapshot was refused
    allocated: dict[str, int] = field(default_factory=dict)  # id -> KV tokens held, running ones
    usage: Usage | None = None
    busy_s: float = 0.0  # time the worker spent computing this call
    cached: dict[str, int] = field(default_factory=dict)  # id -> prompt tokens restored, not prefilled
    prefix_failed: dict[str, str] = field(default_factory=dict)  # id -> why its parked state was not
    #   used (lost, refused): it was prefilled in full instead
    parked: list[ParkedPoint] = field(default_factory=list)  # points copied this call, waiting
    #   for `Worker.take_parked` (or `discard_parked`)
    joined: list[str] = field(default_factory=list)  # ids started by `Worker.join` in this call

    def record_restore(self, request_id: str, restore: Callable[[], bool], refused: type[Exception],
                       lost: type[Exception]) -> bool | None:
        """Run one snapshot `restore`: its answer (True, or False: no room), or None when it raised
        `refused` (the snapshot is refused) or `lost` (unreadable), with the reason recorded in
        `resume_failed` (a lost one with the SNAPSHOT_LOST prefix: recompute, no blame)."""
        try:
            return restore()
        except refused as err:
            self.resume_failed[request_id] = str(err)
        except lost as err:
            self.resume_failed[request_id] = f"{SNAPSHOT_LOST}: {err}"
        return None


@dataclass(frozen=True)
class ParkedPoint:
    """A restorable point a worker copied in a call (prefix reuse, `raysched.state_cache`): the
    state after `num_tokens` tokens of the request's history with the K/V of its tokens from
    `kv_from` on, kept under `key`, and the K/V blocks before `kv_from` it offers, kept under
    `block_key(i)` (blocks the worker copied for it; the others were offered before)."""

    request_id: str
    kind: str  # "chunk" (a prefill chunk boundary) | "prompt" (a prompt's end) | "finished"
    num_tokens: int
    nbytes: int
    kv_from: int = 0
    exact: bool = False  # the state of an uncached chunked prefill at a chunk boundary
    blocks: tuple[tuple[int, int], ...] = ()  # (block index, bytes) of the blocks offered with it

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.request_id, self.kind, self.num_tokens)

    def block_key(self, index: int) -> tuple[str, str, int]:
        return (self.request_id, "block", index)


@dataclass(frozen=True)
class WorkerInfo:
    index: int
    node_id: str
    device: str
    fingerprint: str
    vocab_size: int
    max_context: int
    usage: Usage
    kv_bytes_per_token: int
    state_bytes_per_slot: int
    copy_bytes_per_s: float = 0.0  # measured at start-up (for the auto retract mode)
    prefill_tokens_per_s: float = 0.0
    kernel: str = ""  # the kernels that decide its bits ("rowdot avx2+fma; mkl <GEMM fingerprint>; aten
    #   AVX2", "cuda"): a request moved between workers that differ here continues up to rounding only
    joins: bool = False  # takes `join` into a long call (`StepPlan.joins`; both workers of this repository do)
    prefix_grid: int = GRID_TOKENS  # its prefill pauses and resumes exactly on multiples of this many tokens
    #   (`actors.engine.prefix_grid`): where branch points may be parked (`StepPlan.park_at`)
