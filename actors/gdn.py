"""Gated delta net (Qwen3.5 / Qwen3-Next "linear_attention" layers): free functions + the mixer.

Stages, in order:

    in_proj_qkv(h) -> [q | k | v]   (q, k: k_heads x d_k; v: v_heads x d_v)
    causal depthwise conv over q, k, v (kernel k, no bias), then SiLU
    q, k  = l2norm(q), l2norm(k) per head (fp32), repeated from k_heads to v_heads; q *= d_k^-1/2
    beta  = sigmoid(in_proj_b(h));  g = -exp(A_log) * softplus(in_proj_a(h) + dt_bias)   (per v head)
    delta rule, per v head, state S (d_k, d_v) in fp32:
        S = exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S = S + k_t u_t^T;  o_t = S^T q_t
    gated RMSNorm per v head: norm(o) * weight, times silu(in_proj_z(h))   (gate after the norm)
    out_proj

The per-request state is the conv state (conv_dim, k - 1) in the model dtype and the recurrent
state (v_heads, d_k, d_v) in fp32 (transformers' layout). Prefill runs one sequence in chunks
(`gdn_chunked`; `gdn_sequential_ref` is its token-by-token twin); decode runs one token per
request (`gdn_step`) with per-row reductions over the last dim only and nonlinear functions
through `Kernels.pointwise`, so a request's result does not depend on its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actors import triton_route
from actors.config import ModelConfig
from actors.batch import Segment
from actors.mamba import (Kernels, Marks, Pointwise, SlotRun, causal_conv_step, conv_segments, conv_taps, decay_exp_,
                          derived, scan_chunk, scan_segments, whole)
from actors.norms import rms_normalize


# ---------------------------------------------------------------------------- the delta rule
def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / ||x|| over the last dim, fp32 (eps inside the root, as the reference kernels do)."""
    x = x.float()
    if triton_route.routes(x):  # CUDA: a fixed-order row sum
        return x * torch.rsqrt(triton_route.row_sum(x * x)[..., None] + eps)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _sum_last(t: Tensor) -> Tensor:
    """t (..., n) fp32 -> (...) its sum over the last dim (CUDA: a fixed-order Triton row sum)."""
    return triton_route.row_sum(t) if triton_route.routes(t) else t.contiguous().sum(-1)


def prepare_qk(q: Tensor, k: Tensor, v_heads: int) -> tuple[Tensor, Tensor]:
    """L2-normalise q, k (T, Hk, dk), repeat to v heads, scale q by dk^-1/2: (T, Hv, dk) fp32 each."""
    rep = v_heads // q.shape[-2]
    q = l2norm(q).repeat_interleave(rep, dim=-2) * q.shape[-1] ** -0.5
    return q, l2norm(k).repeat_interleave(rep, dim=-2)


def gdn_sequential_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int,
                       initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Reference delta rule, one token at a time (twin of `gdn_chunked`; chunk_size ignored).

    q, k (L, H, dk) prepared (`prepare_qk`), v (L, H, dv), g and beta (L, H). Returns
    y (L, H, dv) and the final state (H, dk, dv), both fp32.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    state = _start(k, v, initial_state)  # (H, dk, dv)
    ys = []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t])[:, None, None]  # (H, dk, dv)
        u = (v[t] - (state * k[t][:, :, None]).sum(-2)) * beta[t][:, None]  # (H, dv)
        state = state + k[t][:, :, None] * u[:, None, :]  # (H, dk, dv)
        ys.append((state * q[t][:, :, None]).sum(-2))  # (H, dv)
    return torch.stack(ys) if ys else v.new_zeros(v.shape, dtype=torch.float32), state


def _start(k: Tensor, v: Tensor, initial_state: Tensor | None) -> Tensor:
    if initial_state is not None:
        return initial_state.float().clone()
    return torch.zeros(k.shape[1], k.shape[2], v.shape[2], dtype=torch.float32, device=k.device)


