"""Fixed-shape decode: the decode step at padded bucket shapes, replayed as a CUDA graph on a GPU.

A decode step of R requests, the longest of which attends over up to K chunks of `KV_CHUNK`
tokens, runs at the bucket (rows, chunks): the smallest of `ROW_BUCKETS` >= R and the smallest
power of two >= K. Each bucket owns persistent input buffers (token ids, positions, K/V slots,
state slots, key counts, the chunk table), so its step can be captured once as a CUDA graph and
replayed: one host-to-device copy of the packed inputs (from pinned memory), the replay, and
the logits. The only host sync of a step is the sampler fetching the logits. Every bucket the
pool can use is created (captured) when the engine starts (`ahead`), never inside a step.

Padding rows point at the pool's scratch slots (`HybridPool(scratch=True)`) and attend over no
key; their logits are dropped. Every kernel of the decode step is batch-invariant (tiled matrix
products, per-chunk attention, per-request SSM products; see `actors.model`), so a real row's
logits are bit-identical to the unpadded eager step's: tests/test_fixed_shape_decode.py holds
that on the CPU (where nothing is captured, the padded path runs eagerly) and
benchmarks/gpu_check.py on CUDA, against the eager step, graph replay included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from actors.batch import KV_CHUNK, ForwardBatch, KVTable
from actors.pools import HybridPool

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
MAX_TABLE_TOKENS = 1 << 18  # rows x chunks x C of a bucket's padded table (its K/V gather):
#   a bigger step (many rows, one long context) decodes eagerly, whose table is not padded


@dataclass
class _Bucket:
    """A bucket's persistent buffers, its graph (CUDA), and its output."""

    rows: int
    chunks: int
    host: Tensor  # (5 * rows + rows * chunks * C,) int64, pinned on CUDA: the packed inputs
    device_inputs: Tensor  # the same on the device
    owner: Tensor  # (rows * chunks,) constant
    grid: Tensor  # (rows, chunks) constant
    graph: "torch.cuda.CUDAGraph | None" = None
    logits: Tensor | None = None  # (rows, vocab), written by each run / replay


