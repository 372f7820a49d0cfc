"""Token sampling whose randomness belongs to the request, not to the process.

The uniform number for a request's n-th generated token is a pure function of (seed, n)
(SplitMix64), so the sampler has no hidden state: a request resumed on another worker, or
recomputed, draws exactly the numbers it would have drawn. Every row is sampled on its own
(no batch-wide reductions), so a request's token never depends on its batch neighbours.
Everything else a draw depends on (temperature, top_p, top_k, min_tokens, stop ids) is in the
request's `SamplingParams`, which every snapshot and plan carries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from raysched.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def uniform(seed: int, index: int) -> float:
    """Deterministic U[0, 1) for the `index`-th draw of a request seeded with `seed`."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def sample_row(logits: torch.Tensor, temperature: float, top_p: float, u: float, top_k: int = 0) -> int:
    """Pick a token from one row of logits (vocab,) float32.

    temperature == 0 is greedy (first maximum). Otherwise: keep the top_k largest logits (0: all;
    among equal logits the lower token id first), softmax(logits / T) over those, keep the
    smallest set of most likely tokens whose mass reaches top_p, and invert the CDF at u.
    """
    if temperature == 0.0:
        return int(torch.argmax(logits))
    if 0 < top_k < logits.numel():
        kept = torch.sort(logits, descending=True, stable=True).indices[:top_k]  # (top_k,) ties: lower id
        return int(kept[sample_row(logits[kept], temperature, top_p, u)])
    probs = torch.softmax(logits.double() / temperature, dim=-1)  # (vocab,) float64
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    cdf = torch.cumsum(sorted_p, dim=-1)
    keep = int(torch.searchsorted(cdf, torch.tensor([top_p], dtype=cdf.dtype)).item()) + 1
    keep = min(keep, sorted_p.numel())
    target = u * float(cdf[keep - 1])
    pick = int(torch.searchsorted(cdf[:keep], torch.tensor([target], dtype=cdf.dtype), right=True).item())
    return int(order[min(pick, keep - 1)])


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], draw_indices: Sequence[int]) -> list[int]:
    """One token per row of `logits` (B, vocab) float32; row i follows `params[i]` and draws
    number `draw_indices[i]` (its count of generated tokens). `logits` is left unchanged."""
    rows = _suppress_stops(logits.float().cpu(), params, draw_indices)  # (B, vocab)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    out = [0] * rows.shape[0]
    if greedy:
        # max's indices: the first maximal value, as argmax's, at a third of its CPU time
        picks = torch.max(rows[greedy], dim=-1).indices.tolist()
        for i, pick in zip(greedy, picks):
            out[i] = pick
    for i, p in enumerate(params):
        if p.temperature != 0.0:
            out[i] = sample_row(rows[i], p.temperature, p.top_p, uniform(p.seed, draw_indices[i]), p.top_k)
    return out


def _suppress_stops(rows: torch.Tensor, params: Sequence[SamplingParams], draw_indices: Sequence[int]) -> torch.Tensor:
    """min_tokens: before a request's min_tokens-th token its stop tokens (the eos among them when
    it stops at eos) cannot be drawn: their logits become -inf, in a copy of `rows`."""
    banned = [(i, list(p.stop_token_ids)) for i, (p, n) in enumerate(zip(params, draw_indices))
              if n < p.min_tokens and p.stop_token_ids]
    if not banned:
        return rows
    rows = rows.clone()
    for i, ids in banned:
        rows[i, ids] = -math.inf
    return rows