def gdn_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int,
                initial_state: Tensor | None = None, marks: list | None = None) -> tuple[Tensor, Tensor]:
    """Chunked delta rule for one sequence of any length (zero-padded to whole chunks).

    Same arguments and results as `gdn_sequential_ref`. Within a chunk, with cumulative log-decay
    c_i and Gamma_ij = exp(c_i - c_j) (i >= j), the corrections u solve the unit lower-triangular
    system (I + A) u = beta v - beta k exp(c) S0 with A_ij = beta_i (k_i . k_j) Gamma_ij (i > j);
    then o_i = exp(c_i) q_i S0 + sum_{j<=i} (q_i . k_j) Gamma_ij u_j and the state carried to the
    next chunk is exp(c_C) S0 + sum_j exp(c_C - c_j) k_j u_j^T. Padded steps (g = beta = 0) leave
    the state unchanged. With `marks`, appends the states entering each chunk (`Marks`, every
    `chunk_size`).
    """
    L, H, dk = k.shape
    qc, kc, vc, gc, bc = _chunks(q, k, v, g, beta, chunk_size)  # (H,n,C,dk)x2 (H,n,C,dv) (H,n,C)x2
    cum = gc.cumsum(-1)  # (H, n, C)
    decay = _pair_decay(cum)  # (H, n, C, C), zero above the diagonal
    kb = kc * bc[..., None]  # (H, n, C, dk)
    strict = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device), -1)
    A = ((kb @ kc.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)  # (H, n, C, C)
    system = A + torch.eye(chunk_size, device=k.device)  # unit lower triangular
    u0 = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False,
                                      unitriangular=True)  # (H, n, C, dk)
    scores = (qc @ kc.transpose(-1, -2)) * decay  # (H, n, C, C), causal incl. the diagonal
    q_decayed = qc * cum.exp()[..., None]  # (H, n, C, dk)
    k_to_end = kc * (cum[..., -1:] - cum).exp()[..., None]  # (H, n, C, dk)
    state, ys, starts = _start(k, v, initial_state), [], []
    for i in range(qc.shape[1]):
        starts.append(state)  # (a new tensor each chunk: kept by reference)
        u = u0[:, i] - w[:, i] @ state  # (H, C, dv)
        ys.append(q_decayed[:, i] @ state + scores[:, i] @ u)  # (H, C, dv)
        state = state * cum[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    y = torch.stack(ys, dim=1).reshape(H, -1, v.shape[-1])[:, :L]  # (H, L, dv)
    if marks is not None:
        marks.append(Marks(chunk_size, L, lambda r: starts[r // chunk_size]))  # (H, dk, dv)
    return y.transpose(0, 1).contiguous(), state  # (L, H, dv), (H, dk, dv)


def _chunks(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
            C: int) -> tuple[Tensor, ...]:
    """fp32, zero-padded to whole chunks, heads first: (H, n, C, ...)."""
    pad = (-q.shape[0]) % C

    def split(t: Tensor) -> Tensor:
        t = F.pad(t.float(), (0, 0) * (t.dim() - 1) + (0, pad))  # (L', H, ...)
        t = t.movedim(0, 1)  # (H, L', ...)
        return t.reshape(t.shape[0], -1, C, *t.shape[2:])

    return tuple(split(t) for t in (q, k, v, g, beta))


def _pair_decay(cum: Tensor) -> Tensor:
    """exp(cum_i - cum_j) for i >= j, 0 above the diagonal: (..., C) -> (..., C, C)."""
    C = cum.shape[-1]
    upper = torch.triu(torch.ones(C, C, dtype=torch.bool, device=cum.device), 1)
    return decay_exp_(cum[..., :, None] - cum[..., None, :]).masked_fill_(upper, 0.0)


def gdn_step(state: Tensor, slots: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
             pointwise: Pointwise = whole) -> Tensor:
    """One decode token per request: update `state[slots]` in place and return y (R, H, dv) fp32.

    state (S, H, dk, dv) fp32 (one layer of the pool), slots (R,), q and k (R, H, dk) prepared,
    v (R, H, dv), g and beta (R, H). Elementwise products and sums over the last dim only.
    """
    S = state[slots] * pointwise(torch.exp, g.float())[..., None, None]  # (R, H, dk, dv)
    S_t = S.transpose(-1, -2)  # (R, H, dv, dk)
    kv = _sum_last(S_t * k[:, :, None, :])  # (R, H, dv)
    u = (v.float() - kv) * beta.float()[..., None]  # (R, H, dv)
    S = S + k[..., None] * u[:, :, None, :]  # (R, H, dk, dv)
    state[slots] = S
    return _sum_last(S.transpose(-1, -2) * q[:, :, None, :])  # (R, H, dv)


# ---------------------------------------------------------------------------- the mixer
class GatedDeltaNet(nn.Module):
    """Weights of one gated-delta-net mixer, under Hugging Face Qwen3.5's names (`linear_attn.*`).

    `prefill` and `decode` take the layer's slice of the pool: conv (S, conv_dim, k-1) in the
    model dtype and state (S, v_heads, d_k, d_v) in fp32 (same signatures as `MambaMixer`).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c, H, Hv = config, config.hidden_size, config.linear_num_value_heads
        self.config = c
        self.in_proj_qkv = nn.Linear(H, c.gdn_conv_dim, bias=False, dtype=dtype)
        self.in_proj_z = nn.Linear(H, c.gdn_value_dim, bias=False, dtype=dtype)
        self.in_proj_b = nn.Linear(H, Hv, bias=False, dtype=dtype)
        self.in_proj_a = nn.Linear(H, Hv, bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(c.gdn_conv_dim, c.gdn_conv_dim, c.linear_conv_kernel_dim,
                                groups=c.gdn_conv_dim, bias=False, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(Hv, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(Hv, dtype=dtype))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(c.linear_value_head_dim, dtype=dtype))
        self.out_proj = nn.Linear(c.gdn_value_dim, H, bias=False, dtype=dtype)

    def prefill(self, h: Tensor, segments: list[Segment], conv_state: Tensor, state: Tensor,
                kernels: Kernels = Kernels()) -> Tensor:
        """The next tokens of each sequence (rows of h (T, hidden), concatenated), from the
        conv/recurrent state at each one's slot (zero state for a fresh one); writes each one's
        final state there (same contract as `MambaMixer.prefill`). -> (T, hidden).
        """
        qkv, z, b, a = self._project(h, kernels)
        qkv = conv_segments(qkv, segments, conv_state, self.conv1d.weight, None,
                            kernels.pointwise, kernels.conv_prefill)  # (T, conv_dim)
        q, k, v = self._split(qkv)
        g, beta = self._gates(a, b, kernels.pointwise)  # (T, Hv) each
        chunk = scan_chunk(self.config.linear_chunk_size, h.device)
        y = scan_segments(segments, state, lambda rows, s0, marks: gdn_chunked(
            q[rows], k[rows], v[rows], g[rows], beta[rows], chunk, s0, marks))  # (T, Hv, dv)
        return self._output(y, z, kernels)

    def decode(self, h: Tensor, conv_state: Tensor, state: Tensor, slots: Tensor,
               kernels: Kernels, run: SlotRun = None) -> Tensor:
        """One token per request, updating the conv/recurrent state at `slots` (R,) (`run`: the
        same as one ascending run, `ForwardBatch.mamba_run`). h (R, hidden)."""
        pw = kernels.pointwise
        qkv, z, b, a = self._project(h, kernels)
        qkv = causal_conv_step(conv_state, slots, qkv, self.conv1d.weight, None, pw, run,
                               taps=derived(self, "taps", self.conv1d.weight, conv_taps))  # (R, conv_dim)
        q, k, v = self._split(qkv)
        g, beta = self._gates(a, b, pw)
        y = gdn_step(state, slots, q, k, v, g, beta, pw)  # (R, Hv, dv)
        return self._output(y, z, kernels)

    def _project(self, h: Tensor, kernels: Kernels) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """qkv (T, conv_dim), z (T, value_dim), b and a (T, Hv)."""
        lin = kernels.linear
        return (lin(h, self.in_proj_qkv.weight, None), lin(h, self.in_proj_z.weight, None),
                lin(h, self.in_proj_b.weight, None), lin(h, self.in_proj_a.weight, None))

    def _split(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """qkv (T, conv_dim) -> prepared q, k (T, Hv, dk) fp32 and v (T, Hv, dv)."""
        c, T = self.config, qkv.shape[0]
        q, k, v = qkv.split([c.gdn_key_dim, c.gdn_key_dim, c.gdn_value_dim], dim=-1)
        q, k = prepare_qk(q.reshape(T, c.linear_num_key_heads, -1),
                          k.reshape(T, c.linear_num_key_heads, -1), c.linear_num_value_heads)
        return q, k, v.reshape(T, c.linear_num_value_heads, c.linear_value_head_dim)

    def _gates(self, a: Tensor, b: Tensor, pointwise: Pointwise) -> tuple[Tensor, Tensor]:
        """Log-decay g = -exp(A_log) softplus(a + dt_bias) (fp32) and beta = sigmoid(b): (T, Hv)."""
        g = -torch.exp(self.A_log.float()) * pointwise(F.softplus, a.float() + self.dt_bias)
        return g, pointwise(torch.sigmoid, b)

    def _output(self, y: Tensor, z: Tensor, kernels: Kernels) -> Tensor:
        """Gated RMSNorm per v head (norm, weight, then * silu(z)) and out_proj. y (T, Hv, dv) fp32."""
        c, T, dtype = self.config, y.shape[0], z.dtype
        normed = rms_normalize(y, c.rms_norm_eps)  # (T, Hv, dv) fp32
        gate = kernels.pointwise(F.silu, z.float()).view(T, c.linear_num_value_heads, -1)
        out = (self.norm.weight * normed.to(dtype)) * gate  # (T, Hv, dv) fp32
        return kernels.linear(out.to(dtype).reshape(T, -1), self.out_proj.weight, None)  # (T, hidden)


class GatedDeltaNetNext(GatedDeltaNet):
    """Qwen3-Next's gated delta net: the same computation with fused, head-grouped projections.

    `in_proj_qkvz` (2 key_dim + 2 value_dim, hidden) yields, per key head, [q | k | v | z] of that
    head's group (v and z for its v_heads / k_heads value heads); `in_proj_ba` (2 v_heads,
    hidden) per key head [b | a] of its group.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        c, H = config, config.hidden_size
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        self.in_proj_qkvz = nn.Linear(H, 2 * c.gdn_key_dim + 2 * c.gdn_value_dim, bias=False, dtype=dtype)
        self.in_proj_ba = nn.Linear(H, 2 * c.linear_num_value_heads, bias=False, dtype=dtype)

    def _project(self, h: Tensor, kernels: Kernels) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """qkv (T, conv_dim) as [q | k | v], z (T, value_dim), b and a (T, Hv)."""
        c, T = self.config, h.shape[0]
        Hk, dk = c.linear_num_key_heads, c.linear_key_head_dim
        group = c.linear_num_value_heads // Hk * c.linear_value_head_dim
        qkvz = kernels.linear(h, self.in_proj_qkvz.weight, None).view(T, Hk, -1)  # (T, Hk, ..)
        q, k, v, z = qkvz.split([dk, dk, group, group], dim=-1)
        ba = kernels.linear(h, self.in_proj_ba.weight, None).view(T, Hk, -1)  # (T, Hk, 2 Hv/Hk)
        b, a = ba.split(ba.shape[-1] // 2, dim=-1)
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return qkv, z.reshape(T, -1), b.reshape(T, -1), a.reshape(T, -1)
