"""Fixed-shape decode (`actors.graph`): padded bucket shapes give every real request the logits
of the eager, unpadded step, bit for bit.

On the CPU nothing is captured: the padded step runs eagerly from the bucket's persistent
buffers, so these tests check the padding (scratch slots, rows and chunks past the requests),
the chunk table and the buffer packing that a CUDA graph replays (benchmarks/gpu_check.py runs
the same comparison with graph replay on a GPU). The reference is the engine without fixed
shapes; the negative control shows that a padding row pointed at a real request's state slot
(instead of the scratch slot) corrupts that request.

Buckets are made when the engine starts (`FixedShapeDecode(ahead=True)`): tests count creations
across first steps, a restore and a migration; the control is the lazy mode, which makes one
inside the first decode step.
"""

from __future__ import annotations

import pytest
import torch

from actors.engine import Sequence, build_engine
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
    used = set(fixed.fixed_decode.steps)
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


def _started(ahead: bool = True):
    eng = build_engine("tiny", kv_tokens=512, state_slots=4, record_logits=True, fixed_shape_decode=True)
    if not ahead:
        eng.fixed_decode = FixedShapeDecode(eng.model, eng.pool, ahead=False)
    return eng


def _seqs(vocab: int) -> list[Sequence]:
    return [Sequence(f"r{i}", p, len(p), SamplingParams(max_new_tokens=40))
            for i, p in enumerate(_prompts(vocab)[:3])]


def test_every_bucket_exists_at_start_and_no_step_restore_or_migration_creates_one():
    """Buckets are made (captured, on CUDA) when the engine starts: a first decode step, a
    restore's first step and a migration's first step after its stop-and-copy make none. The
    reference: every shape `bucket_for` gives for any row count and context the pool allows,
    enumerated one by one (the ladder doubles its way there)."""
    src, dst = _started(), _started()
    fixed = dst.fixed_decode
    want = {fixed.bucket_for(r, n) for r in range(1, 5) for n in range(1, 513)} - {None}
    assert set(fixed._buckets) == want and fixed.created == len(want) == len(fixed.ladder())
    src.prefill(_seqs(src.config.vocab_size))
    src.decode(3)  # the first decode steps
    snap = src.snapshot("r0")
    assert dst.restore(snap)
    dst.decode(1)  # a resume's first step
    assert dst.reserve("r1", len(src.running["r1"].token_ids))
    assert dst.receive_blocks("r1", (src.copy_span("r1", 0, 32),))
    assert dst.commit(src.copy_state("r1", 32))
    src.release("r1")
    dst.decode(1)  # a migration's first step after its stop-and-copy
    assert src.fixed_decode.created == dst.fixed_decode.created == len(want)
    assert (len(dst.logits["r0"]), len(dst.logits["r1"])) == (2, 1)  # r0 and r1 decoded here


def test_a_worker_starts_with_every_bucket():
    from actors.worker import Worker
    from raysched.config import PoolConfig, ServeConfig

    worker = Worker(ServeConfig(device="cpu", fixed_shape_decode=True,
                                pool=PoolConfig(kv_tokens=512, state_slots=4)), 0)
    fixed = worker.engine.fixed_decode
    assert fixed.created == len(fixed.ladder()) == len(fixed._buckets) > 1


def test_negative_control_lazy_buckets_are_created_inside_the_first_step():
    eng = _started(ahead=False)
    assert eng.fixed_decode.created == 0
    eng.prefill(_seqs(eng.config.vocab_size))
    assert eng.fixed_decode.created == 0  # prefill runs no bucket
    eng.decode(1)
    assert eng.fixed_decode.created == 1
