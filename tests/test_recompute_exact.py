"""A request retracted by recompute continues on the bits of its uninterrupted run.

Recompute prefills the request's history again on any worker. A chunked prefill over the
tokens it had *generated* would not reproduce the decode steps that computed them: Mamba2's
chunked scan and gated delta net's chunked rule reduce in another order than their one-token
steps, and prefill attention than decode attention (the same problem vLLM PR 54993 is open
for). So the engine prefills the prompt as an uncached run did (the same chunk boundaries)
and replays the generated tokens one decode step each (`Engine._replay`); decode is row-free,
so the replay's bits are those of the steps that sampled them in whatever batch they ran.

Reference: the same engine's uninterrupted run (`Engine.generate`, logits recorded); the
recompute must give `torch.equal` logits for every later token, and the same tokens, on the
Mamba2 (Bamba), gated-delta-net (Qwen3.5) and NemotronH layouts, eager and at fixed shapes.
Negative control: the history fed through the chunked prefill as if it were all prompt (what
recompute did before) gives other bits for the next token.
"""

from __future__ import annotations

import pytest
import torch

from actors.engine import Sequence, build_engine
from raysched.sampling import SamplingParams

SAMPLING = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7)
CHUNK = 64


def _engine(preset: str, fixed: bool):
    return build_engine(preset, device="cpu", kv_tokens=1024, state_slots=6, record_logits=True,
                        fixed_shape_decode=fixed)


def _target(vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(99)
    return torch.randint(0, vocab, (150,), generator=gen).tolist()


def _uninterrupted(engine, target: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """The target's tokens and per-token logits, decoded beside two other requests."""
    others = [[3, 1, 4, 1, 5], list(range(10, 90))]
    out = engine.generate([target] + others, [SAMPLING] * 3, chunk_tokens=CHUNK)
    logits = engine.logits.pop("gen-0")
    engine.logits.clear()
    return out[0], logits


def _prefill_history(engine, rid: str, history: list[int], prompt_len: int) -> list[int]:
    """Prefill `history` as a new request; -> the tokens sampled."""
    out = engine.prefill([Sequence(rid, list(history), prompt_len, SAMPLING)], CHUNK)
    while engine.prefilling:
        out.merge(engine.prefill(list(engine.prefilling), CHUNK))
    return out.new_tokens.get(rid, [])


SLOW = pytest.mark.slow  # the same rule on more layouts: pytest -m slow tests/test_recompute_exact.py


@pytest.mark.parametrize("preset, fixed", [
    ("tiny", False), ("tiny-qwen35", False), ("tiny", True),
    pytest.param("tiny-qwen35", True, marks=SLOW), pytest.param("tiny-nemotronh", False, marks=SLOW),
    pytest.param("tiny-nemotronh", True, marks=SLOW),
], ids=["tiny-eager", "tiny-qwen35-eager", "tiny-fixed-shape", "tiny-qwen35-fixed-shape",
        "tiny-nemotronh-eager", "tiny-nemotronh-fixed-shape"])
def test_a_recomputed_request_continues_on_the_bits_of_its_uninterrupted_run(preset, fixed) -> None:
    engine = _engine(preset, fixed)
    target = _target(engine.config.vocab_size)
    tokens, want = _uninterrupted(engine, target)
    for kept in (1, 3, 7):  # generated tokens the retracted request had delivered
        rid = f"re-{kept}"
        got = _prefill_history(engine, rid, target + tokens[:kept], len(target))
        while rid in engine.running:
            got += engine.decode(1).new_tokens.get(rid, [])
        have = engine.logits.pop(rid)
        assert tokens[:kept] + got == tokens
        assert len(have) == len(want) - kept
        for step, (h, w) in enumerate(zip(have, want[kept:])):
            assert torch.equal(h, w), (f"{preset} after {kept} kept: token {kept + step}'s logits "
                                       f"differ by up to {(h - w).abs().max().item():.3g}")


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35"])
def test_control_a_history_prefilled_as_prompt_gives_other_bits(preset) -> None:
    """What recompute did before: every token of the history through the chunked prefill. The
    next token's logits differ from the uninterrupted run's (the scan's order is not the
    decode step's), which the replay above removes."""
    engine = _engine(preset, False)
    target = _target(engine.config.vocab_size)
    tokens, want = _uninterrupted(engine, target)
    history = target + tokens[:7]
    _prefill_history(engine, "as-prompt", history, len(history))
    have = engine.logits.pop("as-prompt")[0]
    assert not torch.equal(have, want[7])
