"""MKL's matrix path, which the start-up probe picks on this CPU where `actors.rowdot` does not
build (these tests ask for it with `native=False`), and what the bench reports about it.

`TiledLinear` pads a packed MKL call of fewer rows than the probed minimum up to it (on an
AMD EPYC, calls of 1 to 3 rows take another kernel than calls of 4 or more). Held here: every
row count gives each row bit-identical to exact 16-row tile calls, on whichever path the probe
chose; the negative control shows that unpadded calls below the minimum differ (where the
minimum is above 1 on this CPU). Also: the slots' run found once per decode batch gives the
same bits as the gather-and-scatter path, `actors.cpu_info` names the CPU and MKL's path, and
the kernel `actors.kernel_choice` picks for a shape and phase is the one that runs.
"""

from __future__ import annotations

import pytest
import torch

import actors.model as model_module
from actors import kernel_choice
from actors.batch import ForwardBatch
from actors.cpu_info import describe, gemm_fingerprint
from actors.mamba import causal_conv_step, ssd_step
from actors.presets import load_preset
from actors.model import MAX_CALL_ROWS, PROBE_ROWS, TiledLinear, _fewest_free_rows, _packed_call, _probe_min_rows, kernel_paths

OUT, IN, TILE = 96, 64, 16


def _inputs(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, IN, generator=g), torch.randn(OUT, IN, generator=g), torch.randn(OUT, generator=g)


def test_every_row_count_matches_tile_calls_on_the_chosen_path():
    x, w, b = _inputs(40)
    reference = TiledLinear(TILE, pack=True, row_free=False)(x, w, b)  # exact 16-row calls
    linear = TiledLinear(TILE, native=False)
    for rows in range(1, 41):
        for at in (0, 40 - rows):
            assert torch.equal(linear(x[at:at + rows], w, b), reference[at:at + rows]), (rows, at)
    assert any(k.startswith(f"{OUT}x{IN} (tile {TILE},") for k in kernel_paths())


def test_a_bf16_decode_product_matches_exact_tile_calls_at_every_row_count():
    """bf16 has no packed path: decode probes the tiles' own `weight @ x^T` at any row count
    (`_plain_call`), and every row count, at either end of a 40-row batch, gives each row the
    bits of exact 16-row tile calls, whichever the probe chose (row-free from some count, or
    tiles); `kernel_paths` names the shape with its dtype."""
    x, w, b = (t.bfloat16() for t in _inputs(40))
    reference = TiledLinear(TILE, pack=False, row_free=False)(x, w, b)  # exact 16-row calls
    linear = TiledLinear(TILE, max_rows=MAX_CALL_ROWS, native=False)
    for rows in range(1, 41):
        for at in (0, 40 - rows):
            assert torch.equal(linear(x[at:at + rows], w, b), reference[at:at + rows]), (rows, at)
    assert any(k.startswith(f"{OUT}x{IN} bfloat16 (tile {TILE},") for k in kernel_paths())


def test_negative_control_the_probe_refuses_calls_whose_rows_follow_the_row_count():
    """The probe's rule, on calls made to fail: a call whose rows change below 3 rows is
    row-free from 3; one whose rows change at every count past the tile (17) is refused (None:
    tiles). The reference is the honest call's own result."""
    x, w, _ = _inputs(max(PROBE_ROWS) + 3)
    honest = lambda rows: torch.stack([torch.mv(w, r) for r in rows])  # noqa: E731  (row by row: row-free)
    expected = honest(x)
    below_3 = lambda rows: honest(rows) + (1e-3 if rows.shape[0] < 3 else 0.0)  # noqa: E731
    past_tile = lambda rows: honest(rows) + (1e-3 if rows.shape[0] == 17 else 0.0)  # noqa: E731
    assert _fewest_free_rows(honest, x, expected, TILE) == 1
    assert _fewest_free_rows(below_3, x, expected, TILE) == 3
    assert _fewest_free_rows(past_tile, x, expected, TILE) is None


