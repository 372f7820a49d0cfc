"""`actors.rowdot.ssd_update` and `conv_update`: decode's Mamba2 state updates in one pass over
each request's state.

Held here, for the SSD update, against an independent float64 reference (the recurrence written
out): the updated states and the readout y are within fp32 rounding of it, and the slots no
request names are left alone; a request's bits depend on its own state and inputs only (alone,
or in a batch in any slot order, it gets the same state and y, `torch.equal`); every build this
CPU runs gives the same bits (plain C without fused multiply-adds). For the conv update: the
same bits as the torch path (`causal_conv_step`, gather and run forms), outputs and states, with
and without a bias. Negative controls: a one-ulp change to the request's own input changes its y
(the equality check sees a change that small); a readout summed in another order (torch's)
does not give the same bits, nor do the conv's taps summed in reverse, so neither kernel is
checked against itself under another name. In the engine: decode takes both where rowdot loads
and says so in the kernel a worker reports, with the torch path's tokens.
"""

from __future__ import annotations

import pytest
import torch

from actors import rowdot
from actors.mamba import causal_conv_step, ssd_step

pytestmark = pytest.mark.skipif(not rowdot.available(), reason=f"rowdot: {rowdot.unavailable_reason()}")

H, P, N, G = 4, 16, 20, 2  # two heads per group; N % 8 = 4: the tail is exercised
SLOTS = 9


