"""Complete, self-describing request snapshots: take one out of a pool, put it back into any pool.

A `Snapshot` holds everything a request needs to continue as if it had never stopped:
- token history (prompt + generated) and the sampling parameters; the sampler is counter-based
  (see `actors.sampler`), so its state is the number of generated tokens;
- K/V of every attention layer for every cached token;
- one part per per-request state tensor the model's layer kinds declare (`config.state_tensors`):
  conv + SSM state of every Mamba2 layer, conv + recurrent state of every gated-delta-net layer;
- the model fingerprint, each part's dtype and shape, and a checksum of the payload.

The cached tokens are all but the last one: the last sampled token has not been fed to the model
yet (its K/V does not exist). Getting this off by one is a classic bug (SGLang #23346).

The payload is ONE contiguous uint8 numpy buffer (parts at 64-byte aligned offsets, bf16 kept as
raw 16-bit), so Ray moves it zero-copy. Layout of the parts:
- "kv":   (2, num_attention_layers, num_cached, kv_heads, head_dim) model dtype; [0]=K, [1]=V
- then per state tensor, under its name: (layers of its kind, *shape), fp32 or model dtype;
  e.g. "conv" (num_mamba_layers, conv_dim, d_conv - 1), "ssm" (num_mamba_layers, heads,
  head_dim, d_state) float32, "gdn_conv", "gdn_state" (num_gdn_layers, v_heads, d_k, d_v) float32.
One code path gathers, scatters and checks every architecture; restore refuses a part list that
differs from this model's.

Prefix reuse parks K/V in blocks (`KVBlock`: the K/V of tokens [start, start + n), one "kv"
part, checksummed, with a hash of every token before its end so it is only ever restored under
the history it was computed on) and *points*: snapshots whose "kv" part starts at `kv_from`, the
K/V before that coming from blocks. A retraction snapshot has `kv_from` 0.
"""

from __future__ import annotations

import warnings

from dataclasses import dataclass, field

import numpy as np
import torch

from actors.batch import contiguous_run
from actors.config import ModelConfig
from actors.pools import HybridPool

SNAPSHOT_VERSION = 1
_ALIGN = 64


def decode_cached(num_tokens: int) -> int:
    """Tokens whose state a decoding request of `num_tokens` tokens holds: all but the last."""
    return num_tokens - 1


class SnapshotError(ValueError):
    """A snapshot cannot be restored here: other model, wrong shape/dtype, or corrupted bytes."""


@dataclass(frozen=True)
class PartSpec:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Snapshot:
    request_id: str
    model_fingerprint: str
    token_ids: tuple[int, ...]  # prompt + generated
    prompt_len: int
    sampling: dict  # raysched.sampling.SamplingParams.to_dict()
    parts: tuple[PartSpec, ...]
    checksum: int
    payload: np.ndarray = field(repr=False)  # (nbytes,) uint8, contiguous
    version: int = SNAPSHOT_VERSION
    computed: int | None = None  # mid-prefill: the state covers token_ids[:computed] (a chunk
    #   boundary) and the rest is still to prefill; None: decoding, the state covers all but the last
    kv_from: int = 0  # the "kv" part holds tokens [kv_from, num_cached_tokens); earlier ones are
    #   in KVBlocks restored with it (prefix reuse)
    exact: bool = False  # the state of an uncached chunked prefill at a chunk boundary: a request
    #   restored from it and prefilled on runs the same chunks as an uncached one, bit for bit

    @property
    def num_cached_tokens(self) -> int:
        return decode_cached(len(self.token_ids)) if self.computed is None else self.computed

    @property
    def mid_prefill(self) -> bool:
        return self.computed is not None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)

    def part(self, name: str) -> torch.Tensor:
        """A (read-only) torch view of one part, with its dtype and shape."""
        spec = next((p for p in self.parts if p.name == name), None)
        if spec is None:
            raise SnapshotError(f"snapshot of {self.request_id!r} has no part {name!r}")
        with warnings.catch_warnings():  # Ray hands out read-only buffers; we never write them
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.payload[spec.offset: spec.offset + spec.nbytes])
        return raw.view(getattr(torch, spec.dtype)).view(spec.shape)

    def verify(self) -> None:
        """Raise SnapshotError if the payload does not match its checksum."""
        if checksum(self.payload) != self.checksum:
            raise SnapshotError(f"snapshot of {self.request_id!r}: checksum mismatch (corrupted payload)")


