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
from torch import Tensor, nn

from actors import triton_route

NORM_STYLES = ("bamba", "fp32_weight", "offset")
ARCH_NORM_STYLE = {"bamba": "bamba", "granitemoehybrid": "bamba", "nemotron_h": "fp32_weight",
                   "qwen3_5_text": "offset", "qwen3_next": "offset"}


def inv_rms(h: Tensor, eps: float) -> Tensor:
    """h (..., n) -> 1 / sqrt(mean(h^2) + eps) over the last dim, (..., 1) (a per-row reduction;
    `square` gives pow(2)'s bits at a third of its time on the CPU; on CUDA a fixed-order Triton
    reduction, as torch's would split a row by the row count)."""
    if triton_route.routes(h):
        return triton_route.inv_rms(h, eps)
    return torch.rsqrt(torch.square(h).mean(-1, keepdim=True) + eps)


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x (..., n) -> fp32 x / rms(x) over the last dim (a per-row reduction)."""
    h = x.float()
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
        h = rms_normalize(x, self.eps)  # (..., size) fp32
        if self.style == "bamba":
            return self.weight * h.to(x.dtype)
        if self.style == "fp32_weight":
            return (self.weight.float() * h).to(x.dtype)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
