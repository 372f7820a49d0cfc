"""The batch-invariant Triton kernels of the CUDA path (`actors.triton_kernels`), run on the CPU
by Triton's interpreter (`TRITON_INTERPRET=1`, set here before the kernels are decorated).

(a) Arithmetic: each kernel against its pure-torch `_ref` twin, within a stated tolerance.
(b) Row independence: a row's output is torch.equal alone and in batches of 2, 7 and 32, at
    the first, a middle and the last row of the batch (so in other tiles and at other offsets
    inside a tile).
(c) Negative controls: the comparison of (b) sees an order change: the same kernel with another
    BLOCK_K (or reduction width) differs in the bits on some row, and a kernel whose tile
    config follows the row count, as a shape-heuristic library's does, fails (b).
And the routing, with CPU tensors routed as CUDA ones are (`triton_route.ROUTED_DEVICES`): the
model picks the Triton matmul; each decode stage (attention, SSD step, delta-rule step, norms)
calls its kernels, is torch.equal alone and in a batch of 7 and close to the CPU path's, and a
batch-dependent bmm in the attention breaks that (control). Behind `slow` (about a minute of
CPU each under the interpreter): the `tiny` model's whole forward, routed, torch.equal alone
and in a batch of 7 (prefill and decode), close to the CPU path's; control: a matmul whose K
step follows the row count breaks it.

What the interpreter shows is the kernels' arithmetic and that nothing a program computes
depends on the grid; it cannot show what the GPU's compiler does with one tile config (that is
the GPU check's part: benchmarks/gpu_check.py's invariance check on CUDA).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

_WAS_SET = "TRITON_INTERPRET" in os.environ
os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, at their import
pytest.importorskip("triton", reason="triton is not installed (it is in the `test` extra: "
                                     "pip install -e '.[test]')")
from actors import triton_kernels as tk  # noqa: E402
from actors import triton_route  # noqa: E402

if type(tk._matmul_kernel).__name__ != "InterpretedFunction":  # imported earlier without it
    tk = importlib.reload(tk)
if not _WAS_SET:
    os.environ.pop("TRITON_INTERPRET")  # other test files see no change; this file's tests set it

from actors.attention import chunked_decode_attention  # noqa: E402
from actors.batch import KVTable  # noqa: E402
from actors.ffn import last_sum, softmax_rows  # noqa: E402
from actors.gdn import gdn_step, prepare_qk  # noqa: E402
from actors.mamba import Kernels, gated_rms_norm, ssd_step  # noqa: E402
from actors.norms import RMSNorm  # noqa: E402
from actors.presets import load_preset  # noqa: E402
from tests.hf_reference import greedy_generate  # noqa: E402

BATCH_SIZES = (2, 7, 32)
FP32_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 sums of <= 256 unit-scale terms, another order
BF16_TOL = dict(rtol=2 ** -7, atol=2 ** -7)  # one bf16 rounding of nearly the same fp32 value


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    """The interpreter reads TRITON_INTERPRET at every launch, too."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _linear_case(dtype: torch.dtype, rows: int = 32, k: int = 96, n: int = 80):
    """x (rows, k), w (n, k), b (n,): outputs of unit scale."""
    return (_randn(rows, k, seed=1, dtype=dtype), _randn(n, k, seed=2, dtype=dtype, scale=k ** -0.5),
            _randn(n, seed=3, dtype=dtype))


def _row_free(fn, x: torch.Tensor) -> bool:
    """Is fn's output for x's row 0 torch.equal alone and in batches of 2, 7 and 32, at the
    first, a middle and the last row? (x (32, ...): row 0 is the target, the rest others.)"""
    alone = fn(x[:1])[0]
    for size in BATCH_SIZES:
        others = x[1:size]
        for where in sorted({0, size // 2, size - 1}):
            batch = torch.cat([others[:where], x[:1], others[where:]])
            if not torch.equal(fn(batch)[where], alone):
                return False
    return True


# ---------------------------------------------------------------------------- (a) arithmetic
@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)],
                         ids=["float32", "bfloat16"])
def test_linear_matches_its_reference(dtype, tol):
    x, w, b = _linear_case(dtype, rows=21)  # 21 rows, 80 columns: partial tiles on both axes
    out = tk.linear(x, w, b)
    assert out.dtype == dtype and out.shape == (21, 80)
    torch.testing.assert_close(out.float(), tk.linear_ref(x, w, b).float(), **tol)
    torch.testing.assert_close(tk.linear(x, w).float(), tk.linear_ref(x, w).float(), **tol)


