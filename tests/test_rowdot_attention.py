"""rowdot's attention kernels, in C: `decode_attention` (one query per request, its keys read
from the paged pool by slot) and `prefill_attention` (a prefill's causal attention, row by row).

The reference is a float64 softmax attention over each request's gathered keys (independent of
the kernel's order and of its exp). Bits: a request's result must not depend on the batch it is
in, on where its keys lie in the pool, or on the build (AVX-512, AVX2 and portable compute the
same IEEE operations in the same order). Controls: a one-ulp change to one request's key changes
that request's result and no other's; the same keys in another order give other bits (so the
order is fixed by the kernel, not by chance) within the reference's tolerance. Prefill: a row's
bits must not depend on where its call starts or ends, on the build, or on a split among
threads; control: a changed key changes the rows at and after its position, none before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors import rowdot
from actors.batch import KVTable

pytestmark = pytest.mark.skipif(not rowdot.available(), reason="rowdot does not build here")

POOL = 700


def _pool(Hkv: int, D: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(POOL, Hkv, D, generator=g), torch.randn(POOL, Hkv, D, generator=g)


def _requests(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    """Each request's key slots: distinct, in a random order across the pool."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(POOL, generator=g)
    out, at = [], 0
    for n in lengths:
        out.append(order[at:at + n].clone())
        at += n
    return out


def _run(q, k, v, slots: list[torch.Tensor], scale: float, lib=None) -> torch.Tensor:
    table = KVTable.build(slots)
    return rowdot.decode_attention(q, k, v, table.flat, table.starts, scale, lib=lib)


def _reference(q, k, v, slots: list[torch.Tensor], scale: float) -> torch.Tensor:
    """float64 softmax attention of each request's query over its own keys: (R, Hq * D)."""
    grp = q.shape[1] // k.shape[1]
    rows = []
    for r, s in enumerate(slots):
        kk = k[s].double().repeat_interleave(grp, 1)  # (L, Hq, D)
        vv = v[s].double().repeat_interleave(grp, 1)
        p = (torch.einsum("hd,lhd->hl", q[r].double(), kk) * scale).softmax(-1)  # (Hq, L)
        rows.append(torch.einsum("hl,lhd->hd", p, vv).reshape(-1))
    return torch.stack(rows)


SHAPES = [(8, 2, 64), (4, 4, 16), (6, 2, 24), (4, 1, 80)]  # (Hq, Hkv, D): D 24 and 80 take the tail paths


@pytest.mark.parametrize("Hq,Hkv,D", SHAPES)
def test_it_matches_a_float64_reference(Hq, Hkv, D):
    k, v = _pool(Hkv, D)
    slots = _requests([1, 37, 300, 16, 129])
    q = torch.randn(len(slots), Hq, D, generator=torch.Generator().manual_seed(2))
    out = _run(q, k, v, slots, D ** -0.5)
    torch.testing.assert_close(out.double(), _reference(q, k, v, slots, D ** -0.5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("Hq,Hkv,D", SHAPES)
def test_a_requests_bits_depend_on_neither_its_batch_nor_where_its_keys_lie(Hq, Hkv, D):
    k, v = _pool(Hkv, D)
    slots = _requests([300, 5, 129, 64, 33])
    q = torch.randn(len(slots), Hq, D, generator=torch.Generator().manual_seed(2))
    together = _run(q, k, v, slots, 0.3)
    moved_k, moved_v = torch.zeros_like(k), torch.zeros_like(v)
    for r, s in enumerate(slots):
        elsewhere = (s + 211) % POOL  # the same keys at other slots of a pool holding nothing else
        moved_k[elsewhere], moved_v[elsewhere] = k[s], v[s]
        alone = _run(q[r:r + 1], moved_k, moved_v, [elsewhere], 0.3)
        moved_k.zero_(), moved_v.zero_()
        assert torch.equal(alone[0], together[r]), r


@pytest.mark.parametrize("Hq,Hkv,D", SHAPES)
def test_every_build_this_cpu_runs_gives_the_same_bits(Hq, Hkv, D):
    k, v = _pool(Hkv, D)
    slots = _requests([300, 1, 77])
    q = torch.randn(len(slots), Hq, D, generator=torch.Generator().manual_seed(2))
    outs = {b: _run(q, k, v, slots, 0.125, lib=rowdot.library(b)) for b in rowdot.builds_here()}
    first = next(iter(outs.values()))
    assert all(torch.equal(o, first) for o in outs.values()), list(outs)


def test_control_a_small_change_to_one_requests_key_changes_that_request_only():
    k, v = _pool(2, 64)
    slots = _requests([200, 150])
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2))
    before = _run(q, k, v, slots, 0.125)
    slot = int(slots[0][17])
    k[slot, 0] *= 1.001
    after = _run(q, k, v, slots, 0.125)
    assert not torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])


