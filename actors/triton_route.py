"""Which tensors the forward sends through the batch-invariant Triton kernels (`actors.triton_kernels`).

The rule is automatic: tensors on a device in `ROUTED_DEVICES` (CUDA) take the Triton kernels
for every reduction whose order torch's own kernels would pick from the batch shape (matrix
products of a batch-invariant model, the row reductions of the norms, the attention softmax
sum, the SSM and delta-rule readouts); everything else, and every CPU tensor, runs the code it
ran before. This module never imports triton itself: `actors.triton_kernels` is imported at the
first routed call, so the CPU path neither needs triton nor pays its import.

Tests widen `ROUTED_DEVICES` to ("cuda", "cpu") with Triton's interpreter on, to run the CUDA
path's arithmetic on CPU tensors (tests/test_triton_kernels.py).
"""

from __future__ import annotations

from types import ModuleType

from torch import Tensor

ROUTED_DEVICES: tuple[str, ...] = ("cuda",)


def routes(t: Tensor) -> bool:
    """Does the forward send `t`'s products and row reductions through the Triton kernels?"""
    return t.device.type in ROUTED_DEVICES


def kernels() -> ModuleType:
    """`actors.triton_kernels`, imported on first use (one clear line where triton is missing)."""
    try:
        from actors import triton_kernels
    except ImportError as err:
        raise RuntimeError(f"batch-invariant CUDA kernels need triton (pip install triton): {err}") from err
    return triton_kernels


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear through the fixed-tile Triton matmul: x (..., K), weight (N, K) -> (..., N)."""
    return kernels().linear(x, weight, bias)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """torch.bmm through the fixed-tile Triton matmul: (Z, M, K) @ (Z, K, N) -> (Z, M, N)."""
    return kernels().bmm(a, b)


def row_sum(x: Tensor) -> Tensor:
    """x (..., n) -> fp32 sum over the last dim (...), in a fixed order."""
    return kernels().row_sum(x)


def inv_rms(h: Tensor, eps: float) -> Tensor:
    """h (..., n) -> fp32 1 / sqrt(mean(h^2) + eps) (..., 1), in a fixed order."""
    return kernels().inv_rms(h, eps)
