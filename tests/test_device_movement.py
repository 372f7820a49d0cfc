"""State movement with the pools on a device that is not the CPU's (`tests.fake_device`).

A worker's pools live on its GPU and snapshots, K/V blocks and migration stages in host memory,
so every path that moves state crosses devices: retraction and the P/D hand-over (`snapshot`),
resume (`restore`), parked points and their blocks (`copy_state`, `copy_blocks`,
`restore_prefix`), live migration's pre-copy (`copy_span`, `receive_blocks`) and stop-and-copy
(`copy_state` from a token on, `commit`). CI has no GPU, so these tests put the pools (and the
model) on the fake device, which refuses any op mixing device and CPU tensors as CUDA does and
keeps real values: each path must run there AND move the right bits (torch.equal against the
source pool, and the model's logits after the move against an uninterrupted run). The same
tests run with everything on the CPU beside them.

Slots are made non-contiguous on purpose (requests grown in turns), since a contiguous run takes
a plain block copy and hid the bug of a gather into a CPU `out=` buffer (issue 32).
Negative controls: the fake device refuses exactly that gather; a state dropped on the way
changes the logits.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from actors.engine import Sequence, build_engine
from actors.pools import HybridPool
from actors.presets import PRESETS
from actors.snapshot import gather_block, gather_state, part_specs, scatter_block, scatter_state
from raysched.sampling import SamplingParams
from tests.fake_device import CrossDeviceError, fake_device, to_cpu

ARCHITECTURES = ["tiny", "tiny-granite", "tiny-nemotronh", "tiny-qwen35", "tiny-qwen3next"]
GREEDY = SamplingParams(max_new_tokens=64)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tiny products are fastest so on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _place(device: str):
    """(context, device name): the fake device's context, or nothing for the CPU."""
    return (fake_device(), "meta") if device == "fake" else (contextlib.nullcontext(), "cpu")


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------- the harness itself
def test_the_fake_device_refuses_a_gather_into_a_cpu_buffer_and_keeps_values():
    """Negative control of the harness: the op of issue 32 (`index_select(gpu, out=cpu)`)
    raises, as on CUDA, and so does `.numpy()`; allowed moves keep the values."""
    src = torch.arange(24.0).view(2, 6, 2)  # (layers, slots, dim)
    slots = torch.tensor([4, 1, 3])
    with fake_device() as dev:
        on_dev = src.to(dev)
        assert on_dev.device == dev
        with pytest.raises(CrossDeviceError, match="one device"):
            torch.index_select(on_dev, 1, slots.to(dev), out=torch.empty(2, 3, 2))
        with pytest.raises(CrossDeviceError):
            on_dev + src  # noqa: B018 (a device tensor meets a CPU one)
        with pytest.raises(TypeError):
            on_dev.numpy()
        rows = on_dev.index_select(1, slots.to(dev)).cpu()
        picked = on_dev[:, [4, 1]].cpu()
    assert type(rows) is torch.Tensor and torch.equal(rows, src[:, slots])
    assert torch.equal(picked, src[:, [4, 1]])


# ---------------------------------------------------------------------- pool level, every model
def _interleaved_pool(config, device, rids: list[str], tokens: int) -> HybridPool:
    """A pool whose requests grew in turns (page size 1): no request's slots are one run; every
    tensor filled with distinct values."""
    pool = HybridPool(config, tokens * len(rids) + 32, len(rids) + 2, torch.float32, device)
    for rid in rids:
        assert pool.admit(rid, 1)
    for n in range(2, tokens + 1):
        for rid in rids:
            assert pool.extend(rid, n)
    g = torch.Generator().manual_seed(len(rids))
    for name in ("k", "v", *pool.mamba.tensors):
        t = pool.tensor(name)
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


def _values(pool: HybridPool, rid: str, start: int, end: int) -> dict[str, torch.Tensor]:
    """The request's K/V of tokens [start, end) and its state, read on the CPU."""
    slots = pool.kv.token_slots(rid)[start:end]
    slot = pool.mamba.slot(rid)
    out = {name: to_cpu(pool.tensor(name).cpu())[:, slots] for name in ("k", "v")}
    out.update({name: to_cpu(t.cpu())[:, slot] for name, t in pool.mamba.tensors.items()})
    return out


