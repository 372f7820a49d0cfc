"""RMSNorm on the CPU: one C call a norm (`rowdot.rms_norm`), the bits of its torch steps.

The mean square is summed in one fixed tree order (`actors.norms.tree_inv_rms`: squares in
blocks of 16 lanes, blocks by halves, lanes by halves), which torch ops and C both follow
exactly, so the C call replaces the norm's four reduction ops and its weight ops without
changing a bit. Held here, for every build this CPU runs: each style (no weight, the weight
times the normed row, the normed row times 1 + weight, a gated norm's groups) equals the torch
steps `torch.equal` and float64 within rounding; a row's bits do not depend on the call's other
rows, its row count or a split among threads; the engine takes the C call in decode and prefill
and gives the torch steps' logits. Negative control: ATen's `mean`, and a sum in row order,
give other bits on these rows, and the same equality check sees it. Also here: the per-step
constants decode now keeps (the conv taps, -exp(A_log), D; the checked slots; the RoPE tables)
are made again once their tensor is written.
"""

from __future__ import annotations

import pytest
import torch

from actors import attention, norms, rowdot
from actors.mamba import MambaMixer, derived, gated_rms_norm

pytestmark = pytest.mark.skipif(not rowdot.available(), reason=f"rowdot: {rowdot.unavailable_reason()}")

SIZES = [1, 15, 16, 17, 37, 64, 512, 1000, 1152, 4097]  # odd block counts, tails, past the stack buffer
EPS = 1e-6


def _x(rows: int, n: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * scale


def _torch_steps(x: torch.Tensor, weight: torch.Tensor | None, style: str) -> torch.Tensor:
    """The norm as the torch path writes it (`RMSNorm.forward`, fp32)."""
    h = x * norms.tree_inv_rms(x, EPS)
    if weight is None:
        return h
    return h * (1.0 + weight) if style == "offset" else weight * h


@pytest.mark.parametrize("build", rowdot.builds_here())
@pytest.mark.parametrize("style", ["none", "weight", "offset"])
@pytest.mark.parametrize("n", SIZES)
def test_the_one_pass_norm_gives_the_torch_steps_bits_and_the_float64_value(n, style, build):
    lib, why = rowdot.load(build=build)
    assert lib is not None, why
    x = _x(5, n, seed=n)
    weight = None if style == "none" else torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.3 + 1
    got = rowdot.rms_norm(x, EPS, weight, offset=style == "offset", lib=lib)
    assert torch.equal(got, _torch_steps(x, weight, style))
    x64 = x.double()
    ref = x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + EPS)
    if weight is not None:
        ref = ref * (1 + weight.double()) if style == "offset" else ref * weight.double()
    torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("groups,size", [(1, 1024), (2, 512), (4, 37)])
