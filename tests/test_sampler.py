"""The sampler: its greedy rule, top_k and min_tokens, each against an independent reference.

Greedy is the first maximal logit of each row, in a batch as alone.

Reference: plain Python over the row's values. Ties are planted on purpose (a batched kernel
that returned the last maximum, or any maximum, would pick another token on resume than on the
original run). The controls check that the planted ties are real ties, and that a last-maximum
rule would pick differently on them. top_k and min_tokens are checked draw by draw against a numpy
reference fed the same uniform number (the draw for token n is a function of (seed, n) only).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from actors.sampler import sample, sample_row, uniform
from raysched.sampling import SamplingParams


def _first_max(row: list[float]) -> int:
    best = max(row)
    return next(i for i, v in enumerate(row) if v == best)


def test_greedy_picks_the_first_maximum_in_a_batch_and_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4099, generator=g)
    logits[1, [7, 3000]] = 9.0  # ties, first at 7
    logits[2, :] = 1.5  # all equal: 0
    logits[3, [4098, 4000]] = 8.0  # tie at the end: 4000
    rows = logits.tolist()
    assert sum(v == 9.0 for v in rows[1]) == 2  # control: the ties are there
    picks = sample(logits, [SamplingParams()] * 6, [0] * 6)
    assert picks == [_first_max(r) for r in rows]
    assert picks == [sample_row(logits[i], 0.0, 1.0, 0.5) for i in range(6)]
    assert picks[1:4] == [7, 0, 4000]
    # negative control: a rule that keeps the last maximum picks other tokens on these rows
    last_max = [len(r) - 1 - _first_max(r[::-1]) for r in rows]
    assert last_max[1:4] == [3000, 4098, 4098] and last_max != picks


# ---------------------------------------------------------------------------- top_k and min_tokens
# Reference: numpy, from the row's values and the same uniform draw (actors.sampler.uniform):
# order the logits (largest first, equal ones by lower id), keep k, softmax in float64, cut to the
# top_p nucleus, invert the CDF at u.

VOCAB = 64


def _reference_pick(row: np.ndarray, temperature: float, top_p: float, top_k: int, u: float) -> int:
    order = np.argsort(-row, kind="stable")  # descending; ties: lower id first
    if top_k > 0:
        order = order[:top_k]
    z = row[order].astype(np.float64) / temperature
    p = np.exp(z - z.max())
    cdf = np.cumsum(p / p.sum())
    keep = min(int(np.searchsorted(cdf, top_p, side="left")) + 1, len(order))
    pick = int(np.searchsorted(cdf[:keep], u * cdf[keep - 1], side="right"))
    return int(order[min(pick, keep - 1)])


def _tied_logits(rows: int) -> torch.Tensor:
    """Random logits where ranks 3 and 4 of each row are an exact tie (a top_k=4 boundary)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(rows, VOCAB, generator=g) * 2.0
    for r in range(rows):
        order = torch.sort(logits[r], descending=True, stable=True).indices
        logits[r, order[4]] = logits[r, order[3]]
    return logits


@pytest.mark.parametrize("top_k,top_p,temperature", [(1, 1.0, 0.8), (4, 1.0, 1.0), (4, 0.7, 1.3), (17, 0.9, 0.6),
                                                      (0, 0.95, 1.0), (-1, 0.9, 1.0), (VOCAB + 5, 1.0, 1.0)])
def test_top_k_matches_a_numpy_reference_from_the_same_draw(top_k: int, top_p: float, temperature: float) -> None:
    logits = _tied_logits(8)
    params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=100 + r) for r in range(8)]
    for n in range(40):
        picks = sample(logits, params, [n] * 8)
        expected = [_reference_pick(logits[r].numpy(), temperature, top_p, top_k, uniform(100 + r, n))
                    for r in range(8)]
        assert picks == expected, n


def test_top_k_keeps_only_the_k_largest_with_the_lower_id_at_a_tie() -> None:
    logits = _tied_logits(1)
    row = logits[0]
    order = torch.sort(row, descending=True, stable=True).indices.tolist()
    tie_low, tie_high = sorted(order[3:5])
    assert row[tie_low] == row[tie_high]  # control: the tie at the boundary is real
    draws = {sample_row(row, 3.0, 1.0, uniform(5, n), 4) for n in range(3000)}
    assert draws == set(order[:3]) | {tie_low}  # all four drawn, the tied higher id never
    # negative control: without top_k the same draws reach beyond those four tokens
    assert {sample_row(row, 3.0, 1.0, uniform(5, n)) for n in range(3000)} - set(order[:4])


def test_min_tokens_suppresses_stop_tokens_until_enough_were_drawn() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, VOCAB, generator=g)
    stop = int(torch.argmax(logits[0]))
    logits[1, stop] = logits[1].max() + 4.0  # the stop token dominates both rows
    before = logits.clone()
    stops = (stop, 9)
    greedy = SamplingParams(max_new_tokens=8, min_tokens=3, stop_token_ids=stops)
    without_stops = [[-math.inf if i in stops else v for i, v in enumerate(r)] for r in logits.tolist()]
    for n in range(3):  # draws 0, 1, 2: the stop tokens cannot come
        assert sample(logits, [greedy, greedy], [n, n]) == [_first_max(r) for r in without_stops]
    assert sample(logits, [greedy, greedy], [3, 3]) == [stop, stop]  # draw 3: allowed again
    sampled = [SamplingParams(max_new_tokens=8, min_tokens=3, stop_token_ids=stops, temperature=1.0, seed=s)
               for s in range(200)]
    draws = [sample(logits[1:], [p], [n])[0] for p in sampled for n in range(3)]
    assert not set(draws) & set(stops)
    assert draws == [_reference_pick(np.array(without_stops[1]), 1.0, 1.0, 0, uniform(p.seed, n))
                     for p in sampled for n in range(3)]
    # negative control: the same draws without min_tokens mostly give the dominant stop token
    free = [dataclasses.replace(p, min_tokens=0) for p in sampled]
    assert [sample(logits[1:], [p], [n])[0] for p in free for n in range(3)].count(stop) > 300
    assert torch.equal(logits, before)  # the caller's logits (the ones recorded) are untouched
