"""A request's logits are bit-identical whatever other requests share its batch.

The tiny preset decodes one request (a 60-token prompt, so its attention crosses a KV chunk
boundary while it decodes) alone and then inside batches of 2, 7 and 32 (other requests
with random prompts), at different positions in the batch, for 8 decode steps; every step's
logits must be torch.equal. The negative controls run the same with plain (untiled) F.linear
batching, and with whole-tensor elementwise functions, and must each see a difference: both
mechanisms are needed, and this test would catch a regression to either.

A negative control expects only the difference it controls for: where a CPU's kernels do not
have the dependence a mechanism removes (say, elementwise kernels without a vector tail, as
ATen's scalar `ATEN_CPU_CAPABILITY=default` path), the control is skipped, saying so; it never
asserts anything else that depends on the CPU (such as which of prefill or decode shows it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors import kernel_choice
from actors.attention import chunked_decode_attention
from actors.batch import KVTable
from actors.mamba import Kernels, rowwise, whole
from actors.model import HybridLM, tiled_linear
from actors.presets import load_preset
from tests.hf_reference import greedy_generate

STEPS = 8
BATCH_SIZES = (2, 7, 32)


def _prompts(n: int, vocab: int, seed: int, lengths: tuple[int, int] = (3, 150)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(*lengths, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for length in lens]


def _logits_in_batch(model: HybridLM, target: list[int],
                     batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode `target` among batch_size-1 random others; its (prefill, steps) logits."""
    others = _prompts(batch_size - 1, model.config.vocab_size, seed=batch_size)
    where = batch_size // 2
    prompts = others[:where] + [target] + others[where:]
    run = greedy_generate(model, prompts, STEPS + 1)
    return run.prefill_logits[where], torch.stack(run.step_logits[where])  # (L, V), (STEPS, V)


def _compare_alone_vs_batched(model: HybridLM) -> dict[str, list[bool]]:
    """Per batch size (BATCH_SIZES): is the target's prefill, and are its decode steps,
    torch.equal to the target alone? {"prefill": [...], "decode": [...]}."""
    # 60+ tokens: the target's attention spans several KV chunks (KV_CHUNK = 32)
    target = _prompts(1, model.config.vocab_size, seed=99, lengths=(60, 62))[0]
    alone_prefill, alone_steps = _logits_in_batch(model, target, 1)
    same: dict[str, list[bool]] = {"prefill": [], "decode": []}
    for batch_size in BATCH_SIZES:
        prefill, steps = _logits_in_batch(model, target, batch_size)
        same["prefill"].append(torch.equal(prefill, alone_prefill))
        same["decode"].append(torch.equal(steps, alone_steps))
    return same


def _linear_rows_follow_the_batch(model: HybridLM) -> bool:
    """The premise of the untiled-linear controls: on this CPU, plain F.linear gives some row
    of some of the model's weight shapes other bits in a batch (of 2, 7, 32) than alone."""
    gen = torch.Generator().manual_seed(0)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    for out_features, in_features in sorted(shapes):
        w = torch.randn(out_features, in_features, generator=gen)
        x = torch.randn(max(BATCH_SIZES), in_features, generator=gen)
        alone = F.linear(x[:1], w)
        if any(not torch.equal(F.linear(x[:n], w)[:1], alone) for n in BATCH_SIZES):
            return True
    return False


def _pointwise_bits_follow_position() -> bool:
    """The premise of the whole-tensor elementwise controls: on this CPU, some elementwise
    function the model uses gives an element other bits at another offset in the tensor (a
    vectorised body with a scalar tail)."""
    x = torch.randn(4 * 1024 + 3, generator=torch.Generator().manual_seed(0))
    fns = (torch.exp, torch.sigmoid, F.silu, F.softplus)
    return any(not torch.equal(fn(x)[k:], fn(x[k:])) for fn in fns for k in range(1, 65))


def _skip_unless(premise: bool, what: str) -> None:
    if not premise:
        pytest.skip(f"negative control without a premise on this CPU: {what}")


KERNELS = kernel_choice.candidates()  # the fp32 CPU kernels the chooser can pick here
# "mkl-probed" (rowdot off) is the path of the "mkl packed" candidate: run once where that is one
PROBED = [] if kernel_choice.MKL in KERNELS else [(torch.float32, False, None)]