class FixedShapeDecode:
    """Runs `model`'s decode step on `pool` at bucket shapes (see the module doc).

    capture: record each bucket's step as a CUDA graph (default: on CUDA). Without it the
    padded step runs eagerly, which is what the CPU tests exercise.
    ahead: create (and capture) every bucket of `ladder()` now, so that no capture falls inside
    a request's first step, a migration's stop-and-copy or a resume (measured on an H200: a
    capture in the step after a stop-and-copy made the client's largest gap 69-332 ms, 27-47
    decode steps). False: each bucket is created on first use. `created` counts creations.
    """

    def __init__(self, model: torch.nn.Module, pool: HybridPool, capture: bool | None = None,
                 chunk: int = KV_CHUNK, ahead: bool = True) -> None:
        if not pool.has_scratch:
            raise ValueError("fixed-shape decode needs a pool with scratch slots (HybridPool(scratch=True))")
        self.model, self.pool, self.chunk = model, pool, chunk
        self.device = pool.k.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graph capture needs a CUDA pool")
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.created = 0  # buckets made so far (all of `ladder()` at start when `ahead`)
        self.steps: dict[tuple[int, int], int] = {}  # decode steps run per bucket
        if ahead:
            for rows, chunks in self.ladder():
                self._bucket(rows, chunks)

    def ladder(self) -> list[tuple[int, int]]:
        """Every (rows, chunks) bucket a decode step on this pool can take: up to its state
        slots in rows, its token slots in context. For rows 1 .. slots, chunks doubles until it
        covers the pool's tokens or the bucket passes `MAX_TABLE_TOKENS` (those steps decode
        eagerly). A pool of 256+ slots and 256k+ tokens has them all: 111 buckets (12 row
        sizes, with 14 chunk sizes at 1 row down to 6 at 256 rows)."""
        longest = self.pool.kv.num_pages * self.pool.kv.page_size
        shapes: set[tuple[int, int]] = set()
        for rows in range(1, min(self.pool.mamba.num_slots, ROW_BUCKETS[-1]) + 1):
            chunks = 1
            while (shape := self.bucket_for(rows, chunks * self.chunk)) is not None:
                shapes.add(shape)
                if chunks * self.chunk >= longest:
                    break
                chunks *= 2
        return sorted(shapes)

    def bucket_for(self, rows: int, longest: int) -> tuple[int, int] | None:
        """The (rows, chunks) bucket of a step of `rows` requests, the longest attending over
        `longest` tokens; None when it is bigger than every bucket (decode it eagerly)."""
        need = max(1, -(-longest // self.chunk))
        chunks = 1 << (need - 1).bit_length()
        fits = [b for b in ROW_BUCKETS if b >= rows]
        if not fits:
            return None
        padded_rows = min(fits[0], max(rows, self.pool.mamba.num_slots))  # never past the pool
        if padded_rows * chunks * self.chunk > MAX_TABLE_TOKENS:
            return None
        return padded_rows, chunks

    def __call__(self, input_ids: list[int], positions: list[int], kv_slots: list[Tensor],
                 mamba_slots: list[int]) -> Tensor | None:
        """Logits (R, vocab) fp32 of one decode step, or None when no bucket fits (the caller
        decodes eagerly).

        kv_slots[i] (CPU, (L_i,)): request i's token slots, the new token's last (its K/V is
        written there)."""
        shape = self.bucket_for(len(input_ids), max(t.shape[0] for t in kv_slots))
        if shape is None:
            return None
        b = self._bucket(*shape)
        self.steps[shape] = self.steps.get(shape, 0) + 1
        self._fill(b, input_ids, positions, kv_slots, mamba_slots)
        b.device_inputs.copy_(b.host, non_blocking=True)
        if b.graph is not None:
            b.graph.replay()
        else:
            b.logits = self._step(b)
        return b.logits[: len(input_ids)]

    # ------------------------------------------------------------------ buffers
    def _bucket(self, rows: int, chunks: int) -> _Bucket:
        b = self._buckets.get((rows, chunks))
        if b is None:
            b = self._buckets[(rows, chunks)] = self._new_bucket(rows, chunks)
        return b

    def _new_bucket(self, rows: int, chunks: int) -> _Bucket:
        self.created += 1
        n = 5 * rows + rows * chunks * self.chunk
        host = torch.zeros(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        table = KVTable.build([], self.chunk, shape=(rows, chunks))
        b = _Bucket(rows, chunks, host, host.to(self.device), table.owner.to(self.device),
                    table.grid.to(self.device))
        self._fill(b, [], [], [], [])  # all padding: warm-up and capture touch scratch slots only
        b.device_inputs.copy_(b.host)
        if self.capture:
            self._record(b)
        return b

    def _fill(self, b: _Bucket, input_ids: list[int], positions: list[int],
              kv_slots: list[Tensor], mamba_slots: list[int]) -> None:
        """Write a step's inputs into the bucket's host buffer; padding rows get scratch slots."""
        R = len(input_ids)
        assert R <= b.rows
        ids, pos, out, state, lengths, slots = self._views(b.host, b)
        # padding rows: token 0 at position 0 over no key, at the scratch slots. Slot entries
        # past a row's length are left as they are: masked, and always valid slot numbers
        ids[R:], pos[R:], lengths[R:] = 0, 0, 0
        state[R:] = self.pool.mamba.scratch_slot
        out[R:] = self.pool.kv.scratch_slot
        if R:
            ids[:R] = torch.tensor(input_ids, dtype=torch.int64)
            pos[:R] = torch.tensor(positions, dtype=torch.int64)
            state[:R] = torch.tensor(mamba_slots, dtype=torch.int64)
        for i, t in enumerate(kv_slots):
            out[i], lengths[i] = t[-1], t.shape[0]
            slots[i].view(-1)[: t.shape[0]] = t

    def _views(self, flat: Tensor, b: _Bucket) -> tuple[Tensor, ...]:
        """ids, positions, out_slots, mamba_slots, lengths (rows,) each; slots (rows, chunks, C)."""
        r = b.rows
        parts = flat[: 5 * r].view(5, r)
        return (*parts.unbind(0), flat[5 * r:].view(r, b.chunks, self.chunk))

    # ------------------------------------------------------------------ the step
    def _step(self, b: _Bucket) -> Tensor:
        """The decode forward on the bucket's device buffers: logits (rows, vocab)."""
        ids, pos, out, state, lengths, slots = self._views(b.device_inputs, b)
        token = torch.arange(b.chunks * self.chunk, device=self.device).view(b.chunks, self.chunk)
        valid = (token[None] < lengths[:, None, None]).view(-1, self.chunk)  # (rows*chunks, C)
        flat = starts = None
        if self.device.type == "cpu":  # each row's slots unchunked, as an eager step's table holds
            #   them (`KVTable.flat`): a fused CPU attention reads them (nothing is captured here)
            flat, starts = slots.reshape(-1)[valid.view(-1)], torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        table = KVTable(slots.reshape(-1, self.chunk), valid, b.owner, b.grid, flat, starts)
        batch = ForwardBatch(False, ids, pos, [1] * b.rows, out, state, None, table)
        return self.model(batch, self.pool)

    def _record(self, b: _Bucket) -> None:
        """Warm up on a side stream (allocator, lazy inits), then capture the step."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            b.logits = self._step(b)
        b.graph = graph
