"""`actors.rowdot`: fp32 products whose rows are bit-identical whatever the call's row count.

Held here, against an independent float64 reference: every row of every call, at any row
count and offset, equals that row of one large call, on every build this CPU runs (the
AVX-512 one where it has AVX-512F, the AVX2 one, the portable one); a split among threads
changes no bit. The AVX-512 source is compile-checked on any CPU whose compiler targets it
(and holds 512-bit instructions, where objdump can tell), and refused, in one line, where
the CPU cannot run it. The negative control: the builds round differently (fused
multiply-add or not), and the same equality check sees it, so a change in a row's order of
operations would not pass unseen. The fallback: with the kernel switched off, or no working
compiler, the model takes MKL's probed path and says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from actors import rowdot
from actors.cpu_info import cpu_flags
from actors.model import TiledLinear, kernel_paths

SHAPES = [(96, 64), (13, 37), (1408, 512), (40, 9)]  # (out, in): K % 8 and N % 8 tails included
ROWS = 70

pytestmark = pytest.mark.skipif(not rowdot.available(), reason=f"rowdot: {rowdot.unavailable_reason()}")


def _inputs(out_f: int, in_f: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, in_f, generator=g), torch.randn(out_f, in_f, generator=g),
            torch.randn(out_f, generator=g))


def _row_free(lib, x, w, b) -> torch.Tensor:
    """The full call's result, after checking every sub-call's rows equal its rows."""
    full = rowdot.linear(x, w, b, lib)
    for rows in list(range(1, 18)) + [31, 48, 49, 69]:
        for at in (0, 3, ROWS - rows):
            part = rowdot.linear(x[at:at + rows], w, b, lib)
            assert torch.equal(part, full[at:at + rows]), (rows, at)
    return full


@pytest.mark.parametrize("build", rowdot.builds_here())
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_every_row_count_gives_each_row_the_same_bits_and_the_float64_value(shape, build):
    lib, why = rowdot.load(build=build)
    assert lib is not None, why
    x, w, b = _inputs(*shape)
    full = _row_free(lib, x, w, b)
    reference = F.linear(x.double(), w.double(), b.double())
    assert torch.allclose(full.double(), reference, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)
    assert torch.equal(rowdot.linear(x, w, None, lib) + b, full)  # the bias: one fp32 add, last


def test_a_call_split_among_threads_gives_the_same_bits():
    x, w, b = _inputs(8192, 512)  # 70 x 8192 x 512 multiply-adds: above SPLIT_MACS
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rowdot.linear(x, w, b)
        torch.set_num_threads(3)
        assert torch.equal(rowdot.linear(x, w, b), one)
    finally:
        torch.set_num_threads(threads)


def test_an_input_the_kernel_cannot_read_is_refused_before_the_c_call():
    """The kernel reads raw pointers: an x of another width or dtype would be read out of bounds
    or as the wrong numbers. `product` checks the weight once and each x on every call."""
    x, w, b = _inputs(8, 16)
    run = rowdot.product(w, b)
    assert torch.equal(run(x), rowdot.linear(x, w, b))
    for bad in (x[:, :12], x.to(torch.bfloat16), x[0], x.double()):
        with pytest.raises(ValueError, match=r"rowdot: x must be \(M, 16\) fp32 on the CPU"):
            run(bad)
    with pytest.raises(ValueError, match=r"rowdot: the bias has shape \(7,\), the weight 8 rows"):
        rowdot.product(w, b[:7])


def test_negative_control_the_builds_round_differently_and_the_check_sees_it():
    if rowdot.variant() == "portable":
        pytest.skip("this CPU runs the portable build: no second build to tell apart")
    portable, why = rowdot.load(portable=True)
    assert portable is not None, why
    x, w, b = _inputs(1408, 512)
    native, other = rowdot.linear(x, w, b), rowdot.linear(x, w, b, portable)
    assert not torch.equal(native, other)  # one rounding per multiply-add against two


def test_the_avx512_build_compiles_here_and_loads_only_where_the_cpu_has_it():
    path, why = rowdot.compile_only("avx512f")
    if path is None and "failed" in (why or ""):
        pytest.skip(f"this compiler does not target AVX-512: {why}")
    assert path is not None, why
    objdump = shutil.which("objdump")
    if objdump:
        assert "zmm" in subprocess.run([objdump, "-d", str(path)], capture_output=True, text=True).stdout
    lib, why = rowdot.load(build="avx512f")
    if "avx512f" in cpu_flags():
        assert lib is not None and lib.rowdot_variant() == b"avx512f", why
    else:
        assert lib is None and why.startswith("this CPU cannot run rowdot's 'avx512f' build"), why


def test_the_model_path_runs_the_forced_build_and_says_so():
    x, w, b = _inputs(96, 64)
    assert torch.equal(TiledLinear(16, kernel=f"rowdot {rowdot.variant()}")(x, w, b), rowdot.linear(x, w, b))
    assert kernel_paths()["96x64 fp32 decode"].startswith(f"rowdot {rowdot.variant()}")


@pytest.mark.parametrize("env, why", [({"RAYSCHED_ROWDOT": "0"}, "RAYSCHED_ROWDOT=0"),
                                      ({"CC": "false"}, "false failed")])
def test_without_the_kernel_products_take_the_probed_path_and_say_why(env, why, tmp_path):
    code = ("import torch; from actors import rowdot; from actors.model import TiledLinear, kernel_paths;"
            "x, w = torch.randn(5, 64), torch.randn(96, 64); TiledLinear(16)(x, w, None);"
            "print(rowdot.available(), rowdot.unavailable_reason(), sorted(kernel_paths().values()), sep='|')")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY", "CC"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**clean, "RAYSCHED_KERNEL_CACHE": str(tmp_path), **env})
    assert out.returncode == 0, out.stderr
    available, reason, paths = out.stdout.strip().split("|")
    assert available == "False" and why in reason and "rowdot" not in paths, out.stdout
    assert "rowdot kernel not used" in out.stderr


def test_a_cache_directory_that_cannot_be_written_falls_back_to_a_temporary_one():
    code = "from actors import rowdot; print(rowdot.available(), rowdot.unavailable_reason(), sep='|')"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY", "CC"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**clean, "RAYSCHED_KERNEL_CACHE": "/proc/raysched-cannot-be-made"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True|None", out.stdout
