"""The Mamba2 pieces held against their references: chunked SSD vs the plain recurrence, the
decode step vs the recurrence, the conv's prefill state vs its decode step, and a whole mixer's
prefill vs prefill-of-a-prefix followed by decode steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actors.batch import Segment
from actors.mamba import (Kernels, causal_conv_prefill, causal_conv_step, decay_exp_, ssd_chunked,
                          ssd_sequential_ref, ssd_step)
from actors.presets import PRESETS, load_preset

CHUNK = 16
H, P, G, N = 4, 8, 2, 16


def _ssd_inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, H, P, generator=gen)  # (L, H, P)
    dt = torch.rand(length, H, generator=gen) * 0.5 + 0.01  # (L, H)
    A = -torch.rand(H, generator=gen) * 4 - 0.5  # (H,)
    B = torch.randn(length, G, N, generator=gen)  # (L, G, N)
    C = torch.randn(length, G, N, generator=gen)  # (L, G, N)
    return x, dt, A, B, C


@pytest.mark.parametrize("length", [1, CHUNK - 1, CHUNK, 3 * CHUNK + 5])
def test_chunked_ssd_matches_sequential_reference(length):
    args = _ssd_inputs(length)
    y, state = ssd_chunked(*args, CHUNK)
    y_ref, state_ref = ssd_sequential_ref(*args, CHUNK)
    assert y.dtype == state.dtype == torch.float32
    assert y.shape == (length, H, P) and state.shape == (H, P, N)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [32, 64, 128])
def test_any_chunk_length_gives_the_scan_up_to_rounding(chunk):
    """The mixer scans with chunks of at most `SCAN_BLOCK` (32) whatever the model's chunk size
    (`small`: 128): any length is the same SSD, so both match the recurrence."""
    args = _ssd_inputs(300, seed=2)
    y, state = ssd_chunked(*args, chunk)
    y_ref, state_ref = ssd_sequential_ref(*args, chunk)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-5)
    assert state.is_contiguous()


def test_chunked_ssd_continues_from_an_initial_state():
    x, dt, A, B, C = _ssd_inputs(2 * CHUNK + 3, seed=1)
    _, mid = ssd_sequential_ref(x[:10], dt[:10], A, B[:10], C[:10], CHUNK)
    y, final = ssd_chunked(x[10:], dt[10:], A, B[10:], C[10:], CHUNK, initial_state=mid)
    y_ref, final_ref = ssd_sequential_ref(x, dt, A, B, C, CHUNK)
    torch.testing.assert_close(y, y_ref[10:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, final_ref, rtol=1e-5, atol=1e-5)


def test_ssd_step_matches_reference_and_touches_only_its_slot():
    x, dt, A, B, C = _ssd_inputs(9, seed=2)
    pool = torch.randn(4, H, P, N)  # (slots, H, P, N)
    pool[2] = 0
    before = pool.clone()
    ys = [ssd_step(pool, torch.tensor([2]), x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1])
          for t in range(9)]
    y_ref, state_ref = ssd_sequential_ref(x, dt, A, B, C, CHUNK)
    torch.testing.assert_close(torch.cat(ys), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[2], state_ref, rtol=1e-5, atol=1e-5)
    for other in (0, 1, 3):
        assert torch.equal(pool[other], before[other])


@pytest.mark.parametrize("length", [1, 2, 3, 11])
def test_conv_state_after_prefill_continues_with_steps(length):
    D, K = 6, 4
    gen = torch.Generator().manual_seed(length)
    xBC = torch.randn(length + 5, D, generator=gen)  # (L+5, D)
    weight, bias = torch.randn(D, 1, K, generator=gen), torch.randn(D, generator=gen)
    full, _ = causal_conv_prefill(xBC, weight, bias)  # (L+5, D)
    out, state = causal_conv_prefill(xBC[:length], weight, bias)  # (L, D), (D, K-1)
    expected_state = torch.cat([torch.zeros(D, K - 1), xBC[:length].t()], dim=1)[:, -(K - 1):]
    assert torch.equal(state, expected_state)  # last K-1 inputs, zero-padded on the left
    pool = torch.zeros(3, D, K - 1)
    pool[1] = state
    steps = [causal_conv_step(pool, torch.tensor([1]), xBC[t:t + 1], weight, bias)
             for t in range(length, length + 5)]
    torch.testing.assert_close(torch.cat([out, *steps]), full, rtol=1e-6, atol=1e-6)
    assert torch.equal(pool[1], xBC[-(K - 1):].t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixer_prefill_equals_prefix_prefill_then_decode(dtype):
    model, config = load_preset("tiny", dtype, "cpu", seed=3)
    mixer = model.layers[config.mamba_layer_indices[0]].mamba
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2 * config.mamba_chunk_size + 3, config.hidden_size, generator=gen).to(dtype)
    conv = torch.zeros(3, config.conv_dim, config.mamba_d_conv - 1, dtype=dtype)
    ssm = torch.zeros(3, config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state)
    with torch.inference_mode():
        full = mixer.prefill(h, [Segment(slice(0, h.shape[0]), 1)], conv, ssm)  # (L, hidden)
        prefix = mixer.prefill(h[:-4], [Segment(slice(0, h.shape[0] - 4), 2)], conv, ssm)
        steps = [mixer.decode(h[t:t + 1], conv, ssm, torch.tensor([2]), Kernels())
                 for t in range(h.shape[0] - 4, h.shape[0])]
    assert ssm.dtype == torch.float32 and full.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(torch.cat([prefix, *steps]), full, rtol=tol, atol=tol)
    torch.testing.assert_close(ssm[2], ssm[1], rtol=tol, atol=tol)


def test_tiny_preset_is_small():
    model, _ = load_preset("tiny", torch.float32, "cpu")
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert PRESETS["tiny"].mamba_chunk_size == CHUNK


def _strong_decay_case(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    L, H, P, N = 300, 4, 8, 16
    x = torch.randn(L, H, P, generator=g)
    dt = torch.rand(L, H, generator=g) * 1.3  # dt A down to -20 per step: exp underflows
    A = -torch.tensor([15.7, 4.0, 1.4, 0.01])
    B, C = torch.randn(L, 1, N, generator=g), torch.randn(L, 1, N, generator=g)
    return x, dt, A, B, C


def test_strongly_decaying_heads_match_the_reference_with_the_decay_floor():
    """Log-decays below LOG_DECAY_FLOOR become exact zeros (no subnormals); the result stays
    as close to the plain recurrence (which keeps every tiny term) as without the floor: within
    1e-6 of the output's scale."""
    x, dt, A, B, C = _strong_decay_case()
    y, state = ssd_chunked(x, dt, A, B, C, 64)
    y_ref, state_ref = ssd_sequential_ref(x, dt, A, B, C, 64)
    scale = y_ref.abs().max().item()  # ~113 here
    assert (y - y_ref).abs().max() <= 1e-6 * scale
    assert (state - state_ref).abs().max() <= 1e-6 * state_ref.abs().max()
    decays = decay_exp_(torch.tensor([0.0, -10.0, -59.0, -61.0, -95.0]))
    assert decays[-2:].eq(0).all() and decays[:3].gt(0).all()
    assert not ((decays > 0) & (decays < torch.finfo(torch.float32).tiny)).any()


