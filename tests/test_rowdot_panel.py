"""`actors.rowdot.panel_product`: the panel kernel's bits, row-free and the same on every build.

Its contract: each output is one fused multiply-add chain over k = 0 .. K-1 in order, starting
from 0, then the bias in one fp32 add. Held here against an independent exact reference (each
step computed in rationals and rounded once to fp32 by integer arithmetic, no float code), on
every build this CPU runs (AVX-512, AVX2, the portable build's `fmaf`): the builds agree bit
for bit. Every row count and offset gives each row the bits of one large call (blocks of 1 to
8 rows, chunks of 48), and a split among threads changes no bit. The negative control: the same
reference with two roundings a step (multiply, then add) gives other bits, so the check sees
the rounding of every step.
"""

from __future__ import annotations

import mmap
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from actors import rowdot
from actors.pages import HUGE_PAGE, advised_for_huge_pages, huge_page_empty

pytestmark = pytest.mark.skipif(not rowdot.available(), reason=f"rowdot: {rowdot.unavailable_reason()}")

SHAPES = [(37, 19), (64, 33), (5, 1)]  # (out, in): a ragged last panel on every build


def _fp32(q: Fraction) -> Fraction:
    """q rounded to the nearest fp32 (ties to even), exactly: normal numbers only (the inputs
    here keep every partial sum far from fp32's subnormal and overflow ranges)."""
    if q == 0:
        return Fraction(0)
    sign, q = (-1 if q < 0 else 1), abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()  # 2^e <= q < 2^(e+2)
    while Fraction(2) ** e > q:
        e -= 1
    while Fraction(2) ** (e + 1) <= q:
        e += 1
    scaled = q / Fraction(2) ** (e - 23)  # in [2^23, 2^24): the 24 significant bits
    whole, rest = divmod(scaled.numerator, scaled.denominator)
    twice = 2 * rest
    if twice > scaled.denominator or (twice == scaled.denominator and whole % 2):
        whole += 1
    return sign * Fraction(whole) * Fraction(2) ** (e - 23)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, fused: bool) -> torch.Tensor:
    """y[i][j]: acc = 0; for k in order: acc = fp32(x[i][k] * w[j][k] + acc) (fused: one
    rounding) or fp32(fp32(x[i][k] * w[j][k]) + acc) (two); then fp32(acc + b[j])."""
    xs = [[Fraction(float(v)) for v in row] for row in x.double()]
    ws = [[Fraction(float(v)) for v in row] for row in w.double()]
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float64)
    for i, xr in enumerate(xs):
        for j, wr in enumerate(ws):
            acc = Fraction(0)
            for a, c in zip(xr, wr):
                acc = _fp32(a * c + acc) if fused else _fp32(_fp32(a * c) + acc)
            if b is not None:
                acc = _fp32(acc + Fraction(float(b[j])))
            out[i, j] = float(acc)
    return out.float()


def _inputs(out_f: int, in_f: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, in_f, generator=g), torch.randn(out_f, in_f, generator=g),
            torch.randn(out_f, generator=g))


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_every_build_gives_one_fused_chain_per_output(shape):
    x, w, b = _inputs(*shape, rows=9)
    expected = _reference(x, w, b, fused=True)
    for build in rowdot.builds_here():
        lib, why = rowdot.load(build=build)
        assert lib is not None, why
        got = rowdot.panel_product(w, b, lib)(x)
        assert torch.equal(got, expected), build
        assert torch.equal(rowdot.panel_product(w, None, lib)(x) + b, got), build  # the bias: last


def test_negative_control_two_roundings_a_step_give_other_bits():
    x, w, b = _inputs(*SHAPES[1], rows=9)
    assert not torch.equal(rowdot.panel_product(w, b)(x), _reference(x, w, b, fused=False))


@pytest.mark.parametrize("build", rowdot.builds_here())
def test_every_row_count_gives_each_row_the_bits_of_one_call(build):
    lib, why = rowdot.load(build=build)
    assert lib is not None, why
    x, w, b = _inputs(70, 512, rows=100)
    run = rowdot.panel_product(w, b, lib)
    full = run(x)
    for rows in list(range(1, 18)) + [47, 48, 49, 97]:
        for at in (0, 3, 100 - rows):
            assert torch.equal(run(x[at:at + rows]), full[at:at + rows]), (rows, at)


def test_a_call_split_among_threads_gives_the_same_bits():
    x, w, b = _inputs(8192, 512, rows=70)  # 70 x 8192 x 512 multiply-adds: above SPLIT_MACS
    run = rowdot.panel_product(w, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(x)
        torch.set_num_threads(3)
        assert torch.equal(run(x), one)
    finally:
        torch.set_num_threads(threads)


def test_panels_of_another_shape_or_an_input_it_cannot_read_are_refused():
    x, w, b = _inputs(40, 16, rows=3)
    run = rowdot.panel_product(w, b)
    for bad in (x[:, :12], x.to(torch.bfloat16), x[0]):
        with pytest.raises(ValueError, match=r"rowdot: x must be \(M, 16\) fp32 on the CPU"):
            run(bad)
    with pytest.raises(ValueError, match=r"rowdot: panels of shape .* are not 40x16's for this build"):
        rowdot.panel_product(w, b, packed=rowdot.pack_panels(w[:8]))


HUGE_ADVICE = hasattr(mmap, "MADV_HUGEPAGE") and Path("/proc/self/smaps").is_file()


def test_a_large_weight_packs_to_the_same_panels_on_huge_pages_and_gives_the_same_bits():
    """A weight of several MiB (the `small` preset's are 2-10 MiB) is packed into memory advised
    for huge pages (`actors.pages`): only where it lies differs. The panels hold exactly the
    layout `pack_panels` defines (built here by padding and transposing in torch), and products
    on them give the bits of the same panels copied into plain memory at every row count."""
    out_f, in_f = 1000, 1100  # 4.4 MB; 1000 columns leave a ragged last panel on every build
    x, w, _ = _inputs(out_f, in_f, rows=37)
    lib, why = rowdot.load()
    assert lib is not None, why
    cols = lib.rowdot_panel_cols()  # 32 on AVX-512, 16 elsewhere
    packed = rowdot.pack_panels(w, lib)
    layout = F.pad(w, (0, 0, 0, (-out_f) % cols)).view(-1, cols, in_f).transpose(1, 2)
    assert torch.equal(packed, layout)
    plain = packed.clone()  # the same panels in torch.empty's memory
    on_huge, on_plain = rowdot.panel_product(w, None, lib, packed), rowdot.panel_product(w, None, lib, plain)
    for rows in (1, 8, 37):
        assert torch.equal(on_huge(x[:rows]), on_plain(x[:rows])), rows
    if HUGE_ADVICE:
        assert advised_for_huge_pages(packed)
        assert not advised_for_huge_pages(plain)  # negative control: torch's own memory is not


def test_huge_page_memory_only_for_tensors_that_span_a_huge_page():
    small, large = huge_page_empty((HUGE_PAGE // 4 - 1,)), huge_page_empty((HUGE_PAGE // 4 + 7,))
    assert small.is_contiguous() and large.is_contiguous() and large.data_ptr() % HUGE_PAGE == 0
    assert large.fill_(1.5).sum().item() == 1.5 * large.numel()  # every byte is writable memory
    assert not advised_for_huge_pages(small)  # under 2 MiB: plain torch.empty
    if HUGE_ADVICE:
        assert advised_for_huge_pages(large)