def test_bmm_on_strided_views_matches_its_reference():
    """The decode attention's shapes: queries (J, grp, D) @ keys^T, a transposed strided view."""
    q, keys = _randn(9, 2, 32, seed=4), _randn(9, 16, 3, 32, seed=5)  # (J, grp, D), (J, C, Hkv, D)
    k_t = keys[:, :, 1].transpose(1, 2)  # (J, D, C), not contiguous
    torch.testing.assert_close(tk.bmm(q, k_t), tk.bmm_ref(q, k_t), **FP32_TOL)
    torch.testing.assert_close(tk.bmm(q, k_t), torch.bmm(q, k_t), **FP32_TOL)


@pytest.mark.parametrize("n", [16, 200, 1000])
def test_row_reductions_match_their_references(n):
    x = _randn(5, 3, n, seed=n)
    torch.testing.assert_close(tk.row_sum(x), tk.row_sum_ref(x), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(tk.inv_rms(x, 1e-6), tk.inv_rms_ref(x, 1e-6), **FP32_TOL)
    assert tk.inv_rms(x, 1e-6).shape == (5, 3, 1)


def test_a_tile_config_that_is_not_a_power_of_two_is_refused_in_one_line():
    with pytest.raises(ValueError, match="TileConfig.block_k must be a power of two, got 24"):
        tk.TileConfig(block_k=24)


def test_mismatched_dtypes_are_refused_in_one_line():
    x, w, _ = _linear_case(torch.float32)
    with pytest.raises(TypeError, match="operands must share one float dtype"):
        tk.linear(x, w.to(torch.bfloat16))


# ---------------------------------------------------------------------------- (b) row independence
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_linear_rows_do_not_depend_on_the_batch(dtype):
    x, w, b = _linear_case(dtype)
    assert _row_free(lambda rows: tk.linear(rows, w, b), x)


def test_bmm_rows_and_batch_members_do_not_depend_on_the_batch():
    a, b = _randn(32, 3, 40, seed=6), _randn(40, 24, seed=7)  # K = 40: a partial K step
    assert _row_free(lambda z: tk.bmm(z, b.expand(z.shape[0], -1, -1)), a)  # batch members
    assert _row_free(lambda rows: tk.bmm(rows[None], b[None])[0], a[:, 0])  # rows of one member


def test_a_batch_beyond_one_grid_goes_in_several_launches_with_the_same_bits(monkeypatch):
    """bmm batches over the grid's limit (65,535 on CUDA; 3 here) split across launches."""
    monkeypatch.setattr(tk, "MAX_BATCH", 3)
    a, b = _randn(8, 2, 16, seed=10), _randn(8, 16, 5, seed=11)
    out = tk.bmm(a, b)
    torch.testing.assert_close(out, tk.bmm_ref(a, b), **FP32_TOL)
    assert all(torch.equal(out[z], tk.bmm(a[z:z + 1], b[z:z + 1])[0]) for z in range(8))


def test_row_reductions_do_not_depend_on_the_batch():
    x = _randn(32, 300, seed=8)
    assert _row_free(tk.row_sum, x)
    assert _row_free(lambda rows: tk.inv_rms(rows, 1e-6), x)


# ---------------------------------------------------------------------------- (c) negative controls
def test_another_block_k_changes_the_bits():
    """The tests above can see an order change: BLOCK_K 16 instead of 32 sums K in other
    partial sums, which moves the last bits of some rows (fp32, K = 256)."""
    x, w, b = _linear_case(torch.float32, k=256)
    other = tk.TileConfig(block_k=16)
    assert not torch.equal(tk.linear(x, w, b, other), tk.linear(x, w, b))


def test_another_reduction_width_changes_the_bits():
    x = _randn(32, 1000, seed=9)
    assert not torch.equal(tk.row_sum(x, block=32), tk.row_sum(x))


def test_a_tile_config_that_follows_the_row_count_is_not_row_free():
    """What a shape-heuristic library does (a smaller K step for few rows): (b)'s check fails."""
    x, w, b = _linear_case(torch.float32, k=256)

    def shape_picked(rows: torch.Tensor) -> torch.Tensor:
        config = tk.TileConfig(block_k=16) if rows.shape[0] < 4 else tk.MATMUL
        return tk.linear(rows, w, b, config)

    assert not _row_free(shape_picked, x)


# ---------------------------------------------------------------------------- the model's routing
@pytest.fixture
def routed_on_cpu(monkeypatch):
    """Route CPU tensors as CUDA ones are, and count the calls each routed kernel gets."""
    monkeypatch.setattr(triton_route, "ROUTED_DEVICES", ("cuda", "cpu"))
    calls = {"linear": 0, "bmm": 0, "row_sum": 0, "inv_rms": 0}

    def counted(name):
        real = getattr(triton_route, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call
    for name in calls:
        monkeypatch.setattr(triton_route, name, counted(name))
    return calls


def _attention_stage(rows: list[int]):
    """chunked_decode_attention of the given rows of a fixed case: (R, Hq*D)."""
    lengths = [40, 3, 70, 33, 9, 64, 20]
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(600, 2, 16, generator=gen), torch.randn(600, 2, 16, generator=gen)
    slots = [torch.randperm(600, generator=gen)[:n] for n in lengths]
    q = torch.randn(len(lengths), 4, 16, generator=gen)
    return chunked_decode_attention(q[rows], k_cache, v_cache,
                                    KVTable.build([slots[r] for r in rows]), 0.25)


def _ssd_stage(rows: list[int]):
    """ssd_step of the given rows (each from its own copy of the state): y (R, H, P)."""
    gen = torch.Generator().manual_seed(1)
    R, H, P, G, N = 7, 4, 8, 2, 16
    state = torch.randn(R, H, P, N, generator=gen)
    x, dt = torch.randn(R, H, P, generator=gen), torch.rand(R, H, generator=gen)
    B, C = torch.randn(R, G, N, generator=gen), torch.randn(R, G, N, generator=gen)
    pick = torch.tensor(rows)
    return ssd_step(state[pick].clone(), torch.arange(len(rows)), x[pick], dt[pick],
                    -torch.rand(H, generator=gen), B[pick], C[pick])


def _gdn_stage(rows: list[int]):
    """gdn_step of the given rows, q and k through l2norm: y (R, H, dv)."""
    gen = torch.Generator().manual_seed(2)
    R, H, dk, dv = 7, 4, 16, 16
    state = torch.randn(R, H, dk, dv, generator=gen)
    q, k = prepare_qk(torch.randn(R, 2, dk, generator=gen), torch.randn(R, 2, dk, generator=gen), H)
    v, g, beta = torch.randn(R, H, dv, generator=gen), -torch.rand(R, H, generator=gen), torch.rand(R, H, generator=gen)
    pick = torch.tensor(rows)
    return gdn_step(state[pick].clone(), torch.arange(len(rows)), q[pick], k[pick], v[pick],
                    g[pick], beta[pick])


def _norm_stage(rows: list[int]):
    """The RMSNorm of a decoder block and Mamba's gated RMSNorm, side by side: (R, 2 * 64)."""
    gen = torch.Generator().manual_seed(3)
    h, z = torch.randn(7, 64, generator=gen), torch.randn(7, 64, generator=gen)
    norm = RMSNorm(64, 1e-6, torch.float32)
    norm.weight.data = torch.rand(64, generator=gen) + 0.5
    pick = torch.tensor(rows)
    return torch.cat([norm(h[pick]), gated_rms_norm(h[pick], z[pick], norm.weight, 16, 1e-6)], -1)


def _router_stage(rows: list[int]):
    """The MoE routers' weights, Qwen3-Next's (softmax over all experts, then normalised) and
    NemotronH's (normalised sigmoid scores): (R, 2 * k)."""
    gen = torch.Generator().manual_seed(4)
    logits, scores = torch.randn(7, 32, generator=gen), torch.rand(7, 4, generator=gen)
    pick = torch.tensor(rows)
    probs = softmax_rows(logits[pick], Kernels().pointwise)
    top = probs.topk(4, dim=-1).values
    return torch.cat([top / last_sum(top), scores[pick] / (last_sum(scores[pick]) + 1e-20)], -1)


STAGES = {"attention": (_attention_stage, ("bmm", "row_sum")), "ssd": (_ssd_stage, ("bmm",)),
          "gdn": (_gdn_stage, ("row_sum",)), "norms": (_norm_stage, ("inv_rms",)),
          "moe_router": (_router_stage, ("row_sum",))}


@pytest.mark.parametrize("stage", STAGES)
def test_routed_decode_stage_calls_its_kernels_and_is_row_free(stage, routed_on_cpu, monkeypatch):
    """Each decode stage, routed: it calls its Triton kernels, row 3's result is torch.equal
    alone and in the batch of 7, and close to the CPU path's (the independent reference)."""
    run, kernels = STAGES[stage]
    batched, alone = run(list(range(7))), run([3])
    assert all(routed_on_cpu[name] for name in kernels), routed_on_cpu
    assert torch.equal(batched[3], alone[0])
    monkeypatch.setattr(triton_route, "ROUTED_DEVICES", ("cuda",))  # the CPU path
    torch.testing.assert_close(batched, run(list(range(7))), **FP32_TOL)


def test_routed_attention_with_a_batch_dependent_bmm_is_not_row_free(routed_on_cpu, monkeypatch):
    """Negative control: a bmm whose K step follows the batch count (as cuBLAS's choice can)
    in the routed attention changes row 3's bits between alone and the batch of 7."""
    real = tk.bmm
    monkeypatch.setattr(triton_route, "bmm", lambda a, b: real(
        a, b, tk.TileConfig(block_k=8) if a.shape[0] < 4 else tk.MATMUL))
    assert not torch.equal(_attention_stage(list(range(7)))[3], _attention_stage([3])[0])


def test_routed_model_takes_the_triton_matmul(routed_on_cpu):
    """The model's kernel choice: Triton's matmul on a routed device when batch-invariant,
    the CPU's own kernels otherwise, plain F.linear with invariance off."""
    model, _ = load_preset("tiny", torch.float32, "cpu")
    assert model.decode_kernels().linear is triton_route.linear
    assert model.prefill_kernels().linear is triton_route.linear
    triton_route.ROUTED_DEVICES = ("cuda",)  # (the fixture's monkeypatch restores it)
    assert model.decode_kernels().linear is not triton_route.linear
    model.invariant_tile = None
    assert model.decode_kernels() == Kernels()


def _shape_picked_linear(x, w, b):
    return tk.linear(x, w, b, tk.TileConfig(block_k=16) if x.shape[0] < 4 else tk.MATMUL)


def _target_alone_and_in_batch(model, steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The target's (prefill, decode steps) logits alone, then 4th of a batch of 7."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
               for n in (12, 5, 9, 3, 14, 7, 4)]  # the target: the 4th (3 tokens)
    runs = []
    for batch, where in ((prompts[3:4], 0), (prompts, 3)):
        run = greedy_generate(model, batch, steps + 1)
        runs.append((run.prefill_logits[where], torch.stack(run.step_logits[where])))
    return runs


@pytest.mark.slow  # about a minute each under the interpreter (92 kernel launches a forward)
def test_routed_model_is_row_free(routed_on_cpu, monkeypatch):
    """The tiny model's whole forward, routed: every kernel is called, the target's logits are
    torch.equal alone and in a batch of 7 (prefill and 2 decode steps), and close to the CPU
    path's (the independent reference)."""
    model, _ = load_preset("tiny", torch.float32, "cpu")
    (alone_prefill, alone_steps), (prefill, steps) = _target_alone_and_in_batch(model)
    assert all(routed_on_cpu.values()), routed_on_cpu
    assert torch.equal(prefill, alone_prefill) and torch.equal(steps, alone_steps)
    monkeypatch.setattr(triton_route, "ROUTED_DEVICES", ("cuda",))  # the CPU path
    cpu_prefill, cpu_steps = _target_alone_and_in_batch(model)[0]
    torch.testing.assert_close(alone_prefill, cpu_prefill, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(alone_steps, cpu_steps, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_routed_model_with_a_row_count_dependent_matmul_is_not_row_free(routed_on_cpu, monkeypatch):
    """Negative control: the same routed forward with a matmul whose K step follows the row
    count (the dependence cuBLAS has) gives the target other logits in the batch."""
    monkeypatch.setattr(triton_route, "linear", _shape_picked_linear)
    model, _ = load_preset("tiny", torch.float32, "cpu")
    (alone_prefill, alone_steps), (prefill, steps) = _target_alone_and_in_batch(model)
    assert not (torch.equal(prefill, alone_prefill) and torch.equal(steps, alone_steps))
