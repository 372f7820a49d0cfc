"""Batch-invariant Triton kernels for the CUDA forward path, each beside a pure-torch `_ref` twin.

On a GPU, cuBLAS and torch's reduction kernels pick their algorithm from the shape of the
whole call (split-K, the tile, how many threads share one row's reduction), so a row's
reduction order, and so its bits, follows the number of rows it is batched with. These kernels
fix the order by construction:

- `linear` / `bmm`: one tile config (`MATMUL`: BLOCK_M/N/K, warps, stages), chosen without
  looking at M; each program computes one (BLOCK_M, BLOCK_N) output tile over the whole K axis
  in ascending BLOCK_K steps (no split-K), accumulating in fp32 (`tl.dot`, `input_precision=
  "ieee"`: no TF32; bf16 operands on tensor cores into the fp32 accumulator). A row's result
  depends on its own data, the weights and K only: the row count only changes how many
  programs run. Under the interpreter the block product is a broadcast multiply summed over k
  in order (operands widened to fp32): the interpreter's `dot` is numpy's matmul, which rounds
  a row by its place in the block (OpenBLAS's micro-tiles) and takes no bf16, so it would test
  numpy, not the kernel. The interpreter so shows the kernel's structure (tiles, K loop, masks,
  grid); that the GPU's `tl.dot` rounds every row of a tile alike is the GPU check's to show.
- `row_sum` / `inv_rms`: `ROWS_PER_PROGRAM` rows per program; each row is read in
  `ROW_BLOCK`-wide steps into its own lane-wise fp32 accumulator, then reduced across its
  lanes by one tree of a fixed shape, the same for every row of the block.

The grid never splits a row's reduction, so nothing a program does depends on how many
programs there are. `actors.triton_route` decides when the model calls these (it never imports
triton on the CPU path). On a CPU, Triton's interpreter (`TRITON_INTERPRET=1`, set before this
module is imported) runs the same kernels on CPU tensors; tests/test_triton_kernels.py does so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True)
class TileConfig:
    """One matmul schedule; `MATMUL` is the only one the model uses (others exist for tests)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two, got {value}")


MATMUL = TileConfig()
ROW_BLOCK = 128  # lanes of a row reduction's accumulator
ROWS_PER_PROGRAM = 16  # rows one row-reduction program takes (each reduced alike)
MAX_BATCH = 65535  # a CUDA grid's second axis (bmm's batch) holds at most this many per launch


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K,
                   s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """c[z] = a[z] @ b[z] (+ bias): one (BLOCK_M, BLOCK_N) tile of batch z per program, the K
    axis in ascending BLOCK_K steps into one fp32 accumulator."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n, z = tl.program_id(0) // tiles_n, tl.program_id(0) % tiles_n, tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    rk = tl.arange(0, BLOCK_K)  # (BK,)
    a_rows = a_ptr + z * s_ab + rm[:, None] * s_am  # (BM, 1)
    b_cols = b_ptr + z * s_bb + rn[None, :] * s_bn  # (1, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(a_rows + ks[None, :] * s_ak, mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_cols + ks[:, None] * s_bk, mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0)
        if INTERPRETED:  # numpy's matmul rounds a row by its place in the block: k in order
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        else:  # fp32: FMA in k order (no TF32); bf16: tensor cores, fp32 accumulator
            acc = tl.dot(a, b, acc, input_precision="ieee")  # (BM, BN)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + z * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _launch_matmul(a: Tensor, b: Tensor, bias: Tensor | None, out: Tensor,
                   config: TileConfig = MATMUL) -> Tensor:
    """out[z] = a[z] @ b[z] (+ bias) for a (Z, M, K), b (Z, K, N), out (Z, M, N) (any strides).

    Batches beyond the grid's `MAX_BATCH` go in several launches: every z is its own programs,
    so the split changes no bits."""
    Z, M, K = a.shape
    N = b.shape[-1]
    if out.numel() == 0:
        return out  # (a CUDA grid of no programs does not launch)
    tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    for z in range(0, Z, MAX_BATCH):
        part = slice(z, z + MAX_BATCH)
        _matmul_kernel[(tiles, min(MAX_BATCH, Z - z))](
            a[part], b[part], bias if bias is not None else out, out[part], M, N, K,
            *a.stride(), *b.stride(), *out.stride(), HAS_BIAS=bias is not None,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            INTERPRETED=bool(triton.knobs.runtime.interpret), num_warps=config.num_warps,
            num_stages=config.num_stages)
    return out


def _check_dtypes(name: str, *tensors: Tensor) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
        raise TypeError(f"triton {name}: operands must share one float dtype (fp32, bf16, fp16), "
                        f"got {sorted(str(d) for d in dtypes)}")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           config: TileConfig = MATMUL) -> Tensor:
    """x (..., K) @ weight (N, K)^T + bias (N,) -> (..., N) in x's dtype (F.linear's contract)."""
    _check_dtypes("linear", x, weight)
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)  # (M, N)
    _launch_matmul(rows[None], weight.t()[None], bias, out[None], config)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None,
               config: TileConfig = MATMUL) -> Tensor:
    """`linear` in torch: fp32 products, one rounding to x's dtype (config ignored)."""
    out = x.float() @ weight.float().t()  # (..., N)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def bmm(a: Tensor, b: Tensor, config: TileConfig = MATMUL) -> Tensor:
    """a (Z, M, K) @ b (Z, K, N) -> (Z, M, N) in a's dtype (torch.bmm's contract)."""
    _check_dtypes("bmm", a, b)
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    return _launch_matmul(a, b, None, out, config)


