"""A request's logits are bit-identical whatever other requests share its batch.

The tiny preset decodes one request alone and then inside batches of 2, 7 and 32 (other requests
with random prompts), at different positions in the batch, for 8 decode steps; every step's
logits must be torch.equal. The negative controls run the same with plain (untiled) F.linear
batching, and with whole-tensor elementwise functions, and must each see a difference: both
mechanisms are needed, and this test would catch a regression to either.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.mamba import Kernels, rowwise, whole
from actors.model import HybridLM, tiled_linear
from actors.presets import load_preset
from tests.hf_reference import greedy_generate

STEPS = 8
BATCH_SIZES = (2, 7, 32)


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for length in lens]


def _logits_in_batch(model: HybridLM, target: list[int],
                     batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode `target` among batch_size-1 random others; its (prefill, steps) logits."""
    others = _prompts(batch_size - 1, model.config.vocab_size, seed=batch_size)
    where = batch_size // 2
    prompts = others[:where] + [target] + others[where:]
    run = greedy_generate(model, prompts, STEPS + 1)
    return run.prefill_logits[where], torch.stack(run.step_logits[where])  # (L, V), (STEPS, V)


def _compare_alone_vs_batched(model: HybridLM) -> list[bool]:
    target = _prompts(1, model.config.vocab_size, seed=99)[0]
    alone_prefill, alone_steps = _logits_in_batch(model, target, 1)
    same = []
    for batch_size in BATCH_SIZES:
        prefill, steps = _logits_in_batch(model, target, batch_size)
        assert torch.equal(prefill, alone_prefill), f"prefill differs in a batch of {batch_size}"
        same.append(torch.equal(steps, alone_steps))
    return same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_is_bit_identical_alone_and_in_batches(dtype):
    model, _ = load_preset("tiny", dtype, "cpu")
    assert model.invariant_tile == 16
    assert _compare_alone_vs_batched(model) == [True] * len(BATCH_SIZES)


def test_untiled_batching_is_not_bit_identical():
    """Negative control: plain batching (invariant_tile=None) changes some logits' last bits."""
    model, _ = load_preset("tiny", torch.float32, "cpu")
    model.invariant_tile = None
    assert not all(_compare_alone_vs_batched(model))


@pytest.mark.parametrize("kernels", [
    Kernels(linear=F.linear, pointwise=rowwise),
    Kernels(linear=lambda x, w, b: tiled_linear(x, w, b, 8), pointwise=whole),
], ids=["untiled_linear", "whole_tensor_pointwise"])
def test_each_invariance_mechanism_is_needed(kernels):
    model, _ = load_preset("tiny", torch.float32, "cpu")
    model.decode_kernels = lambda: kernels
    assert not all(_compare_alone_vs_batched(model))


def test_tiled_linear_equals_linear_up_to_rounding():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 64, generator=gen), torch.randn(40, 64, generator=gen)
    b = torch.randn(40, generator=gen)
    out = tiled_linear(x, w, b, tile=8)
    assert out.shape == (13, 40)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b))
    assert torch.equal(tiled_linear(x[5:6], w, b, 8), out[5:6])