def _inputs(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(SLOTS, H, P, N, generator=g)
    decay = torch.rand(rows, H, generator=g)
    xdt = torch.randn(rows, H, P, generator=g)
    B, C = torch.randn(rows, G, N, generator=g), torch.randn(rows, G, N, generator=g)
    return state, decay, xdt, B, C


def _reference(state, slots, decay, xdt, B, C):
    """float64: s = s decay + B xdt, y = sum_n C s (head h reads group h // (H // G))."""
    heads = torch.arange(H) // (H // G)
    s = state.double()[slots] * decay.double()[:, :, None, None] \
        + B.double()[:, heads, None, :] * xdt.double()[..., None]  # (R, H, P, N)
    return s, (s * C.double()[:, heads, None, :]).sum(-1)  # (R, H, P)


def test_the_update_matches_float64_and_leaves_other_slots_alone():
    state, decay, xdt, B, C = _inputs(4)
    slots = torch.tensor([7, 2, 5, 0])
    before = state.clone()
    ref_state, ref_y = _reference(before, slots, decay, xdt, B, C)
    y = rowdot.ssd_update(state, slots, decay, xdt, B, C)
    assert torch.allclose(state[slots].double(), ref_state, rtol=1e-6, atol=1e-6)
    assert torch.allclose(y.double(), ref_y, rtol=1e-5, atol=1e-5)
    others = [i for i in range(SLOTS) if i not in slots.tolist()]
    assert torch.equal(state[others], before[others])


def test_a_requests_bits_do_not_depend_on_the_batch_or_its_slot():
    state, decay, xdt, B, C = _inputs(5, seed=1)
    batch = state.clone()
    y = rowdot.ssd_update(batch, torch.tensor([3, 8, 1, 4, 6]), decay, xdt, B, C)
    for r, slot in enumerate([3, 8, 1, 4, 6]):
        alone = state.clone()
        alone[0] = state[slot]  # its state in another slot, with nothing beside it
        y_alone = rowdot.ssd_update(alone, torch.tensor([0]), decay[r:r + 1], xdt[r:r + 1], B[r:r + 1], C[r:r + 1])
        assert torch.equal(y_alone[0], y[r]), r
        assert torch.equal(alone[0], batch[slot]), r


def test_an_update_split_among_threads_gives_the_same_bits():
    g = torch.Generator().manual_seed(4)
    R = 20
    state = torch.randn(24, 16, 64, 64, generator=g)  # 20 requests x 65,536 elements
    assert R * state[0].numel() >= rowdot.SPLIT_STATE
    slots = torch.randperm(24, generator=g)[:R]
    decay, xdt = torch.rand(R, 16, generator=g), torch.randn(R, 16, 64, generator=g)
    B, C = torch.randn(R, 2, 64, generator=g), torch.randn(R, 2, 64, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = state.clone()
        y_one = rowdot.ssd_update(one, slots, decay, xdt, B, C)
        torch.set_num_threads(3)
        split = state.clone()
        assert torch.equal(rowdot.ssd_update(split, slots, decay, xdt, B, C), y_one)
        assert torch.equal(split, one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("build", rowdot.builds_here())
def test_every_build_gives_the_same_bits(build):
    lib, why = rowdot.load(build=build)
    assert lib is not None, why
    state, decay, xdt, B, C = _inputs(3, seed=2)
    slots = torch.tensor([1, 6, 2])
    mine, default = state.clone(), state.clone()
    assert torch.equal(rowdot.ssd_update(mine, slots, decay, xdt, B, C, lib),
                       rowdot.ssd_update(default, slots, decay, xdt, B, C))
    assert torch.equal(mine, default)


def test_negative_controls_a_one_ulp_input_change_and_another_summation_order_are_seen():
    state, decay, xdt, B, C = _inputs(2, seed=3)
    slots = torch.tensor([0, 1])
    y = rowdot.ssd_update(state.clone(), slots, decay, xdt, B, C)
    nudged = xdt.clone()
    nudged[0, 0, 0] = torch.nextafter(nudged[0, 0, 0], torch.tensor(float("inf")))
    y_nudged = rowdot.ssd_update(state.clone(), slots, decay, nudged, B, C)
    assert not torch.equal(y_nudged[0, 0, 0], y[0, 0, 0])  # its own input: seen
    assert torch.equal(y_nudged[1], y[1])  # the other request's: nothing
    torch_path = ssd_step(state.clone(), slots, xdt, torch.ones(2, H), torch.zeros(H), B, C)  # decay 1
    fused = ssd_step(state.clone(), slots, xdt, torch.ones(2, H), torch.zeros(H), B, C, fused=rowdot.ssd_update)
    assert torch.allclose(torch_path, fused, rtol=1e-5, atol=1e-5)
    assert not torch.equal(torch_path, fused)  # another order of the readout's sum: other bits


def test_bad_arguments_are_refused_in_one_line():
    state, decay, xdt, B, C = _inputs(2)
    with pytest.raises(ValueError, match="slots outside"):
        rowdot.ssd_update(state, torch.tensor([0, SLOTS]), decay, xdt, B, C)
    with pytest.raises(ValueError, match="do not agree"):
        rowdot.ssd_update(state, torch.tensor([0, 1]), decay, xdt, B[:, :1], C)
    with pytest.raises(ValueError, match="contiguous fp32"):
        rowdot.ssd_update(state.transpose(2, 3), torch.tensor([0, 1]), decay, xdt, B, C)


def test_decode_takes_them_where_rowdot_loads_says_so_and_keeps_the_torch_paths_tokens(monkeypatch):
    from actors.engine import Sequence, build_engine
    from actors.model import matrix_kernel
    from raysched.sampling import SamplingParams

    calls = {"ssd_update": 0, "conv_update": 0}
    for name in calls:
        def counted(*args, _real=getattr(rowdot, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(rowdot, name, counted)

    def tokens(fused: bool) -> tuple[list[list[int]], str]:
        engine = build_engine("tiny", device="cpu", kv_tokens=512, state_slots=4, seed=0)
        if not fused:
            engine.model.rowdot = False  # every product on MKL's probed path, the updates in torch
        seqs = [Sequence(f"r{i}", list(range(3 + i, 40 + i)), 37, SamplingParams(max_new_tokens=12))
                for i in range(3)]
        engine.prefill(seqs)
        engine.decode(11)
        return [s.token_ids[s.prompt_len:] for s in seqs], matrix_kernel(engine.model)

    fused, kernel = tokens(True)
    assert calls["ssd_update"] > 0 and calls["conv_update"] == calls["ssd_update"]  # every Mamba layer, every step
    before = dict(calls)
    plain, other = tokens(False)
    assert calls == before
    assert kernel.endswith("; ssd fused") and not other.endswith("; ssd fused")
    assert fused == plain


@pytest.mark.parametrize("K, bias, D", [(4, True, 37), (4, False, 37), (2, True, 37), (4, True, 1152)],
                         ids=["k4-bias", "k4", "k2-bias", "k4-bias-wide"])
@pytest.mark.parametrize("run", [False, True], ids=["gather", "run"])
@pytest.mark.parametrize("build", rowdot.builds_here())
def test_the_conv_update_gives_the_torch_paths_bits(K, bias, D, run, build):
    """On every build this CPU runs (d_conv = 4 has a loop of its own, vectorized across
    channels: 37 channels leave a remainder, 1,152 are `small`'s)."""
    g = torch.Generator().manual_seed(K)
    R = 3
    state = torch.randn(SLOTS, D, K - 1, generator=g)
    x = torch.randn(R, D, generator=g)
    weight, b = torch.randn(D, 1, K, generator=g), (torch.randn(D, generator=g) if bias else None)
    slots = torch.tensor([4, 5, 6]) if run else torch.tensor([6, 0, 3])
    torch_state, fused_state = state.clone(), state.clone()
    expected = causal_conv_step(torch_state, slots, x, weight, b, run=(4, R) if run else None)
    lib = rowdot.library(build)
    got = causal_conv_step(fused_state, slots, x, weight, b,
                           fused=lambda *a: rowdot.conv_update(*a, lib=lib))
    assert torch.equal(got, expected)
    assert torch.equal(fused_state, torch_state)  # shifted at its slots, the others untouched


def test_negative_control_the_conv_taps_summed_in_reverse_give_other_bits():
    g = torch.Generator().manual_seed(5)
    D, K = 64, 4
    state, x = torch.randn(2, D, K - 1, generator=g), torch.randn(2, D, generator=g)
    taps = torch.randn(K, D, generator=g)
    window = torch.cat([state, x[..., None]], dim=-1)  # (R, D, K)
    reverse = window[..., K - 1] * taps[K - 1]
    for k in range(K - 2, -1, -1):
        reverse = reverse + window[..., k] * taps[k]
    fused = rowdot.conv_update(state.clone(), torch.tensor([0, 1]), x, taps, None)
    assert torch.allclose(fused, reverse, rtol=1e-5, atol=1e-5)
    assert not torch.equal(fused, reverse)