@pytest.mark.parametrize("device", ["cpu", "fake"])
@pytest.mark.parametrize("model", ARCHITECTURES)
def test_snapshots_and_blocks_move_every_part_between_device_pools(model, device):
    """gather_state / scatter_state and gather_block / scatter_block between two pools on the
    device, at non-contiguous slots: the destination holds the source's bits."""
    config, (place, dev) = PRESETS[model], _place(device)
    with place:
        src = _interleaved_pool(config, dev, ["a", "b", "c"], 12)
        dst = _interleaved_pool(config, dev, ["x", "y"], 5)  # other slots, other values
        specs = part_specs(config, torch.float32, 12)
        payload = gather_state(src, "b", 12, specs).numpy()
        block = gather_block(src, "c", 4, tuple(range(6)), tuple(range(10)), config, "fp")
        snap = _FakeSnap(specs, payload)
        assert dst.admit("b", 12, zero_state=False) and dst.admit("c", 10)
        scatter_state(dst, "b", snap)
        scatter_block(dst, "c", block)
        assert not torch.equal(src.kv.token_slots("b"), dst.kv.token_slots("b"))
        got_b, want_b = _values(dst, "b", 0, 12), _values(src, "b", 0, 12)
        got_c, want_c = _values(dst, "c", 4, 10), _values(src, "c", 4, 10)
    for name, want in want_b.items():
        assert torch.equal(got_b[name], want), name
    for name in ("k", "v"):
        assert torch.equal(got_c[name], want_c[name]), name


class _FakeSnap:
    """What scatter_state reads of a snapshot: its parts, views of one payload."""

    kv_from = 0

    def __init__(self, specs, payload) -> None:
        self.parts, self.payload, self.num_cached_tokens = specs, payload, specs[0].shape[2]

    def part(self, name: str) -> torch.Tensor:
        spec = next(p for p in self.parts if p.name == name)
        raw = torch.from_numpy(self.payload[spec.offset: spec.offset + spec.nbytes])
        return raw.view(getattr(torch, spec.dtype)).view(spec.shape)


# ---------------------------------------------------------------------- engine level, with logits
def _engines(dev: str, model: str, fixed: bool = False):
    kw = dict(device=dev, kv_tokens=256, state_slots=4, record_logits=True)
    return (build_engine(model, **kw), build_engine(model, **kw),
            build_engine(model, fixed_shape_decode=fixed, **kw))


def _start(engine, prompts: list[list[int]], steps: int) -> None:
    engine.prefill([Sequence(f"r{i}", list(p), len(p), GREEDY) for i, p in enumerate(prompts)])
    engine.decode(steps)  # the requests' new tokens take slots in turns: no longer one run


def _twin(ref, prompts: list[list[int]], steps: int) -> None:
    """The reference: the source's run without the moves (the same batches up to the move, so
    every row sat where it sat there; then r2 leaves and r0, r1 decode `steps` more)."""
    _start(ref, prompts, 5)
    ref.release("r2")
    ref.decode(steps)


def _move_all(src, dst, drop_state: bool = False) -> None:
    """r1 by live migration: a pre-copy of its first 32 tokens, one more step on the source,
    then the stop-and-copy of the rest; r0 by retraction + restore (drop_state: its SSM state
    zeroed on the way, the control); r2 by a parked point (a copy with its K/V from token 16
    on, plus the block before it) restored as a new request that extends it. Each decode step
    keeps r0 and r1 in the rows they have in the reference, and they land in dst's state slots
    in that order (the fake device's CPU products are batch-invariant only for a row at the
    same place in its batch)."""
    pre_copy = src.copy_span("r1", 0, 32)
    point = src.copy_state("r2", kv_from=16)
    blocks = src.copy_blocks("r2", 0, 1, 16)
    src.decode(1)
    snap = src.snapshot("r0")
    assert dst.restore(_zero_part(snap, "ssm") if drop_state else snap)
    assert dst.reserve("r1", len(src.running["r1"].token_ids))
    assert dst.receive_blocks("r1", (pre_copy,))
    final = src.copy_state("r1", 32)
    src.release("r1")
    assert dst.commit(final)
    seq = Sequence("r2", list(point.token_ids) + [7], point.prompt_len, GREEDY)
    assert dst.restore_prefix(point, seq, tuple(blocks))
    src.release("r2")


