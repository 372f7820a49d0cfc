"""Fixed-shape decode (`actors.graph`): padded bucket shapes give every real request the logits
of the eager, unpadded step, bit for bit.

On the CPU nothing is captured: the padded step runs eagerly from the bucket's persistent
buffers, so these tests check the padding (scratch slots, rows and chunks past the requests),
the chunk table and the buffer packing that a CUDA graph replays (benchmarks/gpu_check.py runs
the same comparison with graph replay on a GPU). The reference is the engine without fixed
shapes; the negative control shows that a padding row pointed at a real request's state slot
(instead of the scratch slot) corrupts that request.
"""

from __future__ import annotations

import pytest
import torch

from actors.engine import build_engine
from actors.graph import FixedShapeDecode
from raysched.sampling import SamplingParams

PROMPT_LENS = (5, 40, 70, 3, 33)  # 70 + 20 tokens crosses several KV chunks


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run(model: str, fixed: bool, sampling: list[SamplingParams]):
    eng = build_engine(model, kv_tokens=1024, state_slots=6, record_logits=True,
                       fixed_shape_decode=fixed)
    tokens = eng.generate(_prompts(eng.config.vocab_size), sampling)
    return eng, tokens, eng.logits


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen35"])
def test_padded_buckets_give_the_eager_logits_exactly(model):
    sampling = [SamplingParams(max_new_tokens=20 - 3 * i, temperature=0.8 if i % 2 else 0.0, seed=i)
                for i in range(len(PROMPT_LENS))]
    eager, tokens, logits = _run(model, False, sampling)
    fixed, fixed_tokens, fixed_logits = _run(model, True, sampling)
    assert fixed.pool.has_scratch and not eager.pool.has_scratch
    assert fixed_tokens == tokens
    for rid, steps in logits.items():
        assert all(torch.equal(a, b) for a, b in zip(steps, fixed_logits[rid], strict=True)), rid
    used = set(fixed.fixed_decode._buckets)
    assert any(rows > 1 for rows, _ in used) and any(chunks > 1 for _, chunks in used), used
    # requests finish at different steps: batches of 5, 4, 3, ... ran padded to buckets
    assert fixed.pool.is_empty()


def test_bucket_shapes():
    eng = build_engine("tiny", kv_tokens=256, state_slots=40, fixed_shape_decode=True)
    fixed = eng.fixed_decode
    assert fixed.bucket_for(1, 1) == (1, 1)
    assert fixed.bucket_for(3, 33) == (4, 2)
    assert fixed.bucket_for(33, 200) == (40, 8)  # never more rows than the pool has slots
    with pytest.raises(ValueError, match="scratch"):
        FixedShapeDecode(eng.model, build_engine("tiny", fixed_shape_decode=False).pool)


def test_padding_on_a_real_state_slot_corrupts_it():
    """Negative control: the scratch slot matters. Padding rows aimed at a live request's
    state slot overwrite its SSM state, and its next logits change."""
    sampling = [SamplingParams(max_new_tokens=6) for _ in PROMPT_LENS[:3]]
    _, _, logits = _run("tiny", True, sampling)
    eng = build_engine("tiny", kv_tokens=1024, state_slots=6, record_logits=True,
                       fixed_shape_decode=True)
    eng.pool.mamba.scratch_slot = 0  # the first request's slot
    eng.generate(_prompts(eng.config.vocab_size)[:3], sampling)
    assert not all(torch.equal(a, b) for a, b in zip(logits["gen-0"], eng.logits["gen-0"]))
