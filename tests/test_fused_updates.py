"""`actors.rowdot.ssd_update` and `conv_update`: decode's Mamba2 state updates in one pass over
each request's state; `conv_prefill` and `ssd_carry`: prefill's conv and its scan's recurrence
over chunks in one pass.

Held here, for the SSD update, against an independent float64 reference (the recurrence written
out): the updated states and the readout y are within fp32 rounding of it, and the slots no
request names are left alone; a request's bits depend on its own state and inputs only (alone,
or in a batch in any slot order, it gets the same state and y, `torch.equal`); every build this
CPU runs gives the same bits (plain C without fused multiply-adds). For the conv update: the
same bits as the torch path (`causal_conv_step`, gather and run forms), outputs and states, with
and without a bias. Negative controls: a one-ulp change to the request's own input changes its y
(the equality check sees a change that small); a readout summed in another order (torch's)
does not give the same bits, nor do the conv's taps summed in reverse, so neither kernel is
checked against itself under another name. The prefill conv: the fp32 torch path's bits on
every build, outputs and the state it leaves (control: one fused multiply-add per tap, what
`addcmul_` gives where ATen was built with them, is within rounding and not the same bits); the
scan's carry likewise, and close to the plain recurrence. In the engine: decode takes both
updates and prefill the conv and the carry where rowdot loads, says so in the
kernel a worker reports, with the torch path's tokens.
"""

from __future__ import annotations

import pytest
import torch

from actors import rowdot
from actors.mamba import causal_conv_prefill, causal_conv_step, rowwise, ssd_step

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


def test_the_engine_takes_them_where_rowdot_loads_says_so_and_keeps_the_torch_paths_tokens(monkeypatch):
    from actors.engine import Sequence, build_engine
    from actors.model import matrix_kernel
    from raysched.sampling import SamplingParams

    calls = {"ssd_update": 0, "conv_update": 0, "conv_prefill": 0, "ssd_carry": 0, "decode_attention": 0,
             "ssd_scan": 0}
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
    vector = rowdot.variant() != "portable"  # decode attention and the whole scan: the vector builds only
    assert calls["conv_prefill"] > 0 and (calls["ssd_carry"] > 0) != vector  # prefill's conv, its scan's
    assert (calls["ssd_scan"] > 0) == vector  # recurrence or the whole scan,
    assert (calls["decode_attention"] > 0) == vector  # and every attention layer's decode, every step
    before = dict(calls)
    plain, other = tokens(False)
    assert calls == before
    assert kernel.endswith("; ssd fused; attention and scan fused" if vector else "; ssd fused")
    assert "fused" not in other
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


@pytest.mark.parametrize("K, bias, D", [(4, True, 37), (4, False, 37), (2, True, 37), (4, True, 1152)],
                         ids=["k4-bias", "k4", "k2-bias", "k4-bias-wide"])
@pytest.mark.parametrize("start", [False, True], ids=["from-a-state", "fresh"])
@pytest.mark.parametrize("build", rowdot.builds_here())
def test_the_prefill_conv_gives_the_torch_paths_bits(K, bias, D, start, build):
    """`rowdot.conv_prefill` (`Kernels.conv_prefill`) against `causal_conv_prefill`'s torch
    calls on every build: outputs and the state it leaves, from a conv state or from zeros; and
    each row's bits are its own (the first rows alone give the same; the SiLU after it runs
    `rowwise`, as in the model), from rows of a wider projection read in place (the kernel
    takes the first K-1 rows from a small window of their own, the rest from the rows)."""
    g = torch.Generator().manual_seed(K + D)
    L = 70
    wide, weight = torch.randn(L, D + 5, generator=g), torch.randn(D, 1, K, generator=g)
    xBC = wide[:, 2:2 + D]  # a column slice of a wider projection, as the mixer's: read in place
    b = torch.randn(D, generator=g) if bias else None
    initial = None if start else torch.randn(D, K - 1, generator=g)
    lib = rowdot.library(build)
    fused = lambda *a, **k: rowdot.conv_prefill(*a, lib=lib, **k)  # noqa: E731
    expected, state = causal_conv_prefill(xBC, weight, b, initial, rowwise)
    got, got_state = causal_conv_prefill(xBC, weight, b, initial, rowwise, fused=fused)
    assert torch.equal(got, expected) and torch.equal(got_state, state)
    assert torch.equal(causal_conv_prefill(xBC[:9], weight, b, initial, rowwise, fused=fused)[0], expected[:9])