@pytest.mark.parametrize("period", [4, 6, 8, 12, 16])
def test_the_probe_sees_rows_blocked_by_the_call_at_every_size(period, monkeypatch):
    """Seen on an Intel Xeon with MKL on its AVX2 path (`MKL_ENABLE_INSTRUCTIONS=AVX2`): calls
    of 2 and 3 rows mod 4 give other bits at every size, and the probe's old counts (every
    count to 17, then 31, 32, 33, 64, 100, 128, 129, 200, 256: none 2 or 3 mod 4 past 31)
    called such shapes row-free from 32 rows, so a prompt's prefill changed with its batch. A
    call whose rows change at one residue of `period` past 40 rows must be refused for a
    128-row tile. Control: the old counts accept the same call."""
    x, w, _ = _inputs(max(PROBE_ROWS) + 3)
    honest = lambda rows: torch.stack([torch.mv(w, r) for r in rows])  # noqa: E731
    expected = honest(x)
    blocked = lambda rows: honest(rows) + (1e-3 if rows.shape[0] > 40 and rows.shape[0] % period == period - 1 else 0.0)  # noqa: E731
    assert _fewest_free_rows(blocked, x, expected, 128) is None
    import actors.model

    monkeypatch.setattr(actors.model, "PROBE_ROWS", tuple(range(1, 18)) + (31, 32, 33, 64, 100, 128, 129, 200, 256))
    assert _fewest_free_rows(blocked, x, expected, 128) is not None


def test_negative_control_calls_below_the_minimum_take_another_kernel():
    if not TiledLinear(TILE).pack:
        pytest.skip("no MKL packed GEMM in this torch build: tiles everywhere")
    min_rows = _probe_min_rows(OUT, IN, TILE)
    if min_rows is None or min_rows == 1:
        pytest.skip(f"probe chose {min_rows}: no row count below a minimum to control for here")
    x, w, b = _inputs(TILE)
    lin = TiledLinear(TILE, native=False)
    packed = lin._packed_weight(w)
    reference = TiledLinear(TILE, pack=True, row_free=False)(x, w, b)
    unpadded = [torch.ops.mkl._mkl_linear(x[:m].contiguous(), packed, w, b, m) for m in range(1, min_rows)]
    assert any(not torch.equal(u, reference[:u.shape[0]]) for u in unpadded)
    padded = [_packed_call(x[:m].contiguous(), packed, w, b, min_rows) for m in range(1, min_rows)]
    assert all(torch.equal(p, reference[:p.shape[0]]) for p in padded)


def _decode_batch(mamba_slots: list[int]) -> ForwardBatch:
    zeros = torch.zeros(len(mamba_slots), dtype=torch.int64)
    return ForwardBatch(False, zeros, zeros, [1] * len(zeros), zeros, torch.tensor(mamba_slots))


def test_mamba_run_is_found_once_and_gives_the_gather_path_bits():
    batch = _decode_batch([2, 3, 4])
    assert batch.mamba_run == (2, 3)
    assert _decode_batch([2, 4, 3]).mamba_run is None
    g = torch.Generator().manual_seed(1)
    R, H, P, N, G, D, K = 3, 4, 8, 16, 2, 12, 4
    x, dt = torch.randn(R, H, P, generator=g), torch.rand(R, H, generator=g)
    A, B, C = -torch.rand(H, generator=g), torch.randn(R, G, N, generator=g), torch.randn(R, G, N, generator=g)
    ssm, conv = torch.randn(6, H, P, N, generator=g), torch.randn(6, D, K - 1, generator=g)
    xBC, weight, bias = torch.randn(R, D, generator=g), torch.randn(D, 1, K, generator=g), torch.randn(D, generator=g)
    slots = batch.mamba_slots
    ssm2, conv2 = ssm.clone(), conv.clone()
    y_run = ssd_step(ssm, slots, x, dt, A, B, C, run=batch.mamba_run)
    y_gather = ssd_step(ssm2, slots, x, dt, A, B, C, run=None)
    c_run = causal_conv_step(conv, slots, xBC, weight, bias, run=batch.mamba_run)
    c_gather = causal_conv_step(conv2, slots, xBC, weight, bias, run=None)
    assert torch.equal(y_run, y_gather) and torch.equal(ssm, ssm2)
    assert torch.equal(c_run, c_gather) and torch.equal(conv, conv2)


