"""Grouped-query attention of a hybrid layer, with partial rotary embeddings.

Variants the config switches on (all off for Bamba): no RoPE (NemotronH, Granite without
`position_embedding_type`), a softmax scale other than head_dim^-1/2 (Granite's
`attention_multiplier`), per-head q/k RMSNorm before RoPE and a sigmoid output gate that
`q_proj` yields next to each head's query (Qwen3.5).

RoPE rotates only the first `rotary_dim` channels of each head, rotate-half style (channel i pairs
with channel i + rotary_dim/2), with inv_freq = 1 / theta^(2j / rotary_dim); the remaining
channels pass through. K is stored in the pool after RoPE, so decode never re-rotates history.

Prefill projects the rows of all its sequences at once, then attends per sequence with a fused
causal kernel (no L x L score matrix, so 16k+ tokens fit; in fp32 on the CPU where rowdot
loads, `actors.rowdot.prefill_attention`, row by row); a chunk that continues a sequence
attends over the cached K/V of its earlier tokens plus its own (an explicit (L, S+L) causal mask,
S the tokens before the chunk). Decode writes the new token's K/V, then attends over every
request's own slots in one pass (`chunked_decode_attention`, fixed-size KV chunks; in fp32 on
the CPU where rowdot loads, `actors.rowdot.decode_attention`, which reads the pool by slot); a
request's result never depends on the batch it is in.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actors import triton_route
from actors.batch import NEG_SCORE, KVTable, Segment, cat_rows
from actors.config import ModelConfig
from actors.kept import kept
from actors.mamba import Kernels, Pointwise, whole
from actors.norms import ARCH_NORM_STYLE, RMSNorm

PREFILL_TILE = 32  # query rows per prefill attention call through SDPA, at absolute positions: a
#   factor of the grid of exact prefix points (`actors.engine.prefix_grid`, with
#   `actors.mamba.SCAN_BLOCK`); rowdot's row-by-row kernel needs no tiles


def _padded(t: Tensor, rows: int) -> Tensor:
    """t (S, ...) cut or zero-padded to `rows` rows."""
    if t.shape[0] >= rows:
        return t[:rows]
    out = t.new_zeros((rows,) + t.shape[1:])
    out[:t.shape[0]] = t
    return out


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype,
                 pointwise: Pointwise = whole) -> tuple[Tensor, Tensor]:
    """cos and sin tables (T, rotary_dim) for positions (T,), computed in fp32, cast to dtype."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)  # (rd/2,)
    inv_freq = 1.0 / (theta ** (steps / rotary_dim))  # (rd/2,)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, rotary_dim/2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (T, rotary_dim)
    return pointwise(torch.cos, angles).to(dtype), pointwise(torch.sin, angles).to(dtype)


_ROPE: dict = {}  # the tables `rope_tables` made last (`actors.kept`)