def test_negative_control_a_fused_multiply_add_gives_other_bits_than_the_prefill_conv():
    """The prefill conv's fp32 sums are one product then one add each; one multiply-add per
    tap (float64 products, one rounding to fp32 per tap: what `addcmul_` becomes where ATen
    was built with fused multiply-adds) is within rounding of it and not the same bits, so the
    equality above tells the two apart."""
    g = torch.Generator().manual_seed(11)
    L, D, K = 200, 64, 4
    xBC, weight, b = torch.randn(L, D, generator=g), torch.randn(D, 1, K, generator=g), torch.randn(D, generator=g)
    window, taps = torch.cat([torch.zeros(K - 1, D), xBC]), weight[:, 0, :].t()
    fma = window[:L] * taps[0]
    for k in range(1, K):
        fma = (fma.double() + window[k:k + L].double() * taps[k].double()).float()
    fma = fma + b
    got = rowdot.conv_prefill(window, taps, b)
    assert torch.allclose(got, fma, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, fma)


@pytest.mark.parametrize("G, P", [(2, 16), (1, 13)], ids=["two-groups", "P-13"])
@pytest.mark.parametrize("start", [False, True], ids=["from-a-state", "fresh"])
@pytest.mark.parametrize("build", rowdot.builds_here())
def test_the_scan_carry_gives_the_torch_paths_bits(G, P, start, build):
    """`rowdot.ssd_carry` (`Kernels.ssd_carry`) inside `ssd_chunked`, against the torch
    recurrence over chunks, on every build: the outputs, the final state and every chunk's
    entering state (`Marks`) equal; and close to the plain recurrence (`ssd_sequential_ref`),
    so neither side is wrong in the same way (P = 13: a row that is no whole vector)."""
    from actors.mamba import ssd_chunked, ssd_sequential_ref

    g = torch.Generator().manual_seed(G * 100 + P)
    L, heads, N, chunk = 75, 4, 16, 16
    x, dt = torch.randn(L, heads, P, generator=g), torch.rand(L, heads, generator=g) * 0.5 + 0.01
    A, B, C = -torch.rand(heads, generator=g) * 4 - 0.5, torch.randn(L, G, N, generator=g), torch.randn(L, G, N, generator=g)
    initial = None if start else torch.randn(heads, P, N, generator=g)
    lib = rowdot.library(build)
    marks_t, marks_f = [], []
    y, final = ssd_chunked(x, dt, A, B, C, chunk, initial, marks_t)
    y2, final2 = ssd_chunked(x, dt, A, B, C, chunk, initial, marks_f,
                             carry=lambda *a: rowdot.ssd_carry(*a, lib=lib))
    assert torch.equal(y2, y) and torch.equal(final2, final)
    assert all(torch.equal(marks_f[0].at(r), marks_t[0].at(r)) for r in range(chunk, L, chunk))
    if initial is None:
        y_ref, state_ref = ssd_sequential_ref(x, dt, A, B, C, chunk)
        torch.testing.assert_close(y2, y_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final2, state_ref, rtol=1e-4, atol=1e-4)


def test_negative_control_a_carry_with_a_multiply_add_gives_other_bits():
    """One multiply-add per element (float64 product and sum, one rounding) instead of the
    product then the add: within rounding of the kernel, not its bits."""
    g = torch.Generator().manual_seed(3)
    c, G, N, K, P = 6, 1, 16, 4, 32
    local, decay = torch.randn(c, G, N, K, P, generator=g), torch.rand(c, G, K, generator=g)
    states = torch.empty(c + 1, G, N, K, P)
    states[0] = torch.randn(G, N, K, P, generator=g)
    fma = states.clone()
    rowdot.ssd_carry(states, local, decay)
    for k in range(c):
        fma[k + 1] = (fma[k].double() * decay[k].double()[:, None, :, None] + local[k].double()).float()
    assert torch.allclose(states, fma, rtol=1e-5, atol=1e-5)
    assert not torch.equal(states, fma)
