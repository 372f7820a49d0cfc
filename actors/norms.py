"""RMSNorm in the three flavours the supported architectures use.

All normalise in fp32; they differ in where the weight is applied (they agree in fp32 up to the
(1 + w) offset, and differ in the last bits in bf16):
- "bamba" (Bamba, GraniteMoeHybrid): weight * normed.to(dtype);
- "fp32_weight" (NemotronH): (weight.float() * normed).to(dtype);
- "offset" (Qwen3.5, Qwen3-Next, Gemma-style): (normed * (1 + weight.float())).to(dtype); the stored weight
  is around 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actors import rowdot, triton_route

NORM_STYLES = ("bamba", "fp32_weight", "offset")
ARCH_NORM_STYLE = {"bamba": "bamba", "granitemoehybrid": "bamba", "nemotron_h": "fp32_weight",
                   "qwen3_5_text": "offset", "qwen3_next": "offset"}


TREE_LANES = 16  # the sum of squares' lanes (`rowdot_rms_norm` in actors/rowdot.c)


def inv_rms(h: Tensor, eps: float) -> Tensor:
    """h (..., n) -> 1 / sqrt(mean(h^2) + eps) over the last dim, (..., 1), a per-row reduction:
    on the CPU in one fixed tree order written out as elementwise steps (`tree_inv_rms`), which
    C can repeat bit for bit (`rowdot.rms_norm`, one call for the whole norm; ATen's `mean` sums
    in an order of its own); on CUDA a fixed-order Triton reduction, as torch's would split a row
    by the row count."""
    if triton_route.routes(h):
        return triton_route.inv_rms(h, eps)
    return tree_inv_rms(h, eps)


def tree_inv_rms(h: Tensor, eps: float) -> Tensor:
    """`inv_rms` in torch ops, in fp32, returned in h's dtype: the squares, zero-padded to blocks
    of `TREE_LANES`; blocks summed by halves (a zero block appended to an odd count) down to
    one; its lanes by halves; then rsqrt(sum * fp32(1/n) + eps). Elementwise products and sums
    only, so every kernel gives the bits `rowdot_rms_norm` gives. h (..., n) -> (..., 1)."""
    n = h.shape[-1]
    sq = torch.square(h.float())  # (..., n)
    blocks = F.pad(sq, (0, -n % TREE_LANES)).unflatten(-1, (-1, TREE_LANES))  # (..., m, lanes)
    while blocks.shape[-2] > 1:
        if blocks.shape[-2] % 2:
            blocks = F.pad(blocks, (0, 0, 0, 1))  # (..., m + 1, lanes)
        half = blocks.shape[-2] // 2
        blocks = blocks[..., :half, :] + blocks[..., half:, :]  # (..., m / 2, lanes)
    lanes = blocks[..., 0, :]  # (..., lanes)
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes.mul_(1.0 / n).add_(eps).rsqrt_().to(h.dtype)  # (..., 1)


def in_one_pass(x: Tensor, weight: Tensor | None = None) -> bool:
    """Whether `rowdot.rms_norm` takes this norm (the torch steps' bits, in one call): x and the
    weight contiguous fp32 on the CPU where rowdot loads, and not routed to Triton."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and x.numel() > 0
            and (weight is None or weight.dtype == torch.float32) and not triton_route.routes(x)
            and rowdot.available())


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x (..., n) -> fp32 x / rms(x) over the last dim (a per-row reduction)."""
    h = x.float()
    if in_one_pass(h):
        return rowdot.rms_norm(h, eps)
    return h * inv_rms(h, eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; `style` says how the weight is applied (see module doc)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, style: str = "bamba") -> None:
        super().__init__()
        if style not in NORM_STYLES:
            raise ValueError(f"RMSNorm style must be one of {NORM_STYLES}, got {style!r}")
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps, self.style = eps, style

    def forward(self, x: Tensor) -> Tensor:
        """x (..., size) -> (..., size) in the input dtype."""
        if in_one_pass(x, self.weight):  # fp32: the steps below in one call
            return rowdot.rms_norm(x, self.eps, self.weight, offset=self.style == "offset")
        h = rms_normalize(x, self.eps)  # (..., size) fp32
        if self.style == "bamba":
            return self.weight * h.to(x.dtype)
        if self.style == "fp32_weight":
            return (self.weight.float() * h).to(x.dtype)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
