"""The batch-invariant Triton kernels on a real GPU: what the interpreter cannot show.

    python -m benchmarks.triton_kernels_check              # on CUDA (compiles the kernels)
    TRITON_INTERPRET=1 python -m benchmarks.triton_kernels_check --device cpu   # a smoke run

tests/test_triton_kernels.py runs the kernels' structure through Triton's interpreter, whose
block product is numpy's. On a GPU the block product is the compiled `tl.dot` (fp32: FMA,
no TF32; bf16: tensor cores) and the row reductions are Triton's own trees, so this checks,
per kernel and dtype, one line each (`PASS|FAIL <name>: <detail>`), a non-zero exit if any
failed:
- row-free: a row's output torch.equal alone and in batches of 2, 7 and 32, at the first, a
  middle and the last row, for `small`-sized shapes (K = 512, 1408; N up to 8192);
- close: within the stated tolerance of its torch `_ref` twin;
- control: the same kernel with another BLOCK_K differs in the bits on some row (the check
  can see an order change; fp32), and so does F.linear (cuBLAS) alone vs batched, as the H200
  run of issue 32 saw (a FAIL there only says cuBLAS held on this shape: informative, it does
  not fail the run);
- speed: the Triton matmul's time against F.linear's at 1, 8, 32 and 2,048 rows, side by side.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from actors import triton_kernels as tk

SHAPES = [(512, 1408), (1408, 512), (512, 8192)]  # (K, N): `small`'s MLP up / down, its LM head
CPU_SHAPES = [(96, 80)]  # the interpreter's smoke run: one partial tile on each axis
BATCH_SIZES = (2, 7, 32)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -6)}


def _row_free(fn, x: torch.Tensor) -> bool:
    """fn's row 0 of x (32, ...) torch.equal alone and in batches of 2, 7 and 32 at 3 places."""
    alone = fn(x[:1])[0]
    for size in BATCH_SIZES:
        for where in sorted({0, size // 2, size - 1}):
            batch = torch.cat([x[1:size][:where], x[:1], x[1:size][where:]])
            if not torch.equal(fn(batch)[where], alone):
                return False
    return True


def _linear_checks(dev: str, dtype: torch.dtype) -> list[tuple[str, bool, str]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for K, N in SHAPES if dev == "cuda" else CPU_SHAPES:
        x = torch.randn(32, K, generator=gen).to(dev, dtype)
        w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dev, dtype)
        name = f"linear {K}x{N} {str(dtype)[6:]}"
        out.append((f"{name} row-free", _row_free(lambda r: tk.linear(r, w), x), ""))
        diff = (tk.linear(x, w).float() - tk.linear_ref(x, w).float()).abs().max().item()
        close = torch.allclose(tk.linear(x, w).float(), tk.linear_ref(x, w).float(), **TOL[dtype])
        out.append((f"{name} close", close, f"max |diff| {diff:.2e}"))
        if dtype == torch.float32:  # (bf16's output rounding can hide a last-bit change)
            other = tk.linear(x, w, None, tk.TileConfig(block_k=16))
            out.append((f"{name} control block_k", not torch.equal(other, tk.linear(x, w)), ""))
        out.append((f"{name} control F.linear differs", not _row_free(lambda r: F.linear(r, w), x),
                    "informative"))
    return out


def _row_checks(dev: str) -> list[tuple[str, bool, str]]:
    x = torch.randn(32, 1408 if dev == "cuda" else 300, generator=torch.Generator().manual_seed(1)).to(dev)
    a = torch.randn(32, 2, 32, generator=torch.Generator().manual_seed(2)).to(dev)
    b = torch.randn(32, 32, generator=torch.Generator().manual_seed(3)).to(dev)
    return [("row_sum row-free", _row_free(tk.row_sum, x), ""),
            ("inv_rms row-free", _row_free(lambda r: tk.inv_rms(r, 1e-6), x), ""),
            ("bmm row-free", _row_free(lambda z: tk.bmm(z, b.expand(z.shape[0], -1, -1)), a), ""),
            ("row_sum close", torch.allclose(tk.row_sum(x), tk.row_sum_ref(x), 1e-5, 1e-3), ""),
            ("inv_rms close", torch.allclose(tk.inv_rms(x, 1e-6), tk.inv_rms_ref(x, 1e-6), 1e-5, 1e-6), ""),
            ("row_sum control width", not torch.equal(tk.row_sum(x, block=32), tk.row_sum(x)), "")]


def _ms(fn, dev: str, reps: int = 20) -> float:
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def _speed(dev: str) -> None:
    w = torch.randn(1408, 512, device=dev)
    for rows in (1, 8, 32, 2048):
        x = torch.randn(rows, 512, device=dev)
        ours, cublas = _ms(lambda: tk.linear(x, w), dev), _ms(lambda: F.linear(x, w), dev)
        print(f"speed linear 512x1408 fp32, {rows} rows: triton {ours:.3f} ms, "
              f"F.linear {cublas:.3f} ms, ratio {ours / cublas:.2f}x")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    dev = parser.parse_args(argv).device
    if dev == "cuda" and not torch.cuda.is_available():
        print("triton_kernels_check: no CUDA device here (use --device cpu with TRITON_INTERPRET=1)")
        return 2
    results = _row_checks(dev)
    for dtype in (torch.float32, torch.bfloat16):
        results += _linear_checks(dev, dtype)
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
    if dev == "cuda":
        _speed(dev)
    return int(any(not ok and "F.linear" not in name for name, ok, _ in results))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
