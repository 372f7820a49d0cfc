"""Continuous batching on one device: ragged prefill, batched decode, snapshot and restore.

The engine owns one model and one `HybridPool`. It never decides *what* to run: callers (the
`generate` loop below, or the worker actor following the scheduler's plan) choose which requests
to prefill, how many decode steps to take, and whom to retract. Per request it keeps only the
token history and the sampling parameters; all other state is in the pool.

Batch invariance: a request's logits do not depend on which requests share its prefill or decode
forward (row-free or fixed-shape matrix products, row-wise elementwise functions, attention per
request in fixed-size KV chunks; see `actors.model`), so a request restored anywhere continues
bit-exactly. The decode batch is ordered by Mamba slot only so that the SSM state can be updated
in place when the slots form one run; the order changes no result. With `fixed_decode`
(`actors.graph`, the CUDA default) a decode step runs at a padded bucket shape under a CUDA
graph, with the same bits.

Request states:
- prefilling (`Engine.prefilling`): admitted, slots held for the whole of `token_ids`, the state of
  its first `num_computed` tokens in the pool; a later `prefill` call continues it (chunked
  prefill, or the suffix after `restore_prefix`).
- running (`Engine.running`, decoding): the pool holds K/V and Mamba state for all tokens but the
  last one (`Sequence.num_cached`, the one definition of that count); the next decode step feeds
  that last token.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from actors.batch import ForwardBatch, KVTable
from actors.attention import PREFILL_TILE
from actors.graph import FixedShapeDecode
from actors.mamba import scan_chunk
from actors.config import ModelConfig
from actors.pools import HybridPool
from actors.sampler import sample
from actors.snapshot import (KVBlock, Snapshot, SnapshotError, check_block, check_block_payload, check_compatible,
                             check_history, checksum,
                             decode_cached, gather_block, gather_state, model_fingerprint, part_specs,
                             scatter_block, scatter_state)
from raysched.config import PoolConfig
from raysched.messages import Usage
from raysched.sampling import SamplingParams


@dataclass
class Sequence:
    """One request as the engine sees it."""

    request_id: str
    token_ids: list[int]  # prompt + generated
    prompt_len: int
    sampling: SamplingParams
    finish_reason: str | None = None  # "length" | "stop"
    num_computed: int = 0  # tokens of token_ids whose K/V + conv + SSM state is in the pool
    exact: bool = True  # its state is that of an uncached prefill chunked from token 0 (false
    #   after a restore from a state that was not: a finished turn, an unaligned prompt end)
    parked_blocks: int = 0  # leading K/V blocks of its history already parked (prefix reuse)
    stops: tuple[int, ...] = ()  # token counts where its prefill pauses (`StepPlan.park_at`):
    #   a chunk that crosses one ends there, so a point can be parked at it (prefix reuse)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_cached(self) -> int:
        """Tokens whose state a decoding request holds: all but the last (not fed yet)."""
        return decode_cached(len(self.token_ids))

    @property
    def num_uncomputed(self) -> int:
        """Tokens a prefill still has to feed (at least the last one)."""
        return len(self.token_ids) - self.num_computed

    @property
    def num_unprefilled(self) -> int:
        """Prompt tokens a chunked prefill still feeds. A recompute's generated tokens are not
        among them: they are replayed through decode steps (`Engine._replay`)."""
        return max(0, self.prompt_len - self.num_computed)


@dataclass
class StepOutput:
    """What one engine call produced: new tokens per request, who finished, who could not run."""

    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)  # request id -> finish reason
    stalled: list[str] = field(default_factory=list)  # no KV room for the next token
    not_admitted: list[str] = field(default_factory=list)  # prefill did not fit

    def merge(self, other: "StepOutput") -> None:
        for rid, toks in other.new_tokens.items():
            self.new_tokens.setdefault(rid, []).extend(toks)
        self.finished.update(other.finished)
        self.stalled.extend(other.stalled)
        self.not_admitted.extend(other.not_admitted)


def prefix_grid(config: ModelConfig, device: torch.device) -> int:
    """The token grid on which this engine's prefill may pause and resume with the bits of an
    uncached run: a multiple of each position-dependent blocking of its layers (attention's
    query tiles, the SSD scan's chunks, the delta rule's chunks). Parked prefix points (branch
    points) must lie on it; the scheduler uses the grid every worker shares."""
    kinds = set(config.layer_types)
    sizes = [PREFILL_TILE] if "attention" in kinds else []
    if "mamba" in kinds:
        sizes.append(scan_chunk(config.mamba_chunk_size, device))
    if "gdn" in kinds:
        sizes.append(scan_chunk(config.linear_chunk_size, device))
    return math.lcm(*sizes) if sizes else 1


class Engine:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, pool: HybridPool,
                 weights_fingerprint: str, record_logits: bool = False,
                 fixed_decode: "FixedShapeDecode | None" = None) -> None:
        self.model, self.config, self.pool = model, config, pool
        self.fixed_decode = fixed_decode  # decode at bucket shapes (CUDA graphs); None: eager
        self.dtype, self.device = pool.k.dtype, pool.k.device
        self.fingerprint = model_fingerprint(config, weights_fingerprint, self.dtype)
        self.prefix_grid = prefix_grid(config, self.device)
        self.running: dict[str, Sequence] = {}  # decoding
        self.prefilling: dict[str, Sequence] = {}  # admitted, prompt partly computed
        self.hold_finished = False  # True: finished requests keep their slots (in `held`) until
        self.held: dict[str, Sequence] = {}  # `release`, so their final state can be copied
        self.reserved: dict[str, list[tuple[int, int, int]]] = {}  # live migration in: slots held
        #   for a request not running here yet, and (start, end, history hash) per block received
        self.record_logits = record_logits
        self.logits: dict[str, list[torch.Tensor]] = {}  # filled only when record_logits
        self.trail_calls = 0  # > 0: keep the scan states of the last this many prefill calls
        self.trail_min_tokens = 0  # (of exact sequences with prompts this long) for `state_at`
        self._trails: deque[dict[str, Trail]] = deque()
        self._trail_parts = _trail_parts(config)

    # ------------------------------------------------------------------ capacity
    def usage(self) -> Usage:
        return self.pool.usage()

    def can_prefill(self, num_tokens: int) -> bool:
        return self.pool.can_admit(num_tokens)

    def sequence(self, request_id: str) -> Sequence | None:
        """The request holding slots here under this id (decoding, prefilling or held), if any."""
        return (self.running.get(request_id) or self.prefilling.get(request_id)
                or self.held.get(request_id))

    # ------------------------------------------------------------------ prefill
    def prefill(self, seqs: list[Sequence | str], chunk_tokens: int | None = None,
                budget_tokens: int | None = None) -> StepOutput:
        """Advance each sequence by up to `chunk_tokens` tokens (None: to its end), in one forward.

        Chunk boundaries are multiples of `chunk_tokens` from token 0: a sequence restored at
        any other point first advances to the next multiple, so every later chunk is the one an
        uncached run feeds. `budget_tokens` (None: no limit) caps the tokens this call feeds:
        sequences advance in the given order, each by its whole chunk, until the budget is spent
        (the first always advances); the rest are admitted but wait for a later call. A
        sequence's chunk boundaries therefore never depend on what else is prefilling. A chunk
        that crosses one of the sequence's `stops` ends there (the caller parks a point, then
        feeds the rest of the chunk with another call).

        An item is either a new `Sequence` (admitted here: a Mamba slot and KV slots for all of
        its `token_ids` are taken at once, so a started prefill never runs out of room; its
        `num_computed` must be 0), or the id (or the same `Sequence` object) of a request in
        `self.prefilling`, which continues from its `num_computed` tokens on top of the state in
        its slots. A sequence whose last prompt token is fed samples its next token (draw index
        `num_generated`) and moves to `running`; the others stay in `prefilling` for a later call.
        A history that already holds generated tokens (a recompute) prefills its prompt so, then
        replays its generated tokens one decode step each, as they were computed when sampled
        (`_replay`), and samples from the last: its bits are those of the uninterrupted run.
        New sequences that do not fit the pool are listed in `not_admitted`; nothing else changes.
        """
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
        if budget_tokens is not None and budget_tokens < 1:
            raise ValueError(f"budget_tokens must be >= 1 or None, got {budget_tokens}")
        out = StepOutput()
        admitted = [s for s in map(self._prefill_item, seqs) if self._admit(s, out)]
        active, counts, spent = [], [], 0
        for s in admitted:
            if budget_tokens is not None and active and spent >= budget_tokens:
                break
            n = _until_stop(s, s.num_unprefilled if chunk_tokens is None else min(
                chunk_tokens - s.num_computed % chunk_tokens, s.num_unprefilled))
            active.append(s)
            counts.append(n)
            spent += n
        fed = [i for i, n in enumerate(counts) if n]
        seqs_fed = [active[i] for i in fed]
        trails = self._trail_lists(seqs_fed)
        logits = self._forward(self._prefill_batch(seqs_fed, [counts[i] for i in fed], trails)) \
            if fed else None  # (len(fed), vocab)
        self._keep_trails(seqs_fed, trails)
        for s, n in zip(active, counts):
            s.num_computed += n
        self._finish_prefills(active, fed, logits, out)
        return out

    def _finish_prefills(self, active: list[Sequence], fed: list[int], logits: torch.Tensor | None,
                         out: StepOutput) -> None:
        """Move the sequences whose prompt is all fed to `running` and sample their next token:
        from the prefill's logits (rows in `fed` order), or, for a recompute, from the last step
        of replaying its generated tokens."""
        done = [s for s in active if s.num_unprefilled == 0]
        for s in done:
            self.running[s.request_id] = self.prefilling.pop(s.request_id)
        new = [s for s in done if s.num_computed == len(s.token_ids)]
        replayed = [s for s in done if s.num_computed < len(s.token_ids)]
        if new:
            row = {id(active[i]): r for r, i in enumerate(fed)}
            self._sample_and_append(new, logits[[row[id(s)] for s in new]], out)
        if replayed:
            self._sample_and_append(replayed, self._replay(replayed), out)

    def _replay(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's tokens after `num_computed` one decode step at a time, in batches
        of those still replaying (decode is row-free: a row's bits do not depend on the batch).
        A chunked prefill over generated tokens would not reproduce the decode steps that
        computed them (the scan and the attention reduce in another order), so a recompute
        that prefilled them would continue on other bits. -> the last step's logits (R, vocab)."""
        last: dict[str, torch.Tensor] = {}
        while left := [s for s in seqs if s.num_computed < len(s.token_ids)]:
            left.sort(key=lambda s: self.pool.mamba.slot(s.request_id))  # SSM state in place
            logits = self._feed_one(left, [s.num_computed for s in left])  # (R, vocab)
            for i, s in enumerate(left):
                s.num_computed += 1
                if s.num_computed == len(s.token_ids):
                    last[s.request_id] = logits[i]
        return torch.stack([last[s.request_id] for s in seqs])

    def _prefill_item(self, item: Sequence | str) -> Sequence:
        """The engine's own Sequence for a continued request, or a new one checked for admission."""
        rid = item if isinstance(item, str) else item.request_id
        if rid in self.running:
            raise ValueError(f"request {rid!r} is already running (decoding) on this engine")
        if rid in self.prefilling:
            if not isinstance(item, str) and item is not self.prefilling[rid]:
                raise ValueError(f"request {rid!r} is already prefilling on this engine; "
                                 "continue it by its id")
            return self.prefilling[rid]
        if isinstance(item, str):
            raise KeyError(f"request {rid!r} is not prefilling on this engine")
        if item.num_computed != 0 or not item.token_ids:
            raise ValueError(f"new request {rid!r} must have tokens and num_computed 0 "
                             f"(has {len(item.token_ids)} tokens, num_computed {item.num_computed})")
        return item

    def _admit(self, s: Sequence, out: StepOutput) -> bool:
        """True when `s` is (now) in `prefilling`; a new one takes slots for all its tokens."""
        if s.request_id in self.prefilling:
            return True
        if not self.pool.admit(s.request_id, len(s.token_ids)):
            out.not_admitted.append(s.request_id)
            return False
        self.prefilling[s.request_id] = s
        return True

    def _prefill_batch(self, seqs: list[Sequence], counts: list[int],
                       trails: list[list | None] | None = None) -> ForwardBatch:
        """The next counts[i] tokens of each sequence, after its num_computed ones."""
        spans = [(s.num_computed, s.num_computed + n) for s, n in zip(seqs, counts)]
        ids = torch.tensor([t for s, (a, b) in zip(seqs, spans) for t in s.token_ids[a:b]],
                           dtype=torch.int64)
        positions = torch.cat([torch.arange(a, b) for a, b in spans])
        slots = [self.pool.kv.token_slots(s.request_id) for s in seqs]
        out_slots = torch.cat([sl[a:b] for sl, (a, b) in zip(slots, spans)])
        context = [sl[:b] for sl, (_, b) in zip(slots, spans)]
        mamba = torch.tensor([self.pool.mamba.slot(s.request_id) for s in seqs], dtype=torch.int64)
        return self._to_device(ForwardBatch(True, ids, positions, counts, out_slots, mamba, context,
                                            trails=trails))

    # ------------------------------------------------------------------ kept scan states
    def _trail_lists(self, seqs: list[Sequence]) -> list[list | None] | None:
        """`ForwardBatch.trails` of a prefill call: a list for each exact sequence whose prompt
        has `trail_min_tokens` (its scans' `Marks` go there), None for the others."""
        if not (self.trail_calls and self._trail_parts and seqs):
            return None
        lists = [[] if s.exact and s.prompt_len >= self.trail_min_tokens else None for s in seqs]
        return lists if any(m is not None for m in lists) else None

    def _keep_trails(self, seqs: list[Sequence], trails: list[list | None] | None) -> None:
        """Keep this call's trails (before `num_computed` moves), dropping calls beyond
        `trail_calls`."""
        if trails is None:
            if not self.trail_calls:
                self._trails.clear()
            return
        self._trails.append({s.request_id: Trail(s, s.num_computed, m)
                             for s, m in zip(seqs, trails) if m is not None})
        while len(self._trails) > self.trail_calls:
            self._trails.popleft()

    def state_at(self, request_id: str, at: int) -> dict[str, torch.Tensor] | None:
        """The request's recurrent state after its first `at` tokens, {state tensor name:
        (layers, *shape)}, from the scans of one of its last `trail_calls` prefill calls that
        passed `at` on their grid; None when none did (or the request is gone). With the K/V
        of its first `at` tokens (still in its slots) it is the point a prefill paused at `at`
        would have parked."""
        t = self._trail_at(request_id, at)
        return self._stack_states([m.at(at - t.start) for m in t.marks]) if t is not None else None

    def last_state_before(self, request_id: str, end: int) -> int | None:
        """The largest `at` < `end` on `prefix_grid` whose state the request's latest kept
        prefill call holds (`state_at`); None when it holds none there, or no call of it was
        kept. (Its earlier calls end where that call started: a chunk boundary, or the point it
        was restored from.)"""
        t = next(self._kept_trails(request_id), None)
        if t is None:
            return None
        step = math.lcm(self.prefix_grid, *(m.every for m in t.marks))
        r = min(end - 1 - t.start, min(m.rows for m in t.marks) - 1) // step * step
        return t.start + r if r > 0 and all(m.has(r) for m in t.marks) else None

    def _trail_at(self, request_id: str, at: int) -> Trail | None:
        return next((t for t in self._kept_trails(request_id) if all(m.has(at - t.start) for m in t.marks)), None)

    def _kept_trails(self, request_id: str) -> Iterator[Trail]:
        """The request's kept prefill calls (of the sequence it is now), latest first."""
        seq = self.sequence(request_id)
        for calls in reversed(self._trails):
            t = calls.get(request_id)
            if t is not None and t.seq is seq and len(t.marks) == len(self._trail_parts):
                yield t

    def _stack_states(self, states: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        by_name: dict[str, list[torch.Tensor]] = {name: [] for name in self.pool.mamba.tensors}
        for name, state in zip(self._trail_parts, states):
            by_name[name].append(state)
        return {name: torch.stack(parts) if parts else self.pool.mamba.tensors[name][:, 0]
                for name, parts in by_name.items()}  # (layers, *shape); zero layers: (0, *shape)

    def copy_state_at(self, request_id: str, at: int, kv_from: int = 0) -> Snapshot | None:
        """An exact point of the request after its first `at` tokens, which a recent prefill
        call passed (`state_at`), with the K/V of its tokens from `kv_from` on; None: no call
        kept that state."""
        states = self.state_at(request_id, at)  # (kept for exact prefills only)
        return None if states is None else self._copy(self.sequence(request_id), at, kv_from, True, states)

    # ------------------------------------------------------------------ decode
    def decode(self, num_steps: int = 1) -> StepOutput:
        """Up to `num_steps` decode steps of every running request.

        Stops early when a request cannot get a KV slot for its next token (it is listed in
        `stalled`; the others still advance in that step) or when nothing is left running.
        """
        out = StepOutput()
        for step in self.decode_steps(num_steps):
            out.merge(step)
        return out

    def decode_steps(self, num_steps: int) -> Iterator[StepOutput]:
        """`decode`, one step at a time: each step's output as it completes."""
        for _ in range(num_steps):
            if not self.running:
                return
            step = self._decode_step()
            yield step
            if step.stalled:
                return

    def _decode_step(self) -> StepOutput:
        out = StepOutput()
        active = []
        for s in self.running.values():
            if self.pool.extend(s.request_id, len(s.token_ids)):
                active.append(s)
            else:
                out.stalled.append(s.request_id)
        if active:
            active.sort(key=lambda s: self.pool.mamba.slot(s.request_id))  # SSM state in place
            self._sample_and_append(active, self._decode_logits(active), out)
        return out

    def _decode_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """One decode forward of `seqs`: at a fixed bucket shape when `fixed_decode` has one
        (the same bits, see `actors.graph`), else eagerly at the batch's own shape. (R, vocab)."""
        return self._feed_one(seqs, [s.num_cached for s in seqs])

    def _feed_one(self, seqs: list[Sequence], positions: list[int]) -> torch.Tensor:
        """One decode forward feeding token `positions[i]` of each sequence on top of the state
        of the tokens before it. (R, vocab)."""
        kv_slots = [self.pool.kv.token_slots(s.request_id)[: p + 1] for s, p in zip(seqs, positions)]
        ids = [s.token_ids[p] for s, p in zip(seqs, positions)]
        mamba = [self.pool.mamba.slot(s.request_id) for s in seqs]
        if self.fixed_decode is not None:
            logits = self.fixed_decode(ids, positions, kv_slots, mamba)  # None: no bucket fits
            if logits is not None:
                return logits
        batch = ForwardBatch(False, torch.tensor(ids, dtype=torch.int64),
                             torch.tensor(positions, dtype=torch.int64), [1] * len(seqs),
                             torch.stack([slots[-1] for slots in kv_slots]),
                             torch.tensor(mamba, dtype=torch.int64), None, KVTable.build(kv_slots))
        return self._forward(self._to_device(batch))

    # ------------------------------------------------------------------ shared
    def _to_device(self, b: ForwardBatch) -> ForwardBatch:
        if self.device.type == "cpu":
            return b
        dev = self.device
        kv = [t.to(dev, non_blocking=True) for t in b.kv_slots] if b.kv_slots is not None else None
        table = b.table.to(dev) if b.table is not None else None
        return ForwardBatch(b.is_prefill, b.input_ids.to(dev), b.positions.to(dev), b.seq_lens,
                            b.out_slots.to(dev), b.mamba_slots.to(dev), kv, table, b.trails)

    @torch.inference_mode()
    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch, self.pool)  # (B, vocab) float32

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor, out: StepOutput) -> None:
        tokens = sample(logits, [s.sampling for s in seqs], [s.num_generated for s in seqs])
        for i, (s, tok) in enumerate(zip(seqs, tokens)):
            if self.record_logits:
                self.logits.setdefault(s.request_id, []).append(logits[i].detach().float().cpu())
            s.token_ids.append(tok)
            s.num_computed = s.num_cached
            out.new_tokens.setdefault(s.request_id, []).append(tok)
            reason = s.sampling.finish_reason(tok, s.num_generated)
            if reason:
                s.finish_reason = reason
                out.finished[s.request_id] = reason
                if self.hold_finished:
                    self.held[s.request_id] = self.running.pop(s.request_id)
                else:
                    self.release(s.request_id)

    # ------------------------------------------------------------------ retract / resume
    def release(self, request_id: str) -> Sequence:
        """Drop a request (running or prefilling) and free its slots (finish, abort, or
        retract-by-recompute)."""
        seq = (self.running.pop(request_id, None) or self.prefilling.pop(request_id, None)
               or self.held.pop(request_id, None))
        if seq is None:
            raise KeyError(f"request {request_id!r} is not running on this engine")
        self.pool.release(request_id)
        for calls in self._trails:  # its K/V slots are free now
            calls.pop(request_id, None)
        return seq

    def snapshot(self, request_id: str) -> Snapshot:
        """Take the request's complete state out of the pool and free its slots, in one step.

        A decoding request's snapshot covers all its tokens but the last. A prefilling one's
        covers the `num_computed` tokens fed so far (a chunk boundary: the state is exact there)
        and is marked `computed`; `restore` puts it back into `prefilling`, to go on from there.
        One with nothing computed yet raises SnapshotError (nothing changes): prefill it again.
        """
        seq = self.prefilling.get(request_id)
        if seq is not None and seq.num_computed == 0:
            raise SnapshotError(f"request {request_id!r}: nothing to snapshot before its prefill started "
                                f"(0 of {len(seq.token_ids)} tokens computed); prefill it again")
        snap = self.copy_state(request_id) if seq is None else self._copy(seq, seq.num_computed)
        self.release(request_id)
        return snap

    def copy_state(self, request_id: str, kv_from: int = 0, exact: bool = False) -> Snapshot:
        """A snapshot of a request's state (decoding, held finished, or prefilling: its
        `num_computed` tokens) with the K/V of its tokens from `kv_from` on (the earlier ones are
        parked in blocks); the request keeps its slots and goes on. Prefix reuse parks such
        copies as points (chunk boundary, branch point, prompt point, finished turn); `exact` marks the state of
        an uncached chunked prefill at a chunk boundary."""
        seq = self.running.get(request_id) or self.held.get(request_id)
        if seq is not None:
            return self._copy(seq, None, kv_from, exact)
        seq = self.prefilling.get(request_id)
        if seq is None or not seq.num_computed:
            raise KeyError(f"request {request_id!r} has no state on this engine")
        return self._copy(seq, seq.num_computed, kv_from, exact)

    def copy_blocks(self, request_id: str, first: int, last: int, block_tokens: int) -> list[KVBlock]:
        """The K/V of blocks first .. last - 1 (`block_tokens` each, from token 0) of a request
        whose state covers them, one `KVBlock` each."""
        seq = self.running.get(request_id) or self.held.get(request_id) or self.prefilling[request_id]
        ids = seq.token_ids
        return [gather_block(self.pool, request_id, i * block_tokens,
                             tuple(ids[i * block_tokens:(i + 1) * block_tokens]),
                             tuple(ids[:(i + 1) * block_tokens]), self.config, self.fingerprint)
                for i in range(first, last)]

    def copy_span(self, request_id: str, start: int, end: int) -> KVBlock:
        """The K/V of a decoding request's tokens [start, end) as one `KVBlock` (one gather, one
        checksum: a live-migration pre-copy stage)."""
        ids = self.running[request_id].token_ids
        return gather_block(self.pool, request_id, start, tuple(ids[start:end]), tuple(ids[:end]),
                            self.config, self.fingerprint)

    def _copy(self, seq: Sequence, computed: int | None, kv_from: int = 0, exact: bool | None = None,
              states: dict[str, torch.Tensor] | None = None) -> Snapshot:
        """Gather `seq`'s state: `computed` tokens of a prefilling request, or (None) all but
        the last of a decoding one; K/V from token `kv_from` on. `exact` (None: a mid-prefill
        state of an exact sequence, which is at a chunk boundary) travels with it. `states`:
        the recurrent state to take instead of the pool's (`state_at`)."""
        num_cached = seq.num_cached if computed is None else computed
        specs = part_specs(self.config, self.dtype, num_cached - kv_from)
        payload = gather_state(self.pool, seq.request_id, num_cached, specs, kv_from, states).numpy()
        exact = seq.exact and computed is not None if exact is None else exact
        return Snapshot(seq.request_id, self.fingerprint, tuple(seq.token_ids), seq.prompt_len,
                        seq.sampling.to_dict(), specs, checksum(payload), payload, computed=computed,
                        kv_from=kv_from, exact=exact)

    def check_snapshot(self, snap: Snapshot) -> None:
        """Raise SnapshotError if `snap` cannot be restored here (nothing changes)."""
        check_compatible(snap, self.config, self.dtype, self.fingerprint)

    def restore(self, snap: Snapshot, request_id: str | None = None) -> bool:
        """Put a snapshot into free slots of this pool; False (nothing changed) if it does not fit.

        Raises SnapshotError, before touching the pool, for another model, a wrong shape or
        dtype, or a bad checksum.
        """
        self.check_snapshot(snap)
        rid = request_id or snap.request_id
        self._check_new(rid)
        seq = Sequence(rid, list(snap.token_ids), snap.prompt_len, SamplingParams.from_dict(snap.sampling),
                       exact=snap.exact)
        if snap.kv_from:
            raise SnapshotError(f"snapshot of {snap.request_id!r} holds K/V from token {snap.kv_from} only; "
                                "restore it with its blocks (restore_prefix)")
        if snap.mid_prefill:  # back into `prefilling`: the next prefill goes on from `computed`
            return self._restore_prefilling(snap, seq)
        if not self.pool.admit(rid, snap.num_cached_tokens, zero_state=False):
            return False
        scatter_state(self.pool, rid, snap)
        seq.num_computed = seq.num_cached
        self.running[rid] = seq
        return True

    def restore_prefix(self, snap: Snapshot, seq: Sequence, blocks: tuple[KVBlock, ...] = ()) -> bool:
        """Start a NEW request `seq` from a point: a snapshot of its first
        `snap.num_cached_tokens` tokens whose K/V before `snap.kv_from` is in `blocks` (in order).

        `seq.token_ids` must extend those tokens by at least one. Slots for all of `seq`'s
        tokens are taken, the blocks' K/V and the snapshot's K/V, conv and SSM state are written
        into them, `seq.num_computed` is set to `snap.num_cached_tokens` and `seq` joins
        `prefilling`: the next `prefill([seq.request_id])` computes the rest. False (nothing
        changed) if the pool has no room for `seq`'s tokens. Raises SnapshotError, before
        touching the pool, for another model, a wrong shape or dtype, a bad checksum, tokens that
        do not match, or blocks that do not cover exactly the tokens before `kv_from`.
        """
        self.check_snapshot(snap)
        self._check_new(seq.request_id)
        n = snap.num_cached_tokens
        if len(seq.token_ids) <= n or tuple(seq.token_ids[:n]) != snap.token_ids[:n]:
            raise SnapshotError(f"request {seq.request_id!r}: its tokens do not extend the "
                                f"{n} cached tokens of snapshot {snap.request_id!r}")
        end = 0
        for block in blocks:
            check_block(block, seq.token_ids, self.config, self.dtype, self.fingerprint)
            if block.start != end:
                raise SnapshotError(f"K/V block at {block.start} does not follow the one ending at {end}")
            end = block.end
        if end != snap.kv_from:
            raise SnapshotError(f"K/V blocks cover {end} tokens, the point needs {snap.kv_from}")
        seq.exact, seq.parked_blocks = snap.exact, len(blocks)
        return self._restore_prefilling(snap, seq, blocks)

    def _restore_prefilling(self, snap: Snapshot, seq: Sequence, blocks: tuple[KVBlock, ...] = ()) -> bool:
        """Slots for all of `seq`'s tokens, the (checked) blocks' and snapshot's state written
        into its first ones, `seq` into `prefilling` with `num_computed` = the tokens covered."""
        n = snap.num_cached_tokens
        if not self.pool.admit(seq.request_id, len(seq.token_ids), zero_state=False):
            return False
        for block in blocks:
            scatter_block(self.pool, seq.request_id, block)
        scatter_state(self.pool, seq.request_id, snap)
        seq.num_computed = n
        self.prefilling[seq.request_id] = seq
        return True

    # ------------------------------------------------------------------ live migration (in)
    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Pre-allocate a state slot and room for `num_tokens` tokens for a request migrating in;
        False (nothing taken) if they do not fit. It runs here only after `commit`."""
        self._check_new(request_id)
        if request_id in self.reserved:
            raise SnapshotError(f"request {request_id!r} already has a reservation here")
        if not self.pool.admit(request_id, num_tokens, zero_state=False):
            return False
        self.reserved[request_id] = []
        return True

    def receive_blocks(self, request_id: str, blocks: tuple[KVBlock, ...]) -> bool:
        """Write pre-copied K/V blocks (each following the last one received) into the
        reservation, growing it as needed; False (the reservation kept as it was) if the pool
        has no room for them. Raises SnapshotError for a block of another model, a bad checksum,
        or one out of order."""
        marks = self.reserved[request_id]
        end = marks[-1][1] if marks else 0
        for block in blocks:
            check_block_payload(block, self.config, self.dtype, self.fingerprint)
            if block.start != end:
                raise SnapshotError(f"K/V block at {block.start} does not follow the one ending at {end}")
            end = block.end
        if blocks and not self.pool.extend(request_id, end):
            return False
        for block in blocks:
            scatter_block(self.pool, request_id, block)
            marks.append((block.start, block.end, block.history_hash))
        return True

    def commit(self, snap: Snapshot) -> bool:
        """The stop-and-copy: write the request's last K/V (from `snap.kv_from`; the blocks
        received cover the tokens before it) and its recurrent and sampling state into its
        reservation; it decodes here from now on. A snapshot with `kv_from` 0 (the snapshot-mode
        fallback) overwrites whatever blocks came. False (the reservation kept) if the pool has
        no room for its tokens. Raises SnapshotError, before writing, for a snapshot that does
        not fit its model, its blocks' history, or a request that is still prefilling."""
        rid = snap.request_id
        marks = self.reserved[rid]
        self.check_snapshot(snap)
        if snap.mid_prefill:
            raise SnapshotError(f"snapshot of {rid!r} is mid-prefill: only decoding requests migrate live")
        covered = marks[-1][1] if marks else 0
        if snap.kv_from not in (0, covered):
            raise SnapshotError(f"snapshot of {rid!r} holds K/V from token {snap.kv_from}; "
                                f"the blocks received cover {covered}")
        for start, end, hashed in marks if snap.kv_from else ():
            check_history(start, end, hashed, snap.token_ids)
        if not self.pool.extend(rid, snap.num_cached_tokens):
            return False
        scatter_state(self.pool, rid, snap)
        seq = Sequence(rid, list(snap.token_ids), snap.prompt_len, SamplingParams.from_dict(snap.sampling),
                       exact=snap.exact)
        seq.num_computed = seq.num_cached
        del self.reserved[rid]
        self.running[rid] = seq
        return True

    def unreserve(self, request_id: str) -> bool:
        """Free a reservation that will not be committed; False if there is none."""
        if self.reserved.pop(request_id, None) is None:
            return False
        self.pool.release(request_id)
        return True

    def _check_new(self, request_id: str) -> None:
        if request_id in self.running or request_id in self.prefilling or request_id in self.reserved:
            raise SnapshotError(f"request {request_id!r} is already running on this engine")

    # ------------------------------------------------------------------ reference loop
    def generate(self, prompts: list[list[int]], sampling: list[SamplingParams],
                 chunk_tokens: int | None = None) -> list[list[int]]:
        """Run requests to completion without ever retracting (the uninterrupted reference).

        Admits, in order, as many as fit with their whole budget (prompt + max_new_tokens), then
        decodes; new requests join as soon as room frees up (continuous batching). Prompts are
        prefilled in chunks of `chunk_tokens` (None: whole) before decoding resumes.
        """
        seqs = [Sequence(f"gen-{i}", list(p), len(p), sp) for i, (p, sp) in enumerate(zip(prompts, sampling))]
        pending = list(seqs)
        while pending or self.running:
            admit = self._admit_reserved(pending)
            if admit:
                self.prefill(admit, chunk_tokens)
                while self.prefilling:
                    self.prefill(list(self.prefilling), chunk_tokens)
            elif self.running:
                self.decode(1)
            else:
                raise RuntimeError(f"request {pending[0].request_id} needs more room than the pool has")
        return [s.token_ids[s.prompt_len:] for s in seqs]

    def _admit_reserved(self, pending: list[Sequence]) -> list[Sequence]:
        """Pop from `pending` the requests whose full budget fits next to the running ones'."""
        kv = self.pool.kv
        free_pages = kv.num_free_pages - sum(kv.pages_needed(s.request_id, _final_cached(s))
                                               for s in self.running.values())
        free_slots, chosen = self.pool.mamba.num_free_slots, []
        while pending and free_slots > 0 and kv.pages_needed("", _final_cached(pending[0])) <= free_pages:
            free_pages -= kv.pages_needed("", _final_cached(pending[0]))
            free_slots -= 1
            chosen.append(pending.pop(0))
        return chosen


