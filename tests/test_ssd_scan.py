"""`actors.rowdot.ssd_scan`: prefill's chunked SSD scan in one pass per head, in C.

The reference is the plain recurrence in float64 (`_recurrence`, written here), one token at a
time: nothing of the chunked algorithm. Bits: a scan cut at a multiple of the chunk and
continued from the state it left gives the uncached scan's y and state (what a parked prefix
point needs), the states it keeps are those a cut scan leaves, every build gives the same bits,
and a split among threads (by heads) or inputs that are row slices of one projection change
none. Control: a cut off the chunk grid gives other bits (its chunks are other chunks) within the
reference's tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors import rowdot

pytestmark = pytest.mark.skipif(not rowdot.available(), reason="rowdot does not build here")

SHAPES = [(2048, 16, 64, 1, 64, 32), (77, 4, 32, 2, 16, 16), (130, 6, 24, 3, 8, 32)]  # L, H, P, G, N, chunk


def _inputs(L: int, H: int, P: int, G: int, N: int, seed: int = 0):
    """x, dt, A, B, C as the mixer has them: x, B and C row slices of one projection."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(L, H * P + 2 * G * N + 3, generator=g)
    x = proj[:, :H * P].view(L, H, P)
    B = proj[:, H * P:H * P + G * N].view(L, G, N)
    C = proj[:, H * P + G * N:H * P + 2 * G * N].view(L, G, N)
    dt = F.softplus(torch.randn(L, H, generator=g) - 1.0)
    A = -torch.rand(H, generator=g) * 4 - 0.1
    state = torch.randn(H, P, N, generator=g) * 0.1
    return x, dt, A, B, C, state


def _recurrence(x, dt, A, B, C, state):
    """float64: state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T, y_t = state_t C_t, per head
    (its group's B and C). Returns y (L, H, P), the final state (H, P, N)."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    L, H, P = x.shape
    K = H // B.shape[1]
    Bh, Ch = B.repeat_interleave(K, 1), C.repeat_interleave(K, 1)  # (L, H, N)
    s = torch.zeros(H, P, B.shape[2], dtype=torch.float64) if state is None else state.double()
    ys = []
    for t in range(L):
        s = s * torch.exp(dt[t] * A)[:, None, None] + (dt[t, :, None] * x[t])[:, :, None] * Bh[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", s, Ch[t]))
    return torch.stack(ys), s


@pytest.mark.parametrize("L,H,P,G,N,chunk", SHAPES)
@pytest.mark.parametrize("from_state", [False, True])
def test_it_matches_the_recurrence_in_float64(L, H, P, G, N, chunk, from_state):
    x, dt, A, B, C, state = _inputs(L, H, P, G, N)
    s0 = state if from_state else None
    y, final, _ = rowdot.ssd_scan(x, dt, A, B, C, chunk, s0)
    ref_y, ref_final = _recurrence(x, dt, A, B, C, s0)
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final.double(), ref_final, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("L,H,P,G,N,chunk", SHAPES)
def test_a_scan_cut_on_the_chunk_grid_continues_to_the_uncut_bits(L, H, P, G, N, chunk):
    x, dt, A, B, C, state = _inputs(L, H, P, G, N)
    y, final, starts = rowdot.ssd_scan(x, dt, A, B, C, chunk, state, keep_starts=True)
    for cut in (chunk, (L // chunk - 1) * chunk):
        y1, mid, _ = rowdot.ssd_scan(x[:cut], dt[:cut], A, B[:cut], C[:cut], chunk, state)
        y2, end, _ = rowdot.ssd_scan(x[cut:], dt[cut:], A, B[cut:], C[cut:], chunk, mid)
        assert torch.equal(torch.cat([y1, y2]), y) and torch.equal(end, final), cut
        assert torch.equal(starts[cut // chunk].transpose(1, 2), mid), cut  # the kept state is the cut's


def test_control_a_cut_off_the_grid_gives_other_bits_within_tolerance():
    L, H, P, G, N, chunk = SHAPES[0]
    x, dt, A, B, C, state = _inputs(L, H, P, G, N)
    y, final, _ = rowdot.ssd_scan(x, dt, A, B, C, chunk, state)
    cut = 5 * chunk + 7
    y1, mid, _ = rowdot.ssd_scan(x[:cut], dt[:cut], A, B[:cut], C[:cut], chunk, state)
    y2, end, _ = rowdot.ssd_scan(x[cut:], dt[cut:], A, B[cut:], C[cut:], chunk, mid)
    off = torch.cat([y1, y2])
    assert not torch.equal(off, y)
    torch.testing.assert_close(off, y, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(end, final, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("L,H,P,G,N,chunk", SHAPES)
def test_every_build_threads_and_row_slices_give_the_same_bits(L, H, P, G, N, chunk):
    x, dt, A, B, C, state = _inputs(L, H, P, G, N)
    y, final, _ = rowdot.ssd_scan(x, dt, A, B, C, chunk, state)
    for build in rowdot.builds_here():
        yb, fb, _ = rowdot.ssd_scan(x, dt, A, B, C, chunk, state, lib=rowdot.library(build))
        assert torch.equal(yb, y) and torch.equal(fb, final), build
    yc, fc, _ = rowdot.ssd_scan(x.contiguous(), dt, A, B.contiguous(), C.contiguous(), chunk, state)
    assert torch.equal(yc, y) and torch.equal(fc, final)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        yt, ft, _ = rowdot.ssd_scan(x, dt, A, B, C, chunk, state)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(yt, y) and torch.equal(ft, final)


def test_bad_arguments_are_refused_in_one_line():
    x, dt, A, B, C, state = _inputs(40, 4, 8, 2, 4)
    with pytest.raises(ValueError, match="do not agree"):
        rowdot.ssd_scan(x, dt[:, :3], A, B, C, 16)
    with pytest.raises(ValueError, match="do not agree"):
        rowdot.ssd_scan(x, dt, A, B, C, 128)
    with pytest.raises(ValueError, match="do not agree"):
        rowdot.ssd_scan(x, dt, A, B, C, 16, state[:, :, :3])
    with pytest.raises(ValueError, match="fp32 on the CPU"):
        rowdot.ssd_scan(x.double(), dt, A, B, C, 16)