@pytest.mark.parametrize("dtype, rowdot, kernel",
                         [(torch.float32, True, None), *[(torch.float32, True, k) for k in KERNELS],
                          *PROBED, (torch.bfloat16, True, None)],
                         ids=["float32-chosen", *[f"float32-{k}" for k in KERNELS],
                              *["float32-mkl-probed"] * len(PROBED), "bfloat16"])
def test_decode_is_bit_identical_alone_and_in_batches(dtype, rowdot, kernel):
    """fp32 on the CPU takes the kernel `actors.kernel_choice` picks per shape and phase
    ("chosen"), or each candidate forced for every shape; "mkl-probed" is the path taken where
    rowdot does not build (MKL's packed GEMM from the probed minimum row count, or tiles)."""
    model, _ = load_preset("tiny", dtype, "cpu")
    model.rowdot, model.linear_kernel = rowdot, kernel
    assert model.invariant_tile == 16
    same = _compare_alone_vs_batched(model)
    assert same == {"prefill": [True] * len(BATCH_SIZES), "decode": [True] * len(BATCH_SIZES)}, same


def test_negative_control_the_candidates_give_other_bits():
    """Why the choice must be the same on every worker: the target's logits alone differ
    between the candidates (rowdot's builds and MKL round in other orders)."""
    if len(KERNELS) < 2:
        pytest.skip(f"one candidate on this CPU ({KERNELS}): nothing to tell apart")
    model, _ = load_preset("tiny", torch.float32, "cpu")
    target = _prompts(1, model.config.vocab_size, seed=99, lengths=(60, 62))[0]
    runs = []
    for kernel in (KERNELS[0], KERNELS[-1]):
        model.linear_kernel = kernel
        runs.append(_logits_in_batch(model, target, 1))
    assert not (torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]))


def test_untiled_batching_is_not_bit_identical():
    """Negative control: plain batching (invariant_tile=None, which turns off the invariant
    kernels of prefill and of decode) changes some logits' last bits. Which of prefill or
    decode shows it depends on the CPU, so it asserts only that one of them does."""
    model, _ = load_preset("tiny", torch.float32, "cpu")
    _skip_unless(_linear_rows_follow_the_batch(model) or _pointwise_bits_follow_position(),
                 "neither F.linear rows nor elementwise results depend on the batch")
    model.invariant_tile = None
    same = _compare_alone_vs_batched(model)
    assert not all(same["prefill"] + same["decode"]), same


@pytest.mark.parametrize("kernels", [
    Kernels(linear=F.linear, pointwise=rowwise),
    Kernels(linear=lambda x, w, b: tiled_linear(x, w, b, 8), pointwise=whole),
], ids=["untiled_linear", "whole_tensor_pointwise"])
def test_each_invariance_mechanism_is_needed(kernels):
    """Negative controls for decode (prefill keeps its invariant kernels; nothing is asserted
    about it): each mechanism turned off alone changes some decode step's logits."""
    model, _ = load_preset("tiny", torch.float32, "cpu")
    if kernels.linear is F.linear:
        _skip_unless(_linear_rows_follow_the_batch(model), "F.linear rows do not depend on the batch")
    else:
        _skip_unless(_pointwise_bits_follow_position(), "elementwise results do not depend on the offset")
    model.decode_kernels = lambda: kernels
    assert not all(_compare_alone_vs_batched(model)["decode"])


def test_tiled_linear_equals_linear_up_to_rounding():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 64, generator=gen), torch.randn(40, 64, generator=gen)
    b = torch.randn(40, generator=gen)
    out = tiled_linear(x, w, b, tile=8)
    assert out.shape == (13, 40)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b))
    assert torch.equal(tiled_linear(x[5:6], w, b, 8), out[5:6])