def _zero_part(snap, name: str):
    import dataclasses
    from actors.snapshot import checksum

    payload = snap.payload.copy()
    spec = next(p for p in snap.parts if p.name == name)
    payload[spec.offset: spec.offset + spec.nbytes] = 0
    return dataclasses.replace(snap, payload=payload, checksum=checksum(payload))


@pytest.mark.parametrize("device", ["cpu", "fake"])
def test_retraction_migration_and_points_continue_bit_exactly_on_a_device(device):
    """Every state path between two engines with pools and model on the device; r0 and r1 then
    decode on the destination (a fixed-shape one: padded buckets) with the logits of the
    uninterrupted run, torch.equal; r2, restored from its point, holds the source's bits."""
    place, dev = _place(device)
    with place:
        ref, src, dst = _engines(dev, "tiny", fixed=True)
        prompts = [_prompt(n, seed=n, vocab=ref.config.vocab_size) for n in (37, 30, 20)]
        _twin(ref, prompts, 2)
        _start(src, prompts, 4)
        r2_before = src.copy_state("r2")
        _move_all(src, dst)
        r2_after = dst.copy_state("r2")  # prefilling: the point's tokens are computed
        dst.decode(2)
    assert r2_after.num_cached_tokens == r2_before.num_cached_tokens
    assert (r2_after.payload == r2_before.payload).all()
    for rid in ("r0", "r1"):
        have, want = dst.logits[rid], ref.logits[rid][6:8]
        assert len(have) == 2 and all(torch.equal(a, b) for a, b in zip(have, want)), rid


@pytest.mark.parametrize("device", ["cpu"])  # the control needs no second device
def test_negative_control_a_state_dropped_on_the_way_changes_the_logits(device):
    place, dev = _place(device)
    with place:
        ref, src, dst = _engines(dev, "tiny")
        prompts = [_prompt(n, seed=n, vocab=ref.config.vocab_size) for n in (37, 30, 20)]
        _twin(ref, prompts, 1)
        _start(src, prompts, 4)
        _move_all(src, dst, drop_state=True)
        dst.decode(1)
    assert not torch.equal(dst.logits["r0"][0], ref.logits["r0"][6])


@pytest.mark.parametrize("device", ["cpu", "fake"])
@pytest.mark.parametrize("model", ["tiny", "tiny-qwen35"])
def test_a_late_point_is_built_on_the_device_from_the_kept_scan_states(model, device):
    """A branch point a prefill passed (`Engine.copy_state_at`, from the scan states its call
    kept: SSD or delta-rule carries and conv windows, on the pool's device) holds the bytes of
    the point a prefill paused there parks (`Sequence.stops`), with the pools on the device (off
    the CPU the scans keep the model's chunk, so the grid may be coarser: `prefix_grid`); the
    prompt point (`Engine.last_state_before`) is that point, the last grid point before the end.
    Control: the point one grid step earlier is another state."""
    place, dev = _place(device)
    with place:
        late, paused = (build_engine(model, device=dev, kv_tokens=256, state_slots=4) for _ in range(2))
        late.trail_calls, late.trail_min_tokens = 2, 16
        g = late.prefix_grid
        prompt = _prompt(2 * g + 6, seed=3, vocab=late.config.vocab_size)
        late.prefill([Sequence("a", list(prompt), len(prompt), GREEDY)])
        got = {at: late.copy_state_at("a", at) for at in (g, 2 * g)}
        prompt_point = late.last_state_before("a", len(prompt))  # where its prompt point goes
        seq = Sequence("a", list(prompt), len(prompt), GREEDY, stops=(2 * g,))
        paused.prefill([seq])
        assert seq.num_computed == 2 * g
        want = paused.copy_state("a")
    assert got[2 * g].num_cached_tokens == want.num_cached_tokens == 2 * g == prompt_point
    assert (got[2 * g].payload == want.payload).all()
    state = "ssm" if model == "tiny" else "gdn_state"
    assert not torch.equal(got[g].part(state), want.part(state))  # control: one grid step earlier
