"""Token sampling whose randomness belongs to the request, not to the process.

The uniform number for a request's n-th generated token is a pure function of (seed, n)
(SplitMix64), so the sampler has no hidden state: a request resumed on another worker, or
recomputed, draws exactly the numbers it would have drawn. Every row is sampled on its own
(no batch-wide reductions), so a request's token never depends on its batch neighbours.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def uniform(seed: int, index: int) -> float:
    """Deterministic U[0, 1) for the `index`-th draw of a request seeded with `seed`."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def sample_row(logits: torch.Tensor, temperature: float, top_p: float, u: float) -> int:
    """Pick a token from one row of logits (vocab,) float32.

    temperature == 0 is greedy (first maximum). Otherwise: softmax(logits / T), keep the smallest
    set of most likely tokens whose mass reaches top_p, and invert the CDF at u.
    """
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / temperature, dim=-1)  # (vocab,) float64
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    cdf = torch.cumsum(sorted_p, dim=-1)
    keep = int(torch.searchsorted(cdf, torch.tensor([top_p], dtype=cdf.dtype)).item()) + 1
    keep = min(keep, sorted_p.numel())
    target = u * float(cdf[keep - 1])
    pick = int(torch.searchsorted(cdf[:keep], torch.tensor([target], dtype=cdf.dtype), right=True).item())
    return int(order[min(pick, keep - 1)])


def sample(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
           seeds: list[int], draw_indices: list[int]) -> list[int]:
    """One token per row of `logits` (B, vocab) float32; row i uses its own seed and draw index."""
    rows = logits.float().cpu()
    greedy = [i for i, t in enumerate(temperatures) if t == 0.0]
    out = [0] * rows.shape[0]
    if greedy:
        # max's indices: the first maximal value, as argmax's, at a third of its CPU time
        picks = torch.max(rows[greedy], dim=-1).indices.tolist()
        for i, p in zip(greedy, picks):
            out[i] = p
    for i, t in enumerate(temperatures):
        if t != 0.0:
            out[i] = sample_row(rows[i], t, top_ps[i], uniform(seeds[i], draw_indices[i]))
    return out