@dataclass(frozen=True)
class KVBlock:
    """The K/V of tokens [start, start + len(token_ids)) of one history, for every attention
    layer: one part "kv" (2, num_attention_layers, n, kv_heads, head_dim), model dtype."""

    model_fingerprint: str
    start: int
    token_ids: tuple[int, ...]  # this block's tokens
    history_hash: int  # history_hash(all tokens up to this block's end)
    part: PartSpec
    checksum: int
    payload: np.ndarray = field(repr=False)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)

    def kv(self) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.payload[: self.part.nbytes])
        return raw.view(getattr(torch, self.part.dtype)).view(self.part.shape)


def history_hash(token_ids: tuple[int, ...] | list[int]) -> int:
    """A hash of a token history (deterministic across processes: ints and tuples only)."""
    return hash(tuple(token_ids))


_BLOCK_WORDS = 4096


def checksum(buf: np.ndarray) -> int:
    """A 64-bit position-aware checksum of the payload, at memory speed.

    Words are 64-bit; s1 = sum of all words, s2 = sum over 32 KiB blocks of (block index + 1) x
    (block sum), both modulo 2^64, folded into one integer. Any single corrupted byte or word
    changes s1; swapping two different blocks changes s2. Not cryptographic (nor is CRC-32, which
    ran at 2.3 GB/s here against ~16 GB/s for this).
    """
    words = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint64)
    full = len(words) // _BLOCK_WORDS * _BLOCK_WORDS
    block_sums = words[:full].reshape(-1, _BLOCK_WORDS).sum(axis=1, dtype=np.uint64)
    tail = words[full:].sum(dtype=np.uint64)
    weights = np.arange(1, len(block_sums) + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        s1 = int(block_sums.sum(dtype=np.uint64)) + int(tail)
        s2 = int((block_sums * weights).sum(dtype=np.uint64)) + (len(block_sums) + 1) * int(tail)
    return ((s1 & 0xFFFFFFFFFFFFFFFF) << 64) | (s2 & 0xFFFFFFFFFFFFFFFF)


def model_fingerprint(config: ModelConfig, weights_fingerprint: str, dtype: torch.dtype) -> str:
    return f"{config.fingerprint()}:{weights_fingerprint}:{str(dtype).removeprefix('torch.')}"


def part_specs(config: ModelConfig, dtype: torch.dtype, num_cached: int) -> tuple[PartSpec, ...]:
    """The parts a snapshot of `num_cached` tokens must have, in payload order."""
    name = str(dtype).removeprefix("torch.")
    shapes = [("kv", name, (2, config.num_attention_layers, num_cached, config.num_key_value_heads,
                            config.head_dim))]
    shapes += [(t.name, "float32" if t.fp32 else name, (len(config.layers_of_kind(t.kind)), *t.shape))
               for t in config.state_tensors]
    specs, offset = [], 0
    for part, dt, shape in shapes:
        nbytes = int(np.prod(shape)) * torch.empty(0, dtype=getattr(torch, dt)).element_size()
        specs.append(PartSpec(part, dt, shape, offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return tuple(specs)


def payload_nbytes(specs: tuple[PartSpec, ...]) -> int:
    """Total payload size: the last part's end, rounded up to the alignment (whole 64-bit words)."""
    return -(-(specs[-1].offset + specs[-1].nbytes) // _ALIGN) * _ALIGN


def _alloc_payload(nbytes: int, device: torch.device) -> torch.Tensor:
    pin = device.type == "cuda"
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _views(buf: torch.Tensor, specs: tuple[PartSpec, ...]) -> dict[str, torch.Tensor]:
    return {s.name: buf[s.offset: s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
            for s in specs}


def gather_state(pool: HybridPool, request_id: str, num_cached: int,
                 specs: tuple[PartSpec, ...], kv_from: int = 0,
                 states: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Copy the request's state (K/V of tokens [kv_from, num_cached), every state tensor) out of
    the pool into a fresh host buffer (uint8, payload layout). `states` ({name: (layers,
    *shape)}): the recurrent state to copy instead of the one at the request's slot (a state
    an earlier prefill call kept, `Engine.state_at`)."""
    device = pool.k.device
    buf = _alloc_payload(payload_nbytes(specs), device)
    views = _views(buf, specs)
    slots = pool.kv.token_slots(request_id)[kv_from:num_cached]  # CPU
    slot = pool.mamba.slot(request_id)
    sources = states if states is not None else {name: t[:, slot] for name, t in pool.mamba.tensors.items()}
    if device.type == "cuda":
        _gather_cuda(pool, slots, sources, views)
    else:
        _gather_tokens(pool.k, slots, views["kv"][0])
        _gather_tokens(pool.v, slots, views["kv"][1])
        for name, tensor in sources.items():
            views[name].copy_(tensor)
    return buf


def gather_block(pool: HybridPool, request_id: str, start: int, token_ids: tuple[int, ...],
                 history: tuple[int, ...], config: ModelConfig, fingerprint: str) -> KVBlock:
    """Copy the K/V of the request's tokens [start, start + len(token_ids)) into a KVBlock
    (`history`: its tokens up to the block's end)."""
    spec = part_specs(config, pool.k.dtype, len(token_ids))[0]
    buf = _alloc_payload(-(-spec.nbytes // _ALIGN) * _ALIGN, pool.k.device)
    kv = _views(buf, (spec,))["kv"]
    slots = pool.kv.token_slots(request_id)[start:start + len(token_ids)]
    _gather_tokens(pool.k, slots, kv[0])
    _gather_tokens(pool.v, slots, kv[1])
    payload = buf.numpy()
    return KVBlock(fingerprint, start, token_ids, history_hash(history), spec, checksum(payload), payload)


def scatter_block(pool: HybridPool, request_id: str, block: KVBlock) -> None:
    """Write a block's K/V into the slots the pool gave `request_id` for its tokens."""
    slots = pool.kv.token_slots(request_id)[block.start:block.end]
    kv = block.kv().to(pool.k.device, non_blocking=True)
    _scatter_tokens(pool.k, slots, kv[0])
    _scatter_tokens(pool.v, slots, kv[1])


def check_block(block: KVBlock, token_ids: list[int], config: ModelConfig, dtype: torch.dtype,
                fingerprint: str) -> None:
    """Refuse a block that is not this model's K/V of `token_ids[block.start:block.end]` after
    exactly `token_ids[:block.start]`; changes nothing."""
    check_block_payload(block, config, dtype, fingerprint)
    check_history(block.start, block.end, block.history_hash, token_ids)


def check_history(start: int, end: int, hashed: int, token_ids: list[int] | tuple[int, ...]) -> None:
    """Refuse K/V of tokens [start, end) taken after another history than `token_ids`."""
    if history_hash(tuple(token_ids[:end])) != hashed:
        raise SnapshotError(f"K/V block of tokens [{start}, {end}) belongs to another history")


def check_block_payload(block: KVBlock, config: ModelConfig, dtype: torch.dtype, fingerprint: str) -> None:
    """Refuse a block of another model, part shape or dtype, or with a bad checksum (the history
    is checked by `check_history` once the tokens are known)."""
    if not isinstance(block, KVBlock):
        raise SnapshotError(f"expected a KVBlock, got {type(block).__name__}")
    if block.model_fingerprint != fingerprint:
        raise SnapshotError(f"K/V block at {block.start} was taken on model {block.model_fingerprint}")
    if block.part != part_specs(config, dtype, len(block.token_ids))[0]:
        raise SnapshotError(f"K/V block at {block.start}: part {_describe((block.part,))} does not match")
    if checksum(block.payload) != block.checksum:
        raise SnapshotError(f"K/V block at {block.start}: checksum mismatch (corrupted payload)")


def _gather_tokens(src: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                   non_blocking: bool = False) -> None:
    """out[l, i] = src[l, slots[i]] (src (layers, pool tokens, heads, dim) on the pool's device,
    slots (n,) on the CPU, out (layers, n, heads, dim) on any device). The rows are gathered on
    src's device, then copied once to out's: an `out=` across devices raises on a GPU."""
    if out.device == src.device and contiguous_run(slots) is None:
        torch.index_select(src, 1, slots.to(src.device), out=out)  # no temporary on one device
        return
    out.copy_(_token_rows(src, slots), non_blocking=non_blocking)


def _token_rows(src: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """src[:, slots] on src's device (layers, n, heads, dim): a view when the slots are one run."""
    span = contiguous_run(slots)
    if span is not None:
        return src.narrow(1, span[0], span[1])
    return src.index_select(1, slots.to(src.device))


def _scatter_tokens(dst: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """dst[l, slots[i]] = values[l, i] (slots on the CPU, values on any device: moved to
    dst's first); a plain block copy when the slots are contiguous."""
    values = values.to(dst.device, non_blocking=True)
    span = contiguous_run(slots)
    if span is not None:
        dst.narrow(1, span[0], span[1]).copy_(values)
    else:
        dst.index_copy_(1, slots.to(dst.device), values)


def _gather_cuda(pool: HybridPool, slots: torch.Tensor, sources: dict[str, torch.Tensor],
                 views: dict) -> None:
    """Gather on a side stream into pinned memory; wait on that stream's event only."""
    side = torch.cuda.Stream(device=pool.k.device)
    side.wait_stream(torch.cuda.current_stream(pool.k.device))
    with torch.cuda.stream(side):
        for src, dst in ((pool.k, views["kv"][0]), (pool.v, views["kv"][1])):
            _gather_tokens(src, slots, dst, non_blocking=True)
        for name, tensor in sources.items():
            views[name].copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()


def scatter_state(pool: HybridPool, request_id: str, snap: Snapshot) -> None:
    """Write the snapshot's parts into the slots the pool gave `request_id`."""
    device = pool.k.device
    views = {s.name: snap.part(s.name) for s in snap.parts}
    slots = pool.kv.token_slots(request_id)[snap.kv_from: snap.num_cached_tokens]  # CPU
    slot = pool.mamba.slot(request_id)
    kv = views["kv"].to(device, non_blocking=True)
    _scatter_tokens(pool.k, slots, kv[0])
    _scatter_tokens(pool.v, slots, kv[1])
    for name, tensor in pool.mamba.tensors.items():
        tensor[:, slot].copy_(views[name], non_blocking=True)


def check_compatible(snap: Snapshot, config: ModelConfig, dtype: torch.dtype, fingerprint: str) -> None:
    """Refuse a snapshot that this pool/model cannot continue; changes nothing."""
    if not isinstance(snap, Snapshot):
        raise SnapshotError(f"expected a Snapshot, got {type(snap).__name__}")
    if snap.version != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot of {snap.request_id!r}: version {snap.version}, expected {SNAPSHOT_VERSION}")
    if snap.model_fingerprint != fingerprint:
        raise SnapshotError(f"snapshot of {snap.request_id!r} was taken on model {snap.model_fingerprint}, "
                            f"this worker serves {fingerprint}")
    if not 1 <= snap.prompt_len <= len(snap.token_ids):
        raise SnapshotError(f"snapshot of {snap.request_id!r}: prompt_len {snap.prompt_len} does not fit "
                            f"{len(snap.token_ids)} tokens")
    if snap.computed is not None and not 1 <= snap.computed < len(snap.token_ids):
        raise SnapshotError(f"snapshot of {snap.request_id!r}: mid-prefill state of {snap.computed} tokens "
                            f"does not fit {len(snap.token_ids)} tokens")
    if not 0 <= snap.kv_from <= snap.num_cached_tokens:
        raise SnapshotError(f"snapshot of {snap.request_id!r}: K/V from token {snap.kv_from} does not fit "
                            f"{snap.num_cached_tokens} cached tokens")
    expected = part_specs(config, dtype, snap.num_cached_tokens - snap.kv_from)
    if tuple(snap.parts) != expected:
        raise SnapshotError(f"snapshot of {snap.request_id!r}: parts {_describe(snap.parts)} do not match "
                            f"this model's {_describe(expected)}")
    end = payload_nbytes(expected)
    if snap.payload.dtype != np.uint8 or snap.payload.ndim != 1 or snap.payload.nbytes != end:
        raise SnapshotError(f"snapshot of {snap.request_id!r}: payload is {snap.payload.dtype}"
                            f"{list(snap.payload.shape)}, expected uint8[{end}]")
    snap.verify()


def _describe(parts: tuple[PartSpec, ...]) -> str:
    return ", ".join(f"{p.name}:{p.dtype}{list(p.shape)}" for p in parts)
