"""The explicit input of one model forward: which tokens, where their state lives.

The engine builds a `ForwardBatch` from its requests and the pool's tables; the model reads and
writes pool tensors only at the slots named here. Nothing is global.

Two kinds:
- prefill: a ragged batch of the next `seq_lens[i]` tokens of each sequence, concatenated without
  padding (padding would corrupt the SSM state). Without `kv_slots` every sequence starts from
  zero state. With `kv_slots`, `kv_slots[i]` (S_i + L_i,) lists the token slots of sequence i
  so far, the new ones last: its S_i earlier tokens (chunked prefill, a restored prefix) already
  have K/V there and their conv/SSM state at `mamba_slots[i]`, and positions continue from S_i.
  The new tokens' K/V are written to `out_slots`, the final conv/SSM state to `mamba_slots[i]`.
- decode: one new token per request. Its K/V is written to `out_slots[i]`, attention reads
  `kv_slots[i]` (all of the request's token slots, the new one last) through `kv_table` (the
  same slots cut into fixed-size chunks, for attention over the whole batch in one call), and
  the conv/SSM state at `mamba_slots[i]` is read and updated in place. A padded decode batch
  (`actors.graph`: a fixed shape, for CUDA graphs) has more rows than requests; its padding rows
  point at the pool's scratch slots and their results are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable

import numpy as np
import torch


KV_CHUNK = 32  # tokens per chunk of decode attention (a fixed reduction length per chunk)
NEG_SCORE = -1.0e30  # score of a masked key: finite, so a chunk with no valid key stays finite


@dataclass
class KVTable:
    """A decode batch's token slots cut into chunks of `KV_CHUNK`, for attention over the whole
    batch in one call (`actors.attention.chunked_decode_attention`).

    slots (J, C) int64: token slots of chunk j (masked positions hold slot 0, never read as
    keys); valid (J, C) bool; owner (J,) int64: the batch row whose query chunk j serves;
    grid (R, K) int64: row r's k-th chunk, in order (rows with fewer than K chunks point at a
    chunk with no valid key, which the combine step leaves out exactly). Only a row's own chunk
    count decides its arithmetic, so its result does not depend on the other rows or on K.
    A compact table on the CPU also keeps every request's slots unchunked: flat (sum L_i,)
    int64, request r's at flat[starts[r]:starts[r + 1]], starts (R + 1,) int64 (for
    `actors.rowdot.decode_attention`, which reads the pool by slot; None otherwise).
    """

    slots: torch.Tensor
    valid: torch.Tensor
    owner: torch.Tensor
    grid: torch.Tensor
    flat: torch.Tensor | None = None
    starts: torch.Tensor | None = None

    @staticmethod
    def build(kv_slots: list[torch.Tensor], chunk: int = KV_CHUNK,
              shape: tuple[int, int] | None = None) -> "KVTable":
        """From each request's token slots (L_i,) (CPU tensors; the table is on the CPU too).

        Compact (`shape` None): ceil(L_i / C) chunks per request, in request order, then one
        empty chunk that shorter rows' grid entries point at. Padded (`shape` = (rows, chunks),
        a fixed shape for CUDA graphs): row r's chunks at r * chunks + k, the unused ones empty;
        rows past the requests are empty too.
        """
        # numpy: a decode step builds one table, and ~40 small torch ops cost more than the step's
        # attention at batch 1 (the same integers either way)
        R = len(kv_slots)
        lengths = np.array([t.shape[0] for t in kv_slots], dtype=np.int64)  # (R,)
        needed = (lengths + chunk - 1) // chunk  # (R,) chunks each request fills
        if shape is None:
            K = int(needed.max()) if R else 1
            lengths, per_row = np.append(lengths, 0), np.append(needed, 1)  # the empty chunk: a row of 0
        else:
            rows, K = shape
            if R > rows or (R and int(needed.max()) > K):
                raise ValueError(f"KVTable: {R} requests of up to {int(needed.max()) if R else 0} "
                                 f"chunks of {chunk} do not fit {rows} rows x {K} chunks")
            lengths = np.concatenate([lengths, np.zeros(rows - R, dtype=np.int64)])  # (rows,)
            per_row = np.full(rows, K, dtype=np.int64)
        starts = np.cumsum(per_row) - per_row  # first chunk of each row
        row_of = np.repeat(np.arange(per_row.shape[0]), per_row)  # (J,)
        token = (np.arange(row_of.shape[0]) - starts[row_of])[:, None] * chunk \
            + np.arange(chunk)[None, :]  # (J, C): index of the token within its request
        valid = token < lengths[row_of][:, None]  # (J, C)
        flat = torch.cat(kv_slots).numpy() if R else np.zeros(1, dtype=np.int64)  # (sum L_i,)
        offsets = np.cumsum(lengths) - lengths
        src = np.minimum(offsets[row_of][:, None] + token, max(flat.shape[0] - 1, 0))
        slots = np.where(valid, flat[src], 0)  # (J, C)
        k = np.arange(K)[None, :]  # (1, K)
        grid = starts[:, None] + k  # (rows, K)
        if shape is None:  # a request's chunks past its own count: the empty chunk
            grid = np.where(k < needed[:, None], grid[:R], int(starts[-1]))
        owner = np.minimum(row_of, max(R - 1, 0)) if shape is None else row_of
        table = KVTable(*(torch.from_numpy(np.ascontiguousarray(t, dtype=d)) for t, d in
                          ((slots, np.int64), (valid, np.bool_), (owner, np.int64), (grid, np.int64))))
        if shape is not None:
            return table
        row_starts = np.concatenate([offsets[:R], [flat.shape[0] if R else 0]])  # (R + 1,)
        return replace(table, flat=torch.from_numpy(flat[:row_starts[-1]].astype(np.int64)),
                       starts=torch.from_numpy(row_starts.astype(np.int64)))

    def to(self, device: torch.device) -> "KVTable":
        """The table on `device` (the unchunked slots stay only on the CPU)."""
        if torch.device(device).type == "cpu":
            return self
        return KVTable(*(t.to(device, non_blocking=True) for t in
                         (self.slots, self.valid, self.owner, self.grid)))


def _append(t: torch.Tensor, value: int) -> torch.Tensor:
    """t (n,) with `value` appended."""
    return torch.cat([t, t.new_full((1,), value)])


@dataclass(frozen=True)
class Segment:
    """One sequence of a prefill forward: its rows among the forward's concatenated tokens.

    Its `rows` (L of them) are the sequence's next L tokens, after `start` earlier ones whose
    state is in the pool (conv/SSM state at `mamba_slot`; K/V at the first `start` entries of
    `context_slots`, (start + L,), the new tokens' slots last; None for a fresh sequence).
    With a `trail` list, every scan over its rows (conv, SSD, delta rule) appends its `Marks`
    there (the states at its chunk starts, which it computes anyway), layer by layer in model
    order, each layer's in its kind's state order (`actors.layers.KindSpec.state`).
    """

    rows: slice
    mamba_slot: int
    start: int = 0
    context_slots: torch.Tensor | None = None
    trail: list | None = None


@dataclass
class ForwardBatch:
    is_prefill: bool
    input_ids: torch.Tensor  # (T,) int64: prefill T = sum(seq_lens), decode T = B
    positions: torch.Tensor  # (T,) int64: position of each token in its sequence
    seq_lens: list[int]  # (B,) new tokens per sequence; all 1 for decode
    out_slots: torch.Tensor  # (T,) int64: KV token slot receiving each token's K/V
    mamba_slots: torch.Tensor  # (B,) int64: Mamba pool slot of each sequence
    kv_slots: list[torch.Tensor] | None = None  # (S_i + L_i,) int64 token slots per sequence
    table: KVTable | None = None  # decode: kv_slots in chunks (built from kv_slots when None)
    trails: list[list | None] | None = None  # prefill: per sequence, a list its scans' `Marks`
    #   go to (`Segment.trail`), or None: keep nothing

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def segments(self) -> list[Segment]:
        """A prefill batch's sequences (built once per batch, shared by every layer)."""
        mamba = self.mamba_slots.tolist()
        context = self.kv_slots or [None] * self.batch_size
        trails = self.trails or [None] * self.batch_size
        out, at = [], 0
        for n, slot, ctx, trail in zip(self.seq_lens, mamba, context, trails):
            out.append(Segment(slice(at, at + n), slot, 0 if ctx is None else ctx.shape[0] - n, ctx, trail))
            at += n
        return out

    @cached_property
    def mamba_run(self) -> tuple[int, int] | None:
        """(start, count) when a decode batch's Mamba slots are one ascending run on the CPU
        (every layer then updates the pool's rows in place), else None; found once per batch."""
        if self.mamba_slots.device.type != "cpu":
            return None
        return contiguous_run(self.mamba_slots)

    @cached_property
    def kv_table(self) -> KVTable:
        """The decode batch's token slots in chunks: built once per batch, shared by all
        attention layers (one gather each)."""
        if self.table is not None:
            return self.table
        assert self.kv_slots is not None
        device = self.input_ids.device
        return KVTable.build([t.cpu() for t in self.kv_slots]).to(device)


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence results of a prefill forward back in one tensor, in order (no copy for one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


ROW_BLOCK = 256  # rows an elementwise chain of a prefill runs at a time, so its temporaries stay in cache


def by_row_blocks(fn: Callable[[slice], torch.Tensor], rows_of: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """fn(rows) -> that block's result (rows, ...), for all rows of `rows_of`: one call where
    they fit one block (a decode step) or live on a GPU, else block by block into `out` (made
    from the first block when None; it may be an input whose rows fn has read by the time they
    are written, or that fn wrote its block into: then nothing is copied).

    For chains of elementwise steps and per-row reductions, whose rows do not depend on the
    other rows: on the CPU, blocks keep a long prefill's temporaries in cache and give the same
    bits (a GPU gains nothing from them and would pay a launch per block)."""
    n = rows_of.shape[0]
    if n <= ROW_BLOCK or rows_of.device.type != "cpu":
        return fn(slice(0, n))
    for start in range(0, n, ROW_BLOCK):
        rows = slice(start, min(n, start + ROW_BLOCK))
        part = fn(rows)
        if out is None:
            out = part.new_empty((n, *part.shape[1:]))
        dst = out[rows]
        if part.data_ptr() != dst.data_ptr() or part.stride() != dst.stride():
            dst.copy_(part)
    return out


def contiguous_run(slots: torch.Tensor) -> tuple[int, int] | None:
    """(start, length) when the CPU tensor `slots` is start, start+1, ...; None otherwise."""
    n = int(slots.numel())
    if n == 0:
        return (0, 0)
    start = int(slots[0])
    if int(slots[-1]) - start + 1 != n or not bool((slots.diff() == 1).all()):
        return None
    return start, n