def test_control_the_same_keys_in_another_order_give_other_bits_within_tolerance():
    k, v = _pool(2, 64)
    slots = _requests([300])
    q = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(2))
    forward, backward = _run(q, k, v, slots, 0.125), _run(q, k, v, [slots[0].flip(0)], 0.125)
    assert not torch.equal(forward, backward)
    torch.testing.assert_close(forward, backward, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused_in_one_line():
    k, v = _pool(2, 16)
    q = torch.randn(2, 4, 16)
    good = KVTable.build(_requests([5, 7]))
    with pytest.raises(ValueError, match="key slots outside"):
        rowdot.decode_attention(q, k, v, good.flat + POOL, good.starts, 0.25)
    with pytest.raises(ValueError, match="key slots outside"):
        rowdot.decode_attention(q, k, v, good.flat, torch.tensor([0, 7, 5]), 0.25)
    with pytest.raises(ValueError, match="do not agree"):
        rowdot.decode_attention(q, k, v[:, :1].contiguous(), good.flat, good.starts, 0.25)
    with pytest.raises(ValueError, match="contiguous fp32"):
        rowdot.decode_attention(q, k.transpose(0, 1), v, good.flat, good.starts, 0.25)


# ---------------------------------------------------------------------------- prefill
PREFILL_SHAPES = [(8, 2, 64), (6, 2, 24), (3, 3, 16), (6, 1, 80)]  # (Hq, Hkv, D): 4, 3, 1 and 6 query heads a kv head


def _sequence(n: int, Hq: int, Hkv: int, D: int, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, Hq, D, generator=g), torch.randn(n, Hkv, D, generator=g),
            torch.randn(n, Hkv, D, generator=g))


def _causal_reference(q, k, v, first: int, scale: float) -> torch.Tensor:
    """float64 causal attention of rows first .. first + L - 1 over keys 0 .. their position."""
    L, S = q.shape[0], k.shape[0]
    mask = torch.ones(L, S, dtype=torch.bool).tril(first)
    qh, kh, vh = (t.double().transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True, scale=scale)
    return out[0].transpose(0, 1).reshape(L, -1)


@pytest.mark.parametrize("Hq,Hkv,D", PREFILL_SHAPES)
@pytest.mark.parametrize("first,L", [(0, 1), (0, 200), (77, 130)])
def test_prefill_matches_a_float64_reference(Hq, Hkv, D, first, L):
    q, k, v = _sequence(first + L, Hq, Hkv, D)
    out = rowdot.prefill_attention(q[first:], k, v, first, D ** -0.5)
    torch.testing.assert_close(out.double(), _causal_reference(q[first:], k, v, first, D ** -0.5),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("Hq,Hkv,D", PREFILL_SHAPES)
def test_a_prefill_rows_bits_depend_on_neither_the_calls_bounds_nor_the_build(Hq, Hkv, D):
    q, k, v = _sequence(300, Hq, Hkv, D)
    whole = rowdot.prefill_attention(q, k, v, 0, 0.2)
    for start, end in ((0, 1), (1, 64), (37, 101), (96, 300), (299, 300)):  # on and off any grid
        part = rowdot.prefill_attention(q[start:end], k[:end], v[:end], start, 0.2)
        assert torch.equal(part, whole[start:end]), (start, end)
    for build in rowdot.builds_here():
        assert torch.equal(rowdot.prefill_attention(q, k, v, 0, 0.2, lib=rowdot.library(build)), whole), build
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        split = rowdot.prefill_attention(q, k, v, 0, 0.2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, whole)


def test_control_a_changed_key_changes_the_rows_from_its_position_on_only():
    q, k, v = _sequence(150, 8, 2, 64)
    before = rowdot.prefill_attention(q, k, v, 0, 0.125)
    k[90, 1] *= 1.001
    after = rowdot.prefill_attention(q, k, v, 0, 0.125)
    assert torch.equal(after[:90], before[:90])
    assert all(not torch.equal(after[t, 256:], before[t, 256:]) for t in (90, 91, 149))  # kv head 1's queries


def test_prefill_bad_arguments_are_refused_in_one_line():
    q, k, v = _sequence(20, 4, 2, 16)
    with pytest.raises(ValueError, match="do not agree"):
        rowdot.prefill_attention(q, k[:19], v[:19], 0, 0.25)
    with pytest.raises(ValueError, match="do not agree"):
        rowdot.prefill_attention(q[5:], k, v[:, :1], 5, 0.25)
    with pytest.raises(ValueError, match="fp32 on the CPU"):
        rowdot.prefill_attention(q.double(), k, v, 0, 0.25)
