"""Feed-forward blocks: SwiGLU, relu^2 MLP, and the two mixture-of-experts flavours.

Every block takes `x (T, hidden)` and a `Kernels` (matrix products through `kernels.linear`,
nonlinear elementwise functions through `kernels.pointwise`) and returns `(T, hidden)`.

Mixture of experts, batch-invariant: the router is per row; each expert runs `kernels.linear`
on the rows routed to it (in decode `tiled_linear`, whose row results do not depend on how many
rows it gets), and every row's expert outputs are added in expert-index order, so a row's
result does not depend on which other rows share the batch (tests/test_architectures.py checks
it, with a negative control). Top-k ties go to the lower expert index (`topk_stable`).

- `GraniteMoE` (GraniteMoeHybrid's `block_sparse_moe`): softmax over the top-k router logits,
  SwiGLU experts stored as 3-D tensors (`input_linear` (E, 2I, H): gate then up; `output_linear`
  (E, H, I)); the layer adds `GraniteSharedMLP` (`shared_mlp`).
- `NemotronMoE` (NemotronH's `mixer` of an "E" layer): DeepSeek-V3-style router (sigmoid scores,
  `e_score_correction_bias` added for the choice only, chosen scores normalised and scaled),
  relu^2 experts, a relu^2 shared expert; weighted sums in fp32.
- `QwenNextMoE` (Qwen3-Next's `mlp` of a sparse layer): softmax over all experts in fp32, top-k,
  renormalised; SwiGLU experts (`experts.{e}.gate_proj/up_proj/down_proj`); a SwiGLU
  `shared_expert` scaled by sigmoid(`shared_expert_gate`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actors import triton_route
from actors.batch import by_row_blocks
from actors.config import ModelConfig
from actors.mamba import Kernels, Pointwise, silu_


def _relu2(x: Tensor) -> Tensor:
    return torch.relu(x).square()


def topk_stable(scores: Tensor, k: int) -> Tensor:
    """Indices (T, k) of each row's k largest scores, largest first; ties to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def last_sum(x: Tensor) -> Tensor:
    """x (..., n) fp32 -> its sums over the last dim (..., 1): on CUDA in a fixed order (the
    Triton row sum; torch's reduction picks its order from the shape), elsewhere torch's."""
    if triton_route.routes(x):
        return triton_route.row_sum(x).unsqueeze(-1)
    return x.sum(-1, keepdim=True)