def test_a_decay_floor_near_zero_would_break_the_match(monkeypatch):
    """Negative control: the comparison above sees it when real decays are cut (floor -1)."""
    monkeypatch.setattr("actors.mamba.LOG_DECAY_FLOOR", -1.0)
    x, dt, A, B, C = _strong_decay_case()
    y, _ = ssd_chunked(x, dt, A, B, C, 64)
    y_ref, _ = ssd_sequential_ref(x, dt, A, B, C, 64)
    assert (y - y_ref).abs().max() > 1e-3


_CHUNK_COUNT_CHECK = """
import torch
torch.set_num_threads(1)
from actors.mamba import ssd_chunked
g = torch.Generator().manual_seed(0)
H, P, G, N, L = 4, 32, 2, 16, 168
x, dt = torch.randn(L, H, P, generator=g), torch.rand(L, H, generator=g) * 0.5 + 0.01
A, B, C = -torch.rand(H, generator=g) * 4 - 0.5, torch.randn(L, G, N, generator=g), torch.randn(L, G, N, generator=g)
marks = []
y, _ = ssd_chunked(x, dt, A, B, C, 128, None, marks)
y_a, s_a = ssd_chunked(x[:128], dt[:128], A, B[:128], C[:128], 128)
y_b, _ = ssd_chunked(x[128:], dt[128:], A, B[128:], C[128:], 128, s_a)
same = torch.equal(marks[0].at(128), s_a) and torch.equal(y, torch.cat([y_a, y_b]))
b = torch.randn(1, 128, G, N, generator=g).permute(0, 2, 3, 1).reshape(G, N, 128)  # one chunk's views, as
r = torch.randn(1, 128, G, 64, generator=g).transpose(1, 2).reshape(G, 128, 64)      # the scan had them
differs = not torch.equal(torch.bmm(b, r), torch.bmm(b.contiguous(), r.contiguous()))
print("equal" if same else "differ", "strided-differs" if differs else "strided-same")
"""


def test_a_chunks_state_does_not_depend_on_how_many_chunks_the_scan_ran_with_mkl_on_avx2():
    """A scan in 128-token chunks (a GPU's, here on the CPU) gives the state at 128, and the rows
    after it, the bits of a scan that stopped there, with MKL held to its AVX2 code (a fresh
    process: MKL reads `MKL_ENABLE_INSTRUCTIONS` when it loads). With one chunk the products'
    operands were strided views, with more they were copies, and MKL's AVX2 path rounds the two
    layouts differently. Control (skipped where MKL does not): the same product on a strided view
    and on its contiguous copy give other bits there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    run = subprocess.run([sys.executable, "-c", _CHUNK_COUNT_CHECK], env=env, capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    result, control = run.stdout.split()
    assert result == "equal"
    if control != "strided-differs":
        pytest.skip("MKL rounds strided and contiguous operands alike here: the control has no premise")