def _attention_case(lengths: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    S, Hq, Hkv, D = 4096, 4, 2, 16
    k_cache, v_cache = torch.randn(S, Hkv, D, generator=gen), torch.randn(S, Hkv, D, generator=gen)
    slots = [torch.randperm(S, generator=gen)[:n] for n in lengths]  # scattered, like paged KV
    q = torch.randn(len(lengths), Hq, D, generator=gen)
    return q, k_cache, v_cache, slots


def test_chunked_decode_attention_is_exact_per_row_and_close_to_sdpa():
    """Whole-batch decode attention: a row's output is bit-identical alone, in any batch, in a
    padded fixed-shape table (CUDA-graph layout) and at any position; and within fp32 rounding
    of a plain per-request SDPA (the independent reference). Lengths cover 1, chunk edges
    (63, 64, 65), and several chunks."""
    lengths = [1, 63, 64, 65, 200, 700, 129]
    q, k_cache, v_cache, slots = _attention_case(lengths)
    run = lambda rows, table: chunked_decode_attention(q[rows], k_cache, v_cache, table, 0.25, rowwise)
    rows = list(range(len(lengths)))
    batched = run(rows, KVTable.build(slots))
    padded = run(rows + [0, 0], KVTable.build(slots, shape=(len(lengths) + 2, 30)))  # 2 padding rows
    reversed_rows = list(reversed(range(len(lengths))))
    backwards = run(reversed_rows, KVTable.build([slots[i] for i in reversed_rows]))
    for i, n in enumerate(lengths):
        alone = run([i], KVTable.build([slots[i]]))
        assert torch.equal(batched[i], alone[0]), f"row of {n} keys differs in the batch"
        assert torch.equal(padded[i], alone[0]), f"row of {n} keys differs in the padded table"
        assert torch.equal(backwards[len(lengths) - 1 - i], alone[0])
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q[i:i + 1], k_cache[slots[i]], v_cache[slots[i]]))
        ref = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True, scale=0.25)  # (1, Hq, 1, D)
        torch.testing.assert_close(alone[0], ref[0, :, 0].reshape(-1), rtol=1e-5, atol=1e-5)


def test_chunk_size_that_follows_the_batch_is_not_bit_identical():
    """Negative control: split points that follow the batch (as a split-K decode kernel that
    picks its number of splits from the batch size does) change the long rows' bits."""
    lengths = [65, 200, 129, 700]
    q, k_cache, v_cache, slots = _attention_case(lengths, seed=1)
    alone = [chunked_decode_attention(q[[i]], k_cache, v_cache, KVTable.build([slots[i]], chunk=64),
                                      0.25, rowwise)[0] for i in range(len(lengths))]
    batched = chunked_decode_attention(q, k_cache, v_cache,
                                       KVTable.build(slots, chunk=32 * len(lengths)), 0.25, rowwise)
    assert not all(torch.equal(batched[i], alone[i]) for i in range(len(lengths)))


def _prefill_alone_vs_batched(model: HybridLM, lengths: tuple[int, int]) -> list[bool]:
    """Is a prompt's prefill (one ragged batch) bit-identical alone and among 1, 6, 31 others?"""
    target = _prompts(1, model.config.vocab_size, seed=99, lengths=lengths)[0]
    alone, _ = _logits_in_batch(model, target, 1)
    return [torch.equal(_logits_in_batch(model, target, n)[0], alone) for n in BATCH_SIZES]


@pytest.mark.parametrize("lengths", [(3, 6), (10, 20)])
def test_varlen_prefill_is_bit_identical_alone_and_in_batches(lengths):
    model, _ = load_preset("tiny", torch.float32, "cpu")
    assert _prefill_alone_vs_batched(model, lengths) == [True] * len(BATCH_SIZES)


@pytest.mark.parametrize("kernels, lengths", [
    (Kernels(linear=F.linear, pointwise=rowwise), (3, 6)),
    ("tiled", (10, 20)),
], ids=["untiled_linear", "whole_tensor_pointwise"])
def test_each_invariance_mechanism_is_needed_in_prefill(kernels, lengths):
    """Negative controls for varlen prefill: plain F.linear over the concatenated rows, or
    elementwise functions over the whole tensor, change a short prompt's prefill logits with
    the prompts it is batched with."""
    model, _ = load_preset("tiny", torch.float32, "cpu")
    if kernels == "tiled":
        _skip_unless(_pointwise_bits_follow_position(), "elementwise results do not depend on the offset")
        kernels = Kernels(linear=model.prefill_kernels().linear, pointwise=whole)
    else:
        _skip_unless(_linear_rows_follow_the_batch(model), "F.linear rows do not depend on the batch")
    model.prefill_kernels = lambda: kernels
    assert not all(_prefill_alone_vs_batched(model, lengths))


POINTWISE_FNS = (torch.exp, torch.sigmoid, F.silu, F.softplus)


def _tail_fns() -> list:
    """The elementwise functions whose results depend on an element's offset on this CPU (a
    vectorised body with a scalar tail)."""
    x = torch.randn(4 * 1024 + 3, generator=torch.Generator().manual_seed(0))
    return [fn for fn in POINTWISE_FNS if any(not torch.equal(fn(x)[k:], fn(x[k:])) for k in range(1, 65))]


