"""Grouped-query attention of a hybrid layer, with partial rotary embeddings.

Variants the config switches on (all off for Bamba): no RoPE (NemotronH, Granite without
`position_embedding_type`), a softmax scale other than head_dim^-1/2 (Granite's
`attention_multiplier`), per-head q/k RMSNorm before RoPE and a sigmoid output gate that
`q_proj` yields next to each head's query (Qwen3.5).

RoPE rotates only the first `rotary_dim` channels of each head, rotate-half style (channel i pairs
with channel i + rotary_dim/2), with inv_freq = 1 / theta^(2j / rotary_dim); the remaining
channels pass through. K is stored in the pool after RoPE, so decode never re-rotates history.

Prefill runs one sequence at a time with a fused causal kernel (no L x L score matrix, so 16k+
tokens fit); a chunk that continues a sequence attends over the cached K/V of its earlier tokens
plus its own (an explicit (L, S+L) causal mask, S the tokens before the chunk). Decode writes the new token's K/V, then attends per request over the slots the
request owns; a request's result never depends on the batch it is in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actors.config import ModelConfig
from actors.mamba import Kernels, Pointwise, whole
from actors.norms import ARCH_NORM_STYLE, RMSNorm


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype,
                 pointwise: Pointwise = whole) -> tuple[Tensor, Tensor]:
    """cos and sin tables (T, rotary_dim) for positions (T,), computed in fp32, cast to dtype."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)  # (rd/2,)
    inv_freq = 1.0 / (theta ** (steps / rotary_dim))  # (rd/2,)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, rotary_dim/2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (T, rotary_dim)
    return pointwise(torch.cos, angles).to(dtype), pointwise(torch.sin, angles).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first cos.shape[-1] channels of every head. x (T, heads, head_dim)."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]  # (T, heads, rd), (T, heads, head_dim - rd)
    first, second = rot[..., : rd // 2], rot[..., rd // 2:]
    rotated_half = torch.cat([-second, first], dim=-1)  # (T, heads, rd)
    rot = rot * cos[:, None, :] + rotated_half * sin[:, None, :]  # (T, heads, rd)
    return torch.cat([rot, rest], dim=-1)  # (T, heads, head_dim)


class Attention(nn.Module):
    """Weights of one attention mixer, under Hugging Face Bamba's names (`self_attn.*`).

    Parameters are created empty; fill them with `actors.loader.load_hf_state_dict`.
    `prefill` and `decode` take the layer's slice of the KV pool: k, v (S, kv_heads, head_dim).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = self.config = config
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        gated = 2 if c.attn_output_gate else 1
        self.q_proj = nn.Linear(c.hidden_size, gated * q_dim, bias=c.attention_bias, dtype=dtype)
        self.k_proj = nn.Linear(c.hidden_size, kv_dim, bias=c.attention_bias, dtype=dtype)
        self.v_proj = nn.Linear(c.hidden_size, kv_dim, bias=c.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_dim, c.hidden_size, bias=c.attention_bias, dtype=dtype)
        if c.qk_norm:
            style = ARCH_NORM_STYLE[c.architecture]
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, style)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, style)

    def prefill(self, h: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor,
                out_slots: Tensor, kernels: Kernels = Kernels(),
                context_slots: Tensor | None = None) -> Tensor:
        """Causal attention for one sequence's next L tokens; stores their K/V at `out_slots`.

        h (L, hidden), positions (L,), out_slots (L,) -> (L, hidden). `context_slots` (S + L,)
        lists the token slots of the whole sequence so far, the L new ones last: the new queries
        attend over the cached K/V of the S earlier tokens and causally over the new ones. None
        (or S = 0) means a fresh sequence.
        """
        q, k, v, gate = self._qkv(h, positions, kernels)  # (L, Hq, D), (L, Hkv, D) x2, gate
        k_cache[out_slots] = k
        v_cache[out_slots] = v
        L = q.shape[0]
        if context_slots is None or context_slots.shape[0] == L:
            out = self._sdpa(q, k, v, causal=True)  # (L, Hq*D)
        else:
            start = context_slots.shape[0] - L
            mask = torch.ones(L, start + L, dtype=torch.bool, device=q.device).tril(start)  # (L, S+L)
            out = self._sdpa(q, k_cache[context_slots], v_cache[context_slots], mask=mask)
        return self._out(out, gate, kernels)  # (L, hidden)

    def decode(self, h: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor,
               out_slots: Tensor, kv_flat: tuple[Tensor, list[int]], kernels: Kernels) -> Tensor:
        """One token per request: store its K/V at `out_slots` (R,), attend over its slots.

        h (R, hidden), positions (R,); kv_flat = (every request's token slots, new one last, in
        one tensor (sum L_i,); the counts L_i), as `ForwardBatch.kv_flat`. Returns (R, hidden).
        """
        q, k, v, gate = self._qkv(h, positions, kernels)  # (R, Hq, D), (R, Hkv, D) x2, gate
        k_cache[out_slots] = k
        v_cache[out_slots] = v
        flat, lengths = kv_flat  # one gather per tensor, split per request
        keys, values = k_cache[flat].split(lengths), v_cache[flat].split(lengths)  # (L_i, Hkv, D) each
        outs = [self._sdpa(q[i:i + 1], keys[i], values[i], causal=False)  # (1, Hq*D)
                for i in range(len(lengths))]
        return self._out(torch.cat(outs), gate, kernels)  # (R, hidden)

    def _qkv(self, h: Tensor, positions: Tensor,
             kernels: Kernels) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Project, normalise, rotate: q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, D), gate (T, Hq*D)
        or None."""
        c, T, linear = self.config, h.shape[0], kernels.linear
        q = linear(h, self.q_proj.weight, self.q_proj.bias).view(T, c.num_attention_heads, -1)
        gate = None
        if c.attn_output_gate:  # each head's projection is [query | gate]
            q, gate = q.split(c.head_dim, dim=-1)  # (T, Hq, D) each
            gate = gate.reshape(T, -1)  # (T, Hq*D)
        k = linear(h, self.k_proj.weight, self.k_proj.bias).view(T, -1, c.head_dim)  # (T, Hkv, D)
        v = linear(h, self.v_proj.weight, self.v_proj.bias).view(T, -1, c.head_dim)  # (T, Hkv, D)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if c.use_rope:
            cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta, h.dtype,
                                    kernels.pointwise)  # (T, rd) each
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v, gate

    def _out(self, attn: Tensor, gate: Tensor | None, kernels: Kernels) -> Tensor:
        """Output gate (if any) and o_proj: attn (T, Hq*D) -> (T, hidden)."""
        if gate is not None:
            attn = attn * kernels.pointwise(torch.sigmoid, gate)  # (T, Hq*D)
        return kernels.linear(attn, self.o_proj.weight, self.o_proj.bias)  # (T, hidden)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
              mask: Tensor | None = None) -> Tensor:
        """Fused attention of queries q (Tq, Hq, D) over k, v (Tk, Hkv, D) -> (Tq, Hq*D).

        `causal` aligns the first query with the first key; `mask` (Tq, Tk) bool, True = attend.
        """
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, T, D)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal,
                                             enable_gqa=True,
                                             scale=self.config.attention_scale)  # (1, Hq, Tq, D)
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)  # (Tq, Hq*D)