def rope_tables(positions: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype,
                pointwise: Pointwise = whole) -> tuple[Tensor, Tensor]:
    """`rope_cos_sin`, made once for the positions tensor that every attention layer of a
    forward passes (`actors.kept`: again when it was written since, or for other arguments)."""
    return kept(_ROPE, "tables", positions, lambda: rope_cos_sin(positions, rotary_dim, theta, dtype, pointwise),
                (rotary_dim, theta, dtype, pointwise))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first cos.shape[-1] channels of every head. x (T, heads, head_dim)."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]  # (T, heads, rd), (T, heads, head_dim - rd)
    first, second = rot[..., : rd // 2], rot[..., rd // 2:]
    rotated_half = torch.cat([-second, first], dim=-1)  # (T, heads, rd)
    rot = rot * cos[:, None, :] + rotated_half * sin[:, None, :]  # (T, heads, rd)
    return torch.cat([rot, rest], dim=-1)  # (T, heads, head_dim)


def chunked_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, table: KVTable,
                             scale: float, pointwise: Pointwise = whole) -> Tensor:
    """Attention of one query per row over its own keys, for the whole batch in one pass.

    q (R, Hq, D); k_cache, v_cache (S, Hkv, D); table: each row's key slots in chunks of C
    (`KVTable`). Every chunk is scored, softmaxed and applied to its values on its own, as
    batched products of one fixed shape per (chunk, kv head): (grp, D) @ (D, C) and
    (grp, C) @ (C, D), grp = Hq / Hkv, with reductions over C only; then each row's chunks are
    merged in chunk order (`_merge_chunks`, flash-decoding's rule). A row's arithmetic therefore
    depends only on its own keys: not on the batch, nor on how many chunks other rows have (an
    empty chunk adds exactly 0).
    Scores and the merge are fp32. Returns (R, Hq*D) in q's dtype. On CUDA the products and the
    softmax sum go through the fixed-order Triton kernels (`actors.triton_route`): cuBLAS and
    torch's reductions would pick their order from J.
    """
    routed = triton_route.routes(q)
    bmm = triton_route.bmm if routed else torch.bmm
    R, Hq, D = q.shape
    J, C = table.slots.shape
    Hkv = k_cache.shape[1]
    grp = Hq // Hkv
    flat = table.slots.view(-1)
    keys = k_cache.index_select(0, flat).view(J, C, Hkv, D).float()  # (J, C, Hkv, D)
    values = v_cache.index_select(0, flat).view(J, C, Hkv, D).float()
    queries = q.float().index_select(0, table.owner).view(J, Hkv, grp, D)
    # per kv head, strided views of the gathered keys: no copies (the BLAS takes the stride)
    scores = torch.stack([bmm(queries[:, h], keys[:, :, h].transpose(1, 2))
                          for h in range(Hkv)], dim=1).view(J, Hq, C)  # (J, Hq, C)
    scores.mul_(scale)
    scores.masked_fill_(~table.valid[:, None, :], NEG_SCORE)
    top = scores.amax(-1, keepdim=True)  # (J, Hq, 1)
    probs = pointwise(torch.exp, scores.sub_(top)).view(J, Hkv, grp, C)
    total = (triton_route.row_sum(probs) if routed else probs.sum(-1)).view(J, Hq)  # (J, Hq)
    outs = torch.stack([bmm(probs[:, h], values[:, :, h]) for h in range(Hkv)],
                       dim=1).view(J, Hq, D)  # (J, Hq, D), unnormalised
    out = _merge_chunks(top.view(J, Hq), total, outs, table.grid, pointwise)  # (R, Hq, D)
    return out.to(q.dtype).reshape(R, Hq * D)