def _in_blocks(monkeypatch, block_rows: int, fn):
    """fn(rows) through `by_row_blocks` with blocks of `block_rows` rows."""
    from actors import batch

    monkeypatch.setattr(batch, "ROW_BLOCK", block_rows)
    return batch.by_row_blocks(fn, torch.empty(300, 1))  # (rows of a CPU tensor)


def _model_chains(pointwise):
    """A Mamba mixer's skip + gated norm (`_output`) and a SwiGLU (intermediate 37: rows whose
    length is no whole number of vector blocks) over 300 rows."""
    from actors.ffn import SwiGLU

    gen = torch.Generator().manual_seed(3)
    model, config = load_preset("tiny", torch.float32, "cpu")
    mixer = next(layer.mamba for layer in model.layers if not layer.is_attention)
    swiglu = SwiGLU(24, 37, False, torch.float32)
    for p in swiglu.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.3
    T, H, P = 300, config.mamba_n_heads, config.mamba_d_head
    y, x = torch.randn(T, H, P, generator=gen), torch.randn(T, H, P, generator=gen)
    z = torch.randn(T, config.mamba_intermediate, generator=gen)
    kernels = Kernels(linear=F.linear, pointwise=pointwise)
    with torch.inference_mode():  # as the model runs them
        return [mixer._output(y, x, z, kernels), swiglu(torch.randn(T, 24, generator=gen), kernels)]


def test_row_blocks_give_each_row_the_bits_of_one_pass(monkeypatch):
    """Elementwise chains of a long prefill run in blocks of rows (`actors.batch.by_row_blocks`,
    for speed). Every block size gives the bits of one pass over all rows: the model's chains,
    and each elementwise function it uses, through `rowwise`, over rows of 37 elements."""
    from actors import batch

    rows = torch.randn(300, 37, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(batch, "ROW_BLOCK", 10**6)
    one_pass = _model_chains(rowwise) + [rowwise(fn, rows) for fn in POINTWISE_FNS]
    for block_rows in (1, 7, 256):
        monkeypatch.setattr(batch, "ROW_BLOCK", block_rows)
        blocked = _model_chains(rowwise) + [_in_blocks(monkeypatch, block_rows, lambda r, fn=fn: rowwise(fn, rows[r]))
                                            for fn in POINTWISE_FNS]
        assert all(torch.equal(a, b) for a, b in zip(blocked, one_pass)), block_rows


def test_negative_control_row_blocks_without_rowwise_change_bits(monkeypatch):
    """Negative control: with a whole-tensor elementwise function whose results depend on the
    offset on this CPU, blocks of 7 rows of 37 elements put other elements in the scalar tail
    than one pass does, and bits change."""
    fns = _tail_fns()
    _skip_unless(bool(fns), "no elementwise result depends on the offset")
    rows = torch.randn(300, 37, generator=torch.Generator().manual_seed(4))
    for fn in fns:
        one_pass = _in_blocks(monkeypatch, 10**6, lambda r: whole(fn, rows[r]))
        assert not torch.equal(_in_blocks(monkeypatch, 7, lambda r: whole(fn, rows[r])), one_pass), fn


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("blocks", [1, 3, None], ids=["one-block-rows", "three-block-rows", "ragged-rows"])
def test_rowwise_over_rows_spaced_apart_gives_each_row_its_own_bits(threads, blocks):
    """`rowwise` runs rows that are whole vector blocks as they lie, also a column slice of a
    wider tensor (z of the Mamba projection, no copy): each row must get the bits of that row
    computed alone, contiguous (the reference), whatever the row count; rows of a ragged length
    go through the padded copy and must too."""
    from actors.mamba import row_align

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = row_align() * blocks if blocks else row_align() + 37
        wide = torch.randn(300, n + 96, generator=torch.Generator().manual_seed(5)) * 6
        spaced = wide[:, 40:40 + n]  # (300, n), rows n + 96 apart
        assert spaced.stride() == (n + 96, 1)
        for fn in POINTWISE_FNS:
            alone = torch.cat([rowwise(fn, spaced[i:i + 1].contiguous()) for i in range(0, 300, 37)])
            for count in (1, 7, 300):
                got = rowwise(fn, spaced[:count])
                assert torch.equal(got[::37], alone[:len(got[::37])]), (fn, count)
    finally:
        torch.set_num_threads(before)