def softmax_rows(x: Tensor, pointwise: Pointwise) -> Tensor:
    """Softmax over the last dim with exp through `pointwise` (per-row reductions only)."""
    e = pointwise(torch.exp, x - x.max(-1, keepdim=True).values)
    return e / last_sum(e)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (`gate_proj`, `up_proj`, `down_proj`)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias, dtype=dtype)

    def forward(self, x: Tensor, kernels: Kernels = Kernels()) -> Tensor:
        """x (T, hidden) -> (T, hidden)."""
        linear = kernels.linear
        gate = linear(x, self.gate_proj.weight, self.gate_proj.bias)  # (T, I)
        up = linear(x, self.up_proj.weight, self.up_proj.bias)  # (T, I)
        act = by_row_blocks(lambda rows: torch.mul(kernels.pointwise(silu_, gate[rows]), up[rows], out=gate[rows]),
                            gate, out=gate)  # (T, I), written over gate block by block (SiLU in place)
        return linear(act, self.down_proj.weight, self.down_proj.bias)  # (T, hidden)


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2) (NemotronH's `-` layers and shared expert: `up_proj`, `down_proj`)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias, dtype=dtype)

    def forward(self, x: Tensor, kernels: Kernels = Kernels()) -> Tensor:
        """x (T, hidden) -> (T, hidden)."""
        up = kernels.linear(x, self.up_proj.weight, self.up_proj.bias)  # (T, I)
        return kernels.linear(kernels.pointwise(_relu2, up), self.down_proj.weight,
                              self.down_proj.bias)  # (T, hidden)


def _weight(*shape: int, dtype: torch.dtype) -> nn.Module:
    """A bare module holding one `weight` parameter (for Hugging Face's nested names)."""
    m = nn.Module()
    m.weight = nn.Parameter(torch.empty(shape, dtype=dtype))
    return m


def dispatch(x: Tensor, index: Tensor, weights: Tensor, num_experts: int, expert,
             out: Tensor) -> Tensor:
    """out[t] += weights[t, j] * expert(e, x[t]) for every chosen (t, j) with e = index[t, j].

    x (T, H), index and weights (T, k), out (T, H) (its dtype is the accumulation dtype).
    Experts go in index order and a row's terms are added in that order whatever the batch.
    """
    for e in range(num_experts):
        rows, pos = torch.where(index == e)  # (n,), (n,)
        if rows.numel() == 0:
            continue
        y = expert(e, x[rows])  # (n, H)
        out.index_add_(0, rows, (y * weights[rows, pos, None]).to(out.dtype))
    return out


class GraniteMoE(nn.Module):
    """GraniteMoeHybrid's `block_sparse_moe`: top-k softmax router and SwiGLU experts."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.top_k, self.intermediate = E, config.num_experts_per_tok, I
        self.router = nn.Module()
        self.router.layer = _weight(E, H, dtype=dtype)
        self.input_linear = _weight(E, 2 * I, H, dtype=dtype)
        self.output_linear = _weight(E, H, I, dtype=dtype)
        self._views: list[tuple[Tensor, Tensor]] = []

    def expert_weights(self, e: int) -> tuple[Tensor, Tensor]:
        """Expert e's (gate_up (2I, H), down (H, I)) as views made once, so kernels that cache
        per weight tensor (prepacked tiles) see the same tensors on every call."""
        if not self._views or self._views[0][0].data_ptr() != self.input_linear.weight.data_ptr():
            self._views = [(self.input_linear.weight[i], self.output_linear.weight[i])
                           for i in range(self.num_experts)]
        return self._views[e]

    def forward(self, x: Tensor, kernels: Kernels = Kernels()) -> Tensor:
        """x (T, hidden) -> (T, hidden)."""
        logits = kernels.linear(x, self.router.layer.weight, None).float()  # (T, E)
        index = topk_stable(logits, self.top_k)  # (T, k)
        weights = softmax_rows(logits.gather(1, index), kernels.pointwise).to(x.dtype)  # (T, k)

        def expert(e: int, rows: Tensor) -> Tensor:
            w_gate_up, w_down = self.expert_weights(e)
            gate, up = kernels.linear(rows, w_gate_up, None).split(self.intermediate, dim=-1)
            act = kernels.pointwise(F.silu, gate) * up  # (n, I)
            return kernels.linear(act, w_down, None)  # (n, H)

        return dispatch(x, index, weights, self.num_experts, expert, torch.zeros_like(x))


class GraniteSharedMLP(nn.Module):
    """GraniteMoeHybrid's `shared_mlp`: `input_linear` (2S, H) = [gate | up], `output_linear`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        H, S = config.hidden_size, config.shared_intermediate_size
        self.size = S
        self.input_linear = nn.Linear(H, 2 * S, bias=False, dtype=dtype)
        self.output_linear = nn.Linear(S, H, bias=False, dtype=dtype)

    def forward(self, x: Tensor, kernels: Kernels = Kernels()) -> Tensor:
        """x (T, hidden) -> (T, hidden)."""
        gate, up = kernels.linear(x, self.input_linear.weight, None).split(self.size, dim=-1)
        act = kernels.pointwise(F.silu, gate) * up  # (T, S)
        return kernels.linear(act, self.output_linear.weight, None)  # (T, hidden)


class NemotronMoE(nn.Module):
    """NemotronH's MoE mixer: `gate` (router, fp32, correction bias), `experts.{e}`, `shared_experts`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        E, H = config.num_experts, config.hidden_size
        self.num_experts, self.top_k = E, config.num_experts_per_tok
        self.scale, self.normalize = config.routed_scaling_factor, config.norm_topk_prob
        self.gate = _weight(E, H, dtype=torch.float32)
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(E, dtype=torch.float32))
        self.experts = nn.ModuleList(ReluSquaredMLP(H, config.moe_intermediate_size, False, dtype)
                                     for _ in range(E))
        self.shared_experts = ReluSquaredMLP(H, config.shared_intermediate_size, config.mlp_bias, dtype)

    def route(self, x: Tensor, kernels: Kernels) -> tuple[Tensor, Tensor]:
        """Chosen experts (T, k) and their fp32 weights (T, k)."""
        logits = kernels.linear(x.float(), self.gate.weight.float(), None)  # (T, E)
        scores = kernels.pointwise(torch.sigmoid, logits)  # (T, E)
        index = topk_stable(scores + self.gate.e_score_correction_bias.float(), self.top_k)
        weights = scores.gather(1, index)  # (T, k)
        if self.normalize:
            weights = weights / (last_sum(weights) + 1e-20)
        return index, weights * self.scale

    def forward(self, x: Tensor, kernels: Kernels = Kernels()) -> Tensor:
        """x (T, hidden) -> (T, hidden)."""
        index, weights = self.route(x, kernels)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # (T, H)
        out = dispatch(x, index, weights, self.num_experts,
                       lambda e, rows: self.experts[e](rows, kernels), out)
        return out.to(x.dtype) + self.shared_experts(x, kernels)  # (T, hidden)


class QwenNextMoE(nn.Module):
    """Qwen3-Next's sparse MoE block: `gate` (router), `experts.{e}`, `shared_expert(_gate)`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        E, H = config.num_experts, config.hidden_size
        self.num_experts, self.top_k, self.normalize = E, config.num_experts_per_tok, config.norm_topk_prob
        self.gate = _weight(E, H, dtype=dtype)
        self.experts = nn.ModuleList(SwiGLU(H, config.moe_intermediate_size, False, dtype) for _ in range(E))
        self.shared_expert = SwiGLU(H, config.shared_intermediate_size, False, dtype)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False, dtype=dtype)

    def forward(self, x: Tensor, kernels: Kernels = Kernels()) -> Tensor:
        """x (T, hidden) -> (T, hidden)."""
        logits = kernels.linear(x, self.gate.weight, None)  # (T, E)
        probs = softmax_rows(logits.float(), kernels.pointwise)  # (T, E) fp32
        index = topk_stable(probs, self.top_k)  # (T, k)
        weights = probs.gather(1, index)
        if self.normalize:
            weights = weights / last_sum(weights)
        out = dispatch(x, index, weights.to(x.dtype), self.num_experts,
                       lambda e, rows: self.experts[e](rows, kernels), torch.zeros_like(x))
        shared_gate = kernels.pointwise(torch.sigmoid,
                                        kernels.linear(x, self.shared_expert_gate.weight, None))  # (T, 1)
        return out + shared_gate * self.shared_expert(x, kernels)  # (T, hidden)