def bmm_ref(a: Tensor, b: Tensor, config: TileConfig = MATMUL) -> Tensor:
    """`bmm` in torch, fp32 (config ignored)."""
    return torch.bmm(a.float(), b.float()).to(a.dtype)


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, R, n, n_float, eps, SQUARE_RMS: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK: tl.constexpr):
    """out[r] = sum(x[r]) (SQUARE_RMS: 1 / sqrt(sum(x[r]^2) / n + eps)), fp32, for ROWS rows per
    program: each row in BLOCK-wide steps into its own lanes, then one tree across them."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    lanes = tl.arange(0, BLOCK)  # (BLOCK,)
    starts = x_ptr + rows.to(tl.int64)[:, None] * n  # (ROWS, 1)
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + lanes
        v = tl.load(starts + cols[None, :], mask=(rows[:, None] < R) & (cols[None, :] < n),
                    other=0.0).to(tl.float32)  # (ROWS, BLOCK)
        acc += v * v if SQUARE_RMS else v
    total = tl.sum(acc, axis=1)  # (ROWS,)
    if SQUARE_RMS:
        total = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(total, n_float) + eps))  # IEEE-rounded
    tl.store(out_ptr + rows, total, mask=rows < R)


def _row_reduce(x: Tensor, square_rms: bool, eps: float, block: int) -> Tensor:
    """x (..., n) -> fp32 (...) through `_row_sum_kernel`, `ROWS_PER_PROGRAM` rows per program."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (R, n)
    R = rows.shape[0]
    out = torch.empty(R, dtype=torch.float32, device=x.device)  # (R,)
    if R:
        grid = (triton.cdiv(R, ROWS_PER_PROGRAM),)
        _row_sum_kernel[grid](rows, out, R, rows.shape[1], float(rows.shape[1]), eps,
                              SQUARE_RMS=square_rms, ROWS=ROWS_PER_PROGRAM, BLOCK=block,
                              num_warps=4)
    return out.view(x.shape[:-1])


def row_sum(x: Tensor, block: int = ROW_BLOCK) -> Tensor:
    """Sum over the last dim: x (..., n) -> (...) fp32."""
    return _row_reduce(x, False, 0.0, block)


def row_sum_ref(x: Tensor, block: int = ROW_BLOCK) -> Tensor:
    """`row_sum` in torch (block ignored)."""
    return x.float().sum(-1)


def inv_rms(h: Tensor, eps: float, block: int = ROW_BLOCK) -> Tensor:
    """h (..., n) -> 1 / sqrt(mean(h^2) + eps) over the last dim, fp32 (..., 1) (norms.inv_rms)."""
    return _row_reduce(h, True, eps, block)[..., None]


def inv_rms_ref(h: Tensor, eps: float, block: int = ROW_BLOCK) -> Tensor:
    """`inv_rms` in torch (block ignored)."""
    return torch.rsqrt(torch.square(h.float()).mean(-1, keepdim=True) + eps)
