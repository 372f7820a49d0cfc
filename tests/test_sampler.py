"""The sampler's greedy rule: the first maximal logit of each row, in a batch as alone.

Reference: plain Python over the row's values. Ties are planted on purpose (a batched kernel
that returned the last maximum, or any maximum, would pick another token on resume than on the
original run). The controls check that the planted ties are real ties, and that a last-maximum
rule would pick differently on them.
"""

from __future__ import annotations

import torch

from actors.sampler import sample, sample_row
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