def test_a_gated_norms_groups_take_their_part_of_the_weight(groups, size):
    T, n = 3, groups * size
    y, z, w = _x(T, n, 1), _x(T, n, 2), _x(1, n, 3)[0]
    got = gated_rms_norm(y, z, w, size, EPS)
    h = torch.nn.functional.silu(z) * y
    g = h.view(T, groups, size)
    g.mul_(norms.tree_inv_rms(g, EPS))
    assert torch.equal(got, h * w)


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_a_gate_taken_in_place_gives_the_same_bits_and_overwrites_only_when_asked(rows):
    """`gate_in_place` (the mixer's prefill and decode: z, a column slice of the projection, is
    not read again) computes SiLU into z itself: the norm's bits equal the fresh-gate call's
    (its reference: the torch steps above), on rows spaced apart as the projection's are, with
    an fp32 `out` as the mixer passes and without, and on rows `rowwise` pads. Negative
    control: without it z is left as it was; with it and an `out`, z holds SiLU(z)."""
    from actors.mamba import rowwise

    n = 1024
    y, w = _x(rows, n, 5), _x(1, n, 6)[0]
    for width, with_out in ((n, True), (n, False), (1000, True)):
        z = _x(rows, 3 * n, 4)[:, n:n + width]  # the middle third of a projection: rows 3n apart
        args = (y[:, :width], z, w[:width], width // 2, EPS, rowwise)
        want = gated_rms_norm(*args, out=torch.empty(rows, width) if with_out else None)
        kept = z.clone()
        assert torch.equal(z, kept)  # negative control: the fresh-gate call left z alone
        got = gated_rms_norm(*args, out=torch.empty(rows, width) if with_out else None, gate_in_place=True)
        assert torch.equal(got, want)
        if width == n and with_out:  # whole vector blocks: SiLU ran in z itself, and only SiLU
            assert torch.equal(z, torch.nn.functional.silu(kept)) and not torch.equal(z, kept)
        elif width != n:  # padded (`rowwise`): the SiLU went into the padded copy
            assert torch.equal(z, kept)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_a_split_among_threads(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = _x(2100, 512, seed=7)  # 2100 x 512 >= rowdot.SPLIT_STATE: split among threads at 2
        full = rowdot.rms_norm(x, EPS)
        for at, rows in ((0, 1), (3, 1), (17, 5), (2099, 1), (1000, 64)):
            assert torch.equal(rowdot.rms_norm(x[at:at + rows].contiguous(), EPS), full[at:at + rows])
        assert torch.equal(norms.inv_rms(x, EPS) * x, full)
    finally:
        torch.set_num_threads(before)


def test_negative_control_another_summation_order_gives_other_bits_and_the_check_sees_it():
    x = _x(64, 1000, seed=3)
    ours = rowdot.rms_norm(x, EPS)
    aten = x * torch.rsqrt(torch.square(x).mean(-1, keepdim=True) + EPS)
    in_order = x * torch.rsqrt(torch.square(x).cumsum(-1)[:, -1:] / 1000 + EPS)
    assert not torch.equal(ours, aten)
    assert not torch.equal(ours, in_order)


def test_the_engine_takes_it_in_decode_and_prefill_with_the_torch_steps_logits(monkeypatch):
    from actors import mamba
    from actors.engine import Sequence, build_engine
    from raysched.sampling import SamplingParams

    calls = [0]

    def counted(*args, _real=rowdot.rms_norm, **kwargs):
        calls[0] += 1
        return _real(*args, **kwargs)
    monkeypatch.setattr(rowdot, "rms_norm", counted)

    def logits() -> dict[str, list[torch.Tensor]]:
        engine = build_engine("tiny", device="cpu", kv_tokens=512, state_slots=4, seed=0)
        engine.record_logits = True
        seqs = [Sequence(f"r{i}", list(range(3 + i, 40 + i)), 37, SamplingParams(max_new_tokens=8))
                for i in range(3)]
        engine.prefill(seqs)
        engine.decode(7)
        return engine.logits

    in_c = logits()
    assert calls[0] > 0
    for module in (norms, mamba):  # the torch steps, every other kernel as it was
        monkeypatch.setattr(module, "in_one_pass", lambda *a, **k: False)
    before = calls[0]
    in_torch = logits()
    assert calls[0] == before
    assert in_c.keys() == in_torch.keys()
    for rid, steps in in_c.items():
        assert len(steps) == 8 and all(torch.equal(a, b) for a, b in zip(steps, in_torch[rid])), rid


def test_bad_arguments_are_refused_in_one_line():
    with pytest.raises(ValueError, match="contiguous fp32 CPU tensor"):
        rowdot.rms_norm(torch.ones(2, 4, dtype=torch.float64), EPS)
    with pytest.raises(ValueError, match="whole rows of 4"):
        rowdot.rms_norm(torch.ones(2, 4), EPS, torch.ones(6))


# ---------------------------------------------------------------------------- kept per-step constants
def test_a_derived_constant_is_made_again_once_its_parameter_changes():
    module = torch.nn.Linear(3, 3)
    made = []

    def double(p: torch.Tensor) -> torch.Tensor:
        made.append(1)
        return p.detach() * 2

    first = derived(module, "twice", module.weight, double)
    assert derived(module, "twice", module.weight, double) is first and len(made) == 1
    with torch.no_grad():
        module.weight.add_(1.0)  # an in-place write: its version moves
    assert torch.equal(derived(module, "twice", module.weight, double), module.weight.detach() * 2)
    module.weight.data = torch.zeros(3, 3)  # other storage
    assert torch.equal(derived(module, "twice", module.weight, double), torch.zeros(3, 3))
    with torch.inference_mode():
        derived(module, "twice", module.weight, double)  # made in inference mode: not reused outside it
    assert len(made) == 4
    derived(module, "twice", module.weight, double)
    assert len(made) == 5


def test_the_mixers_decode_constants_follow_their_weights():
    from actors.presets import PRESETS

    mixer = MambaMixer(PRESETS["tiny"], torch.float32)
    for p in mixer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    before = mixer._A()
    with torch.no_grad():
        mixer.A_log.add_(0.5)
    assert torch.equal(mixer._A(), -torch.exp(mixer.A_log.float())) and not torch.equal(mixer._A(), before)


def test_checked_slots_written_since_are_checked_again():
    state, x, taps = torch.zeros(4, 8, 3), torch.ones(2, 8), torch.ones(4, 8)
    slots = torch.tensor([0, 1])
    rowdot.conv_update(state, slots, x, taps, None)
    rowdot.conv_update(state, slots, x, taps, None)
    slots[1] = 9  # outside the pool's 4
    with pytest.raises(ValueError, match="slots outside the pool's 4"):
        rowdot.conv_update(state, slots, x, taps, None)


def test_rope_tables_kept_for_a_forward_are_made_again_for_written_positions():
    positions = torch.tensor([3, 5])
    first = attention.rope_tables(positions, 8, 10000.0, torch.float32)
    assert attention.rope_tables(positions, 8, 10000.0, torch.float32) is first
    positions[0] = 4
    again = attention.rope_tables(positions, 8, 10000.0, torch.float32)
    want = attention.rope_cos_sin(positions, 8, 10000.0, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(again, want)) and not torch.equal(again[0], first[0])


def test_on_another_device_nothing_is_kept_and_the_norm_stays_on_torch_ops():
    """Off the CPU (CUDA; `meta` here, through `tests.fake_device`) a kept value could live in a
    CUDA graph's memory, and the C norm cannot read the tensor: `kept` makes the value each time
    and `in_one_pass` says no, so the norm takes the torch (or Triton) path."""
    from actors.kept import kept
    from tests.fake_device import fake_device

    with fake_device():
        t = torch.ones(3, device="meta")
        made, store = [], {}
        for _ in range(2):
            kept(store, "x", t, lambda: made.append(1) or t * 2)
        assert len(made) == 2 and not store
        assert not norms.in_one_pass(torch.ones(2, 8, device="meta"))
    assert norms.in_one_pass(torch.ones(2, 8))  # control: on the CPU it does