def test_describe_names_the_cpu_torch_and_mkl_path():
    info = describe()
    assert info["torch"] == torch.__version__
    assert info["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if torch.backends.mkl.is_available():
        assert info["mkl_version"] and "Math Kernel Library" in info["mkl_version"]
    assert gemm_fingerprint() == info["gemm_fingerprint"]  # deterministic within a process


@pytest.mark.parametrize("tile, max_rows, phase", [(TILE, MAX_CALL_ROWS, "decode"), (128, 2048, "prefill")])
def test_the_kernel_chosen_for_the_shape_and_phase_is_the_one_that_runs(tile, max_rows, phase, monkeypatch):
    """`TiledLinear` takes `kernel_choice.choose`'s pick for the weight's shape and its phase
    (decode: calls of up to `MAX_CALL_ROWS` rows; prefill: longer), and reports it
    (`kernel_paths`: a rowdot kernel by name, MKL's path under no rowdot name). The negative
    control: the other candidates, forced, give other bits on the same rows, except any that
    agree bit for bit with the pick (the panel kernel and MKL's packed GEMM can: both run one
    fused multiply-add chain per output over k in order), which the report tells apart."""
    monkeypatch.setattr(model_module, "_ROWDOT_SHAPES", {})
    x, w, b = _inputs(40)
    chosen = kernel_choice.choose((OUT, IN), phase)
    assert chosen in kernel_choice.candidates()
    got = TiledLinear(tile, max_rows=max_rows)(x, w, b)
    ran = kernel_paths().get(f"{OUT}x{IN} fp32 {phase}", "mkl packed")
    assert ran.split(",")[0] == chosen, (ran, chosen)
    assert torch.equal(got, TiledLinear(tile, max_rows=max_rows, kernel=chosen)(x, w, b))
    others = set(kernel_choice.candidates()) - {chosen}
    differ = {o for o in others if not torch.equal(got, TiledLinear(tile, max_rows=max_rows, kernel=o)(x, w, b))}
    assert differ or not others, f"every other candidate gives {chosen}'s bits: the bits cannot name it"
    assert others - differ <= {kernel_choice.PANEL, kernel_choice.MKL} - {chosen}, others - differ


def test_a_kept_path_follows_a_kernel_forced_later_and_a_new_bias(monkeypatch):
    """`TiledLinear` works a weight's path out once and keeps it; a kernel forced in the
    environment afterwards (`RAYSCHED_KERNEL`) must take effect from the next forward (the model
    calls `refresh` once per forward, `HybridLM._tiled`), and another bias at once. Each
    candidate's bits differ on these rows (the test above), so equality names the kernel (except
    between the panel kernel and MKL's packed GEMM where those agree: the switch between them
    changes no bit)."""
    names = kernel_choice.candidates()
    if len(names) < 2:
        pytest.skip(f"one candidate here ({names}): nothing to switch to")
    x, w, b = _inputs(5)
    linear = TiledLinear(TILE)
    kept = linear(x, w, b)
    for name in names:
        monkeypatch.setenv(kernel_choice.ENV_FORCE, name)
        assert torch.equal(linear.refresh()(x, w, b), TiledLinear(TILE, kernel=name)(x, w, b)), name
    monkeypatch.delenv(kernel_choice.ENV_FORCE)
    model, _ = load_preset("tiny", torch.float32, "cpu")
    kernels = model.decode_kernels()
    before = kernels.linear(x, w, b)
    for name in names:
        monkeypatch.setenv(kernel_choice.ENV_FORCE, name)
        assert torch.equal(model.decode_kernels().linear(x, w, b), TiledLinear(TILE, kernel=name)(x, w, b)), name
    assert torch.equal(before, kept)
    other = b + 1.0
    assert torch.equal(linear(x, w, other), TiledLinear(TILE, kernel=names[-1])(x, w, other))