@dataclass
class Trail:
    """A sequence's part of a prefill call whose scan states were kept (`Engine.state_at`)."""

    seq: Sequence
    start: int  # tokens it had computed before the call
    marks: list  # `actors.mamba.Marks`, one per `_trail_parts` entry, in that order


def _trail_parts(config: ModelConfig) -> list[str]:
    """The state tensor each of a prefill's scans fills, in the order they run (and append
    their `Marks` to `Segment.trail`): layer by layer, each recurrent layer's tensors in the
    order its kind lists them (conv first)."""
    tensors = config.state_tensors
    return [t.name for kind in config.layer_types for t in tensors if t.kind == kind]


def _until_stop(s: Sequence, n: int) -> int:
    """`n` tokens to feed, cut at the first of `s.stops` they would cross."""
    end = s.num_computed + n
    return min((p for p in s.stops if s.num_computed < p < end), default=end) - s.num_computed


def _final_cached(s: Sequence) -> int:
    """Tokens whose state a request holds when it finishes (its last token is never fed)."""
    return max(len(s.token_ids), decode_cached(s.prompt_len + s.sampling.max_new_tokens))


__all__ = ["Engine", "Sequence", "StepOutput", "SnapshotError"]


def resolve_device(spec: str) -> torch.device:
    """'auto' -> cuda when this process sees a GPU, else cpu; 'cuda' without a GPU is an error."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda was asked for, but torch sees no GPU in this process")
    return torch.device(spec)


def load_model(model: str | ModelConfig, dtype: torch.dtype, device: torch.device,
               seed: int = 0) -> tuple[torch.nn.Module, ModelConfig]:
    """A preset name, a checkpoint directory, or a `ModelConfig` (seeded random weights)."""
    from actors.loader import load_hf_state_dict
    from actors.model import HybridLM
    from actors.presets import PRESETS, init_state_dict, load_preset, resolve_model

    if isinstance(model, ModelConfig):
        net = HybridLM(model, dtype, device)
        load_hf_state_dict(net, init_state_dict(model, seed))
        return net, model
    if model in PRESETS:
        return load_preset(model, dtype, device, seed)
    return resolve_model(model, dtype, device)


def build_engine(model: str | ModelConfig, dtype: str = "float32", device: str = "auto",
                 kv_tokens: int = 512, state_slots: int = 8, page_size: int = 1,
                 pool_config: PoolConfig | None = None, invariant_tile: int = 16,
                 record_logits: bool = False, seed: int = 0,
                 fixed_shape_decode: bool | None = None) -> Engine:
    """An engine and its pool. `pool_config` (with an optional byte budget) overrides the counts.

    `fixed_shape_decode` (None: on CUDA, for models without routed experts, whose routing picks
    data-dependent shapes) decodes at padded bucket shapes, captured as CUDA graphs on a GPU
    (`actors.graph`); its pool gets scratch slots for the padding rows.

    >>> eng = build_engine("tiny", kv_tokens=256, state_slots=4)
    >>> len(eng.generate([[5, 17, 42]], [SamplingParams(max_new_tokens=4)])[0])
    4
    """
    from actors.loader import weights_fingerprint

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    dev = resolve_device(device)
    net, config = load_model(model, torch_dtype, dev, seed)
    net.invariant_tile = invariant_tile
    if pool_config is not None:
        itemsize = torch.empty(0, dtype=torch_dtype).element_size()
        sized = pool_config.resolve(max(1, config.kv_bytes_per_token(itemsize)),
                                    max(1, config.state_bytes_per_slot(itemsize)))
        kv_tokens, state_slots, page_size = sized.kv_tokens, sized.state_slots, sized.page_size
    fixed = fixed_shape_decode
    if fixed is None:
        fixed = dev.type == "cuda" and not config.has_experts
    pool = HybridPool(config, kv_tokens, state_slots, torch_dtype, dev, page_size, scratch=fixed)
    return Engine(net, config, pool, weights_fingerprint(net.state_dict()), record_logits,
                  FixedShapeDecode(net, pool) if fixed else None)