def _merge_chunks(top: Tensor, total: Tensor, outs: Tensor, grid: Tensor,
                  pointwise: Pointwise) -> Tensor:
    """Merge each row's chunk results: top, total (J, Hq), outs (J, Hq, D) (unnormalised),
    grid (R, K) -> (R, Hq, D) normalised, fp32.

    The row's max over its chunk maxima is exact in any order; each chunk is weighted by
    exp(its max - the row's max) and the weighted chunks are added in chunk order, one add per
    chunk (a reduction kernel's summation order could depend on K). An empty chunk (max
    NEG_SCORE) has weight exp(-huge) = 0 and adds exactly 0.
    """
    tops = top[grid]  # (R, K, Hq)
    weights = pointwise(torch.exp, tops - tops.amax(1, keepdim=True))  # (R, K, Hq)
    o = outs[grid].mul_(weights[..., None])  # (R, K, Hq, D)
    s = total[grid].mul_(weights)  # (R, K, Hq)
    o_sum, s_sum = o[:, 0], s[:, 0]
    for k in range(1, grid.shape[1]):
        o_sum, s_sum = o_sum + o[:, k], s_sum + s[:, k]
    return o_sum / s_sum[..., None]


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

    def prefill(self, h: Tensor, positions: Tensor, out_slots: Tensor, segments: list[Segment],
                k_cache: Tensor, v_cache: Tensor, kernels: Kernels = Kernels()) -> Tensor:
        """Causal attention for the next tokens of each sequence; stores their K/V at `out_slots`.

        h (T, hidden), positions (T,), out_slots (T,), the sequences' rows concatenated ->
        (T, hidden). Projections run over all rows; each sequence's queries attend over its
        own keys only: the cached K/V of its `start` earlier tokens (`context_slots`) and
        causally over its new ones.
        """
        q, k, v, gate = self._qkv(h, positions, kernels)  # (T, Hq, D), (T, Hkv, D) x2, gate
        k_cache[out_slots] = k
        v_cache[out_slots] = v
        fused = kernels.prefill_attention if q.dtype == torch.float32 else None
        outs = [self._prefill_one(q[s.rows], k[s.rows], v[s.rows], s, k_cache, v_cache, fused)
                for s in segments]  # (L_i, Hq*D) each
        return self._out(cat_rows(outs), gate, kernels)

    def _prefill_one(self, q: Tensor, k: Tensor, v: Tensor, seg: Segment, k_cache: Tensor,
                     v_cache: Tensor, fused: Callable[..., Tensor] | None = None) -> Tensor:
        """One sequence's L queries (L, Hq, D) over its keys -> (L, Hq*D), in tiles of
        PREFILL_TILE query rows at absolute positions (the last one padded), each tile over the
        keys up to its end, masked causally. A row's kernel call then has the same shape and
        inputs wherever a chunk starts or ends, so a prefill resumed at any multiple of the tile
        (a parked prefix point) gives the bits of an uncached run; one causal call over a chunk
        would not (its rows depend on the call's shape)."""
        L, T = q.shape[0], PREFILL_TILE
        end_all = seg.start + L
        keys, values = (k, v) if not seg.start else (k_cache[seg.context_slots], v_cache[seg.context_slots])
        if fused is not None:  # each row on its own (`actors.rowdot.prefill_attention`): no tiles needed
            return fused(q, keys, values, seg.start, self.config.attention_scale)  # (L, Hq*D)
        outs = []
        for a in range(seg.start // T * T, end_all, T):
            lo, hi, end = max(a, seg.start), min(a + T, end_all), a + T  # rows here; keys [0, end)
            tile = q.new_zeros((T,) + q.shape[1:])  # (T, Hq, D)
            tile[lo - a:hi - a] = q[lo - seg.start:hi - seg.start]
            kk, vv = _padded(keys, end), _padded(values, end)  # (end, Hkv, D), zeros past end_all
            mask = torch.ones(T, end, dtype=torch.bool, device=q.device).tril(a)  # (T, end)
            mask[:, end_all:] = False
            outs.append(self._sdpa(tile, kk, vv, mask=mask)[lo - a:hi - a])
        return torch.cat(outs)  # (L, Hq*D)

    def decode(self, h: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor,
               out_slots: Tensor, table: KVTable, kernels: Kernels) -> Tensor:
        """One token per request: store its K/V at `out_slots` (R,), attend over its slots.

        h (R, hidden), positions (R,); `table` holds every request's token slots (the new one
        last) in fixed-size chunks (`ForwardBatch.kv_table`). Returns (R, hidden).
        """
        q, k, v, gate = self._qkv(h, positions, kernels)  # (R, Hq, D), (R, Hkv, D) x2, gate
        k_cache[out_slots] = k
        v_cache[out_slots] = v
        fused = kernels.decode_attention
        if fused is not None and table.flat is not None and k_cache.dtype == torch.float32:
            out = fused(q, k_cache, v_cache, table.flat, table.starts, self.config.attention_scale)
        else:
            out = chunked_decode_attention(q, k_cache, v_cache, table, self.config.attention_scale,
                                           kernels.pointwise)  # (R, Hq*D)
        return self._out(out.to(q.dtype), gate, kernels)  # (R, hidden)

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
            cos, sin = rope_tables(positions, c.rotary_dim, c.rope_theta, h.dtype,
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
