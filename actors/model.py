"""`HybridLM`: a hybrid language model (Bamba, GraniteMoeHybrid, NemotronH, Qwen3.5, Qwen3-Next) in torch.

Each layer is  h += mixer(norm(h));  h += feed_forward(norm(h))  (NemotronH: the first only),
the mixer and feed-forward chosen by the layer's kind in `config.layer_types` from the registry
in `actors.layers` (Mamba2 `actors.mamba`, attention `actors.attention`, gated delta net
`actors.gdn`, MLP / MoE `actors.ffn`). The model keeps no state of its own: K/V and every
recurrent state live in a pool whose tensors (`PoolTensors`) are passed to every forward together
with a `ForwardBatch` naming the slots.

Batch invariance: a sequence's logits are bit-identical whatever else is in the batch, in
decode and in prefill. What is fixed-shape, and why:
- Every matrix product goes through `TiledLinear`. On the CPU in fp32 that is the kernel
  `actors.kernel_choice` measured fastest for the weight's shape and phase among those
  row-free here: a build of `actors.rowdot`, a kernel whose rows are bit-identical whatever
  the call's row count by construction (one fixed-order dot product per element), or MKL's
  packed path where the probe below finds it row-free. Where rowdot does not build (no C
  compiler), MKL's path takes every product: each weight is packed once
  for MKL's packed GEMM, and a call of M rows is one call of max(M, m) rows, m the CPU's
  minimum (1 on an Intel Xeon, 4 on an AMD EPYC): a row's result there is bit-identical
  whatever M is and wherever the row sits (measured: the summation order follows the packing,
  not the call, from m rows on). That is not MKL's documented contract, so m is probed per
  weight shape at first use (every row count up to 33, 16 in a row past 100, and some up to `MAX_CALL_ROWS`, against
  exact tile calls, then up to `PREFILL_CALL_ROWS` against those), calls are split at those
  counts, and a shape with no such m <= the tile falls back to calls of exactly
  `DECODE_TILE` (16) rows in decode and `PREFILL_TILE` (128) in prefill, the last tile
  zero-padded: a BLAS kernel picks its blocking (and so its summation order) from the shape, so
  one shape per call makes a row's result depend on nothing but that row. Decode in another
  CPU dtype (bf16) gets the same probe for the tile's own product at any row count; prefill
  in it, and every other device, keeps the tiles.
  tests/test_batch_invariance.py holds either path, and shows that plain F.linear batching
  breaks it.
- Nonlinear elementwise functions go through `actors.mamba.rowwise` (on the CPU an element's
  rounding can depend on its offset in the tensor); norms are per row; the conv/SSM decode step is
  elementwise plus batched products of one fixed shape per (request, head); decode attention
  works in fixed-size KV chunks per request (`actors.attention.chunked_decode_attention`).
- Prefill runs the stack over the new rows of all its sequences at once (varlen, no padding):
  products and elementwise functions as above; attention, the conv and the scan per sequence.
  So a sequence's prefill bits depend on its own chunk only, not on what it is batched with;
  the same chunk boundaries give the same bits (a request snapshotted mid-prefill resumes
  exactly); other boundaries move the SSD scan's and the attention kernel's split points
  (tests/test_chunked_prefill.py bounds that within 1e-5).
- A decode step can also run at a padded bucket shape, captured as a CUDA graph on a GPU
  (`actors.graph`): the padding rows change no real row's bits, by the same invariance.

Weights are created empty; load them with `actors.loader.load_hf_state_dict` (Hugging Face
names) or build the model through `actors.loader.load_checkpoint` / `actors.presets.load_preset`.
"""

from __future__ import annotations

import contextlib
import os
import time
import zlib
from typing import Callable, Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actors.batch import ForwardBatch
from actors.config import ModelConfig
from actors.ffn import SwiGLU  # noqa: F401  (re-exported: it lived here)
from actors.layers import KINDS, LAYOUTS, build_ffn
from actors import kernel_choice, rowdot, triton_route
from actors.mamba import Kernels, rowwise
from actors.norms import ARCH_NORM_STYLE, RMSNorm


class PoolTensors(Protocol):
    """The state tensors a forward reads and writes (see `actors.pools`).

    tensor("k"), tensor("v"): (num_attention_layers, num_token_slots, kv_heads, head_dim).
    tensor(name) for each of `config.state_tensors`: (layers of its kind, num_slots, *shape), e.g.
    "conv" (num_mamba_layers, slots, conv_dim, d_conv - 1) and "ssm" (.., heads, head_dim,
    d_state) fp32; "gdn_conv" and "gdn_state" (.., v_heads, d_k, d_v) fp32.
    """

    def tensor(self, name: str) -> Tensor: ...


DECODE_TILE = 16  # rows per matrix-kernel call in decode (see `tiled_linear`)
PREFILL_TILE = 128  # rows per matrix-kernel call in prefill


def tiled_linear(x: Tensor, weight: Tensor, bias: Tensor | None, tile: int) -> Tensor:
    """F.linear through matrix-kernel calls of exactly `tile` rows each (the last zero-padded).

    x (M, in) -> (M, out). Every call is `weight @ x_tile^T`, (out, in) @ (in, tile): one fixed
    shape, so a row's result depends neither on M nor on the other rows' values or order
    (tests/test_batch_invariance.py holds this, with negative controls). The weight goes on
    the left because the CPU BLAS is faster that way for few rows (measured ~30% at 16 rows).
    """
    return TiledLinear(tile, pack=False, row_free=False)(x, weight, bias)


PACK_ROWS = 128  # MKL packs each fp32 weight once, for calls of this many rows
MAX_CALL_ROWS = 256  # a row-free decode call takes at most this many rows (all of them probed)
PREFILL_CALL_ROWS = 2048  # a row-free prefill call takes at most this many rows
PROBE_ROWS = tuple(range(1, 34)) + (64, 100) + tuple(range(120, 136)) + (200, 255, 256)  # every count to
#   33, and 16 in a row past 100: MKL's kernels block the rows (by 4 on an Intel Xeon's AVX2 path,
#   where counts of 2 and 3 mod 4 give other bits at every size: a sparser set, all 0 or 1 mod 4
#   past 31, passed such shapes), so every residue is checked at small and at larger counts
PROBE_ROWS_LARGE = (300, 301, 302, 303, 512, 1000, 2048)  # checked against 256-row calls once those pass
PROBE_SET = f"rows {zlib.crc32(repr((PROBE_ROWS, PROBE_ROWS_LARGE)).encode()):08x}"  # in each answer's cache
#   key: an answer from another set of counts is probed again
_MIN_ROWS: dict[tuple[int, int, int, int, torch.dtype, bool], int | None] = {}  # (out, in, tile, threads,
#   dtype, packed) -> probed: fewest rows of a row-free call of this shape on that path (packed:
#   MKL's packed fp32 GEMM; else `weight @ x^T`), smaller calls zero-padded up to it; None: tiles
_ROWDOT_SHAPES: dict[tuple[int, int, str], str] = {}  # (out, in, phase) of fp32 products `actors.rowdot`
#   ran -> its build
_PROBE_S: dict[str, float] = {}  # `path_name` -> seconds this process spent probing it (start-up cost)
_LONG_CALLS_FREE: dict[tuple[int, int, int, int], bool] = {}  # (out, in, min rows, threads) -> the
#   `PROBE_ROWS_LARGE` check's answer: it does not depend on the tile, so each tile's probe shares it


class TiledLinear:
    """`tiled_linear`, faster on the CPU: in fp32 `actors.rowdot` (row-free by construction, any
    row count in one call) where it builds and `native`; otherwise each fp32 weight prepacked
    once (MKL's packed GEMM, `torch.ops.mkl._mkl_linear`), and where a probe shows it safe, no
    tiles at all.

    Packing saves re-packing the weight on every call, which at few rows costs as much as the
    product itself. Measured (MKL, fp32): with a weight packed once for `PACK_ROWS` rows, a
    call of any row count from some small minimum on gives every row bit-identical to a
    `tile`-row call's (the packed kernel's summation order depends on the packing, not on the
    call's rows). That minimum depends on the CPU: 1 on the Intel Xeon this was tuned on; 4 on
    an AMD EPYC (Zen, MKL's generic dispatch with its Zen kernel), where calls of 1 to 3 rows
    take another kernel. So a batch of M rows is one call of max(M, minimum) rows, the padding
    rows zero: batch 1 costs the minimum, not a 16-row tile, and batch 32 is one call. This is
    not documented by MKL, so it is probed once per weight shape in this process (`PROBE_ROWS`:
    every count up to 33 and 16 in a row past 100, against `tile`-row calls, at two row offsets; calls
    are split at `max_rows`): the minimum is one above the largest failing count; where a count
    at or above `tile` fails, that shape falls back to exact `tile`-row calls (`kernel_paths`
    says which shape took which path). Other CPU dtypes (bf16), and fp32 without MKL packing,
    get the same probe in decode for the tiles' own product, `weight @ x^T`, at any row count
    (measured on an AMD EPYC without native bf16: row-free from 1 row, where a 16-row tile cost
    16 rows' time at batch 1). The packed copies cost about the model's fp32 size again,
    and the probe about 2,500 rows of each shape's product once per process (0.2 s for the
    `small` LM head on one thread; a 128k-vocabulary LM head of width 4096 would take ~30 s).
    """

    def __init__(self, tile: int, pack: bool = True, packs: dict | None = None,
                 max_rows: int | None = MAX_CALL_ROWS, row_free: bool = True, native: bool = True,
                 kernel: str | None = None) -> None:
        if tile < 1:
            raise ValueError(f"tile must be >= 1, got {tile}")
        self.tile, self.pack = tile, pack and _mkl_packed_available()
        self.row_free = row_free  # False: always exact tile calls (the probe's reference)
        self.native = native and row_free  # fp32 on the CPU: the kernel `actors.kernel_choice`
        #   picks (False: MKL's probed path)
        self.kernel = kernel  # one of `kernel_choice.candidates()` forced for every shape (None: chosen)
        if kernel is not None and kernel not in kernel_choice.candidates():
            raise ValueError(f"kernel {kernel!r} does not run here: one of {kernel_choice.candidates()}")
        self.max_rows = max_rows  # row-free calls are split here (None: never; prefill, whose
        #   rows all belong to one sequence's chunk, needs no invariance across row counts)
        self.phase = "decode" if max_rows is not None and max_rows <= MAX_CALL_ROWS else "prefill"
        self._packed = packs if packs is not None else {}  # id(weight) -> (weight, MKL-packed),
        #   ("panel", id(weight)) -> (weight, `rowdot.pack_panels`)
        self._plans: dict[int, tuple] = {}  # id(weight) -> (weight, bias, x's dtype, run): see __call__
        self._context = _paths_context()  # see refresh

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """x (M, in) -> (M, out), contiguous. The path is worked out once per weight (`_plan`)
        and again when x's dtype or the bias changes, or after `refresh` found what every path
        depends on changed: a decode step makes ~45 of these calls, and working the path out
        each time cost more than a batch-1 product."""
        plan = self._plans.get(id(weight))
        if plan is None or plan[0] is not weight or plan[1] is not bias or plan[2] is not x.dtype:
            plan = self._plans[id(weight)] = (weight, bias, x.dtype, self._plan(x, weight, bias))
        return plan[3](x)

    def refresh(self) -> TiledLinear:
        """Forgets every path if torch's thread count or the kernel forced in the environment
        (`RAYSCHED_KERNEL`) changed since the paths were worked out; once per forward
        (`HybridLM._tiled`), not once per product (reading the environment costs ~1 µs)."""
        context = _paths_context()
        if context != self._context:
            self._plans.clear()
            self._context = context
        return self

    def _plan(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Callable[[Tensor], Tensor]:
        """How products of this weight with inputs like x run: x (M, in) -> (M, out)."""
        if self.native and x.dtype == torch.float32 and x.device.type == "cpu":
            kernel = self.kernel or kernel_choice.choose(weight.shape, self.phase)
            if kernel.startswith("rowdot "):
                build = kernel[7:]
                _ROWDOT_SHAPES[(*weight.shape, self.phase)] = build
                if kernel == kernel_choice.PANEL:  # (M, out): row-free, any M, every build's bits
                    return rowdot.panel_product(weight, bias, packed=self._panel_weight(weight))
                return rowdot.product(weight, bias, rowdot.library(build))  # (M, out): row-free, any M
        call, max_rows = self._row_free_call(x, weight, bias), self.max_rows
        if call is None:
            return lambda x: self._tiles(x, weight, bias)

        def row_free(x: Tensor) -> Tensor:
            x = x.contiguous()
            if not max_rows or x.shape[0] <= max_rows:
                return call(x)  # (M, out): one call (every decode step up to MAX_CALL_ROWS rows)
            return torch.cat([call(part) for part in x.split(max_rows)])  # (M, out)
        return row_free

    def _tiles(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """Exact `tile`-row calls: x (M, in) -> (M, out)."""
        M = x.shape[0]
        padded = F.pad(x, (0, 0, 0, (-M) % self.tile))  # (ceil(M/tile)*tile, in)
        outs = [self._one_tile(t, weight, bias) for t in padded.split(self.tile)]  # (tile, out)
        return (outs[0] if len(outs) == 1 else torch.cat(outs))[:M].contiguous()  # (M, out)

    def _row_free_call(self, x: Tensor, weight: Tensor, bias: Tensor | None):
        """One call of any row count, where the probe found this shape row-free on the CPU:
        MKL's packed GEMM in fp32; otherwise (bf16, or fp32 without MKL packing) the tiles'
        own `weight @ x^T` at any row count, in decode only (its calls stay within the probed
        `MAX_CALL_ROWS`). None: exact tiles."""
        if not self.row_free or x.device.type != "cpu":
            return None
        if self.pack and x.dtype == torch.float32:
            min_rows = self._min_rows(weight, x.dtype, packed=True)
            packed = self._packed_weight(weight) if min_rows is not None else None
            return None if packed is None else lambda part: _packed_call(part, packed, weight, bias, min_rows)
        if self.max_rows is None or self.max_rows > MAX_CALL_ROWS:
            return None
        min_rows = self._min_rows(weight, x.dtype, packed=False)
        return None if min_rows is None else lambda part: _plain_call(part, weight, bias, min_rows)

    def _one_tile(self, t: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """t (tile, in) -> (tile, out)."""
        if self.pack and t.device.type == "cpu" and t.dtype == torch.float32:
            return torch.ops.mkl._mkl_linear(t, self._packed_weight(weight), weight, bias, self.tile)
        out = torch.mm(weight, t.t()).t()  # (tile, out)
        return out + bias if bias is not None else out  # one rounding per element

    def _packed_weight(self, weight: Tensor) -> Tensor:
        entry = self._packed.get(id(weight))
        if entry is None or entry[0] is not weight:
            entry = (weight, torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_ROWS))
            self._packed[id(weight)] = entry
        return entry[1]

    def _panel_weight(self, weight: Tensor) -> Tensor:
        """The weight packed for `rowdot.panel_product`, once (shared by decode and prefill)."""
        entry = self._packed.get(("panel", id(weight)))
        if entry is None or entry[0] is not weight:
            entry = self._packed[("panel", id(weight))] = (weight, rowdot.pack_panels(weight))
        return entry[1]

    def _min_rows(self, weight: Tensor, dtype: torch.dtype, packed: bool) -> int | None:
        """Fewest rows of a row-free call of this weight's shape in `dtype`, on the packed path
        or the plain one; None: use tiles."""
        return probed_min_rows(weight.shape[0], weight.shape[1], self.tile, dtype, packed)


def _vector_rowdot() -> bool:
    """rowdot loads a vector build here (AVX-512 or AVX2): its attention and scan kernels run
    only there (the portable build's per-lane `fmaf` is slower than torch's calls)."""
    return rowdot.variant() not in (None, "portable")


def _paths_context() -> tuple[int, str | None]:
    """What every kept `TiledLinear` path depends on besides its weight, bias and x's dtype:
    torch's thread count and the kernel forced in the environment."""
    return torch.get_num_threads(), os.environ.get(kernel_choice.ENV_FORCE)


def probed_min_rows(out_features: int, in_features: int, tile: int, dtype: torch.dtype = torch.float32,
                    packed: bool = True) -> int | None:
    """`_probe_min_rows`' answer, probed once per machine (kept in `actors.kernel_choice`'s
    cache file) and once per process read."""
    # The answer depends on the tile it is held against and on the intra-op thread count (MKL
    # may split a call's rows among threads): probed again for each, whoever asks first.
    key = (out_features, in_features, tile, torch.get_num_threads(), dtype, packed)
    if key not in _MIN_ROWS:
        t0 = time.perf_counter()
        name = path_name(dtype, packed)
        _MIN_ROWS[key] = kernel_choice.cached(
            f"probe {name} {out_features}x{in_features} tile {tile} {key[3]}t {PROBE_SET}",
            lambda: _probe_min_rows(*key[:3], dtype=dtype, packed=packed))
        _PROBE_S[name] = _PROBE_S.get(name, 0.0) + time.perf_counter() - t0
    return _MIN_ROWS[key]


def path_name(dtype: torch.dtype, packed: bool) -> str:
    """"packed" (MKL's packed fp32 GEMM) or "plain <dtype>" (`weight @ x^T`)."""
    return "packed" if packed else f"plain {_dtype_name(dtype)}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    """x (M, in) zero-padded to at least `rows` rows (itself when it has them)."""
    M = x.shape[0]
    return x if M >= rows else torch.constant_pad_nd(x, (0, 0, 0, rows - M))  # (max(M, rows), in)


def _packed_call(x: Tensor, packed: Tensor, weight: Tensor, bias: Tensor | None,
                 min_rows: int) -> Tensor:
    """One packed MKL call on x (M, in) contiguous, zero-padded to `min_rows` rows. -> (M, out)."""
    M = x.shape[0]
    if M >= min_rows:
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, M)
    return torch.ops.mkl._mkl_linear(_pad_rows(x, min_rows), packed, weight, bias, min_rows)[:M]


def _plain_call(x: Tensor, weight: Tensor, bias: Tensor | None, min_rows: int) -> Tensor:
    """A tile's product at any row count: `weight @ x^T` on x (M, in), zero-padded to
    `min_rows` rows, then the bias (one rounding per element, as in a tile). -> (M, out)."""
    M = x.shape[0]
    out = torch.mm(weight, _pad_rows(x, min_rows).t()).t()
    out = out + bias if bias is not None else out
    return out[:M].contiguous()


def _device_kernel(model: "HybridLM") -> str:
    """What decides the bits off the CPU: the fixed-tile Triton kernels where the forward routes
    there (`actors.triton_route`), else torch's own kernels (cuBLAS picks by shape)."""
    from actors import triton_route

    probe = torch.empty(0, device=model.device)
    if model.invariant_tile is None or not triton_route.routes(probe):
        return f"{model.device.type} torch"
    from actors.triton_kernels import MATMUL

    return f"{model.device.type} triton {MATMUL.block_m}x{MATMUL.block_n}x{MATMUL.block_k}"


def matrix_kernel(model: "HybridLM") -> str:
    """The kernels that decide `model`'s bits in this process, as a worker reports them: on the
    CPU its linear layers' (fp32: the kernel chosen per shape and phase, `kernel_choice.summary`,
    measured here at the first ask on this machine; "mkl" for MKL's probed path or another dtype;
    "plain" without invariance), MKL's GEMM fingerprint (its batched products and attention) and
    ATen's CPU capability (its elementwise kernels), "ssd fused" where decode's SSD update
    takes `rowdot.ssd_update` and "attention and scan fused" where attention (decode and
    prefill) and prefill's SSD scan take `rowdot.decode_attention`, `rowdot.prefill_attention`
    and `rowdot.ssd_scan`, e.g. "decode rowdot avx2+fma, prefill mkl packed; mkl
    930887e8e594; aten AVX2; ssd fused"; elsewhere the device type ("cuda"). Two workers with
    the same answer give a moved request the same bits."""
    if model.device.type != "cpu":
        return _device_kernel(model)
    from actors.cpu_info import gemm_fingerprint

    if model.invariant_tile is None:
        linear = "plain"
    elif model.dtype == torch.float32 and model.rowdot:
        shapes = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)]
        linear = (f"all {model.linear_kernel}" if model.linear_kernel
                  else kernel_choice.summary(shapes + [tuple(model.lm_head_weight.shape)]))
    else:
        linear = "mkl"
    fused = model.fused_updates()
    ssd = ("; ssd fused" if fused else "") + ("; attention and scan fused" if fused and _vector_rowdot() else "")
    return f"{linear}; mkl {gemm_fingerprint()}; aten {torch.backends.cpu.get_cpu_capability()}{ssd}"


def kernel_paths() -> dict[str, str]:
    """What ran each weight shape's products in this process, by "out x in" (and the dtype of a
    plain path): "rowdot <build>, row-free by construction" (fp32, `actors.rowdot`, by phase),
    or what the probe chose: "packed, row-free from N rows", "weight @ x^T, row-free from N
    rows" or "tiles of T" (`TiledLinear`)."""
    out = {f"{o}x{i} fp32 {phase}": f"rowdot {build}, row-free by construction"
           for (o, i, phase), build in sorted(_ROWDOT_SHAPES.items())}
    for (o, i, t, n, dtype, packed), m in sorted(_MIN_ROWS.items(), key=lambda kv: (*kv[0][:4], str(kv[0][4]))):
        kind = "" if packed else f" {_dtype_name(dtype)}"
        how = "packed" if packed else "weight @ x^T"
        out[f"{o}x{i}{kind} (tile {t}, {n} thread{'s' if n > 1 else ''})"] = (
            f"tiles of {t}" if m is None else f"{how}, row-free from {m} rows")
    return out


def probe_seconds() -> dict[str, float]:
    """Seconds this process has spent in the probe, by path ("packed", "plain bfloat16"): the
    start-up cost of row-free calls, paid at each shape's first product."""
    return dict(_PROBE_S)


def _probe_min_rows(out_features: int, in_features: int, tile: int, dtype: torch.dtype = torch.float32,
                    packed: bool = True) -> int | None:
    """Fewest rows m <= `tile` such that calls of every probed count >= m, at row offsets 0
    and 3, give rows bit-identical to `tile`-row calls on a random (out, in) weight of `dtype`.
    Packed (MKL, fp32; decode and prefill): also calls of every `PROBE_ROWS_LARGE` count (the
    first at both offsets, the others at 0) against
    `MAX_CALL_ROWS`-row calls (the cheap reference for long prefill calls). Plain (`weight @
    x^T`, decode only): counts up to `MAX_CALL_ROWS`. None: no such m (use tiles)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = torch.randn(max(PROBE_ROWS_LARGE if packed else PROBE_ROWS) + 3, in_features, generator=g).to(dtype)
    ref = TiledLinear(tile, pack=packed, row_free=False)  # exact tile-row calls (on the same packing)
    small = x[: max(PROBE_ROWS) + 3]
    expected = ref(small, w, None)  # (rows, out)
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.5)
    if not torch.allclose(expected.float(), F.linear(small.float(), w.float()), **tol):
        return None  # not even the tile calls agree with a plain product: trust nothing here
    if not packed:
        return _fewest_free_rows(lambda rows: _plain_call(rows, w, None, rows.shape[0]), small, expected, tile)
    packed_w = ref._packed_weight(w)
    call = lambda rows: torch.ops.mkl._mkl_linear(rows.contiguous(), packed_w, w, None, rows.shape[0])
    min_rows = _fewest_free_rows(call, small, expected, tile)
    if min_rows is None:
        return None
    key = (out_features, in_features, min_rows, torch.get_num_threads())
    if key not in _LONG_CALLS_FREE:
        expected = torch.cat([_packed_call(part, packed_w, w, None, min_rows)
                              for part in x.split(MAX_CALL_ROWS)])  # now proven row-free
        _LONG_CALLS_FREE[key] = (_rows_match(call, x, expected, PROBE_ROWS_LARGE[:1])  # and at offset 3:
                                 and _rows_match(call, x, expected, PROBE_ROWS_LARGE[1:], offsets=(0,)))
    return min_rows if _LONG_CALLS_FREE[key] else None


def _fewest_free_rows(call, x: Tensor, expected: Tensor, tile: int) -> int | None:
    """One above the largest `PROBE_ROWS` count whose call(x[at:at + m]) differs from
    `expected` (the tile calls' rows), if that is at most `tile`; else None."""
    failing = [m for m in PROBE_ROWS if not _rows_match(call, x, expected, (m,))]
    min_rows = max(failing, default=0) + 1
    return min_rows if min_rows <= tile else None


def _rows_match(call, x: Tensor, expected: Tensor, counts: tuple[int, ...],
                offsets: tuple[int, ...] = (0, 3)) -> bool:
    """call(x[at:at + m]) == expected[at:at + m] for every count m, at each offset (the largest
    counts at offset 0 only: the offset's effect is shown on the smaller ones, at a fraction of
    the probe's cost)."""
    return all(torch.equal(call(x[at:at + m]), expected[at:at + m]) for m in counts for at in offsets)


def _mkl_packed_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class DecoderLayer(nn.Module):
    """norm -> mixer -> residual [-> norm -> feed-forward -> residual], by kind and architecture.

    `kind` is the layer's entry of `config.layer_types`; `pool_index` its index among the layers
    of its kind (into the pool tensors that kind declares).
    """

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        layout = LAYOUTS[config.architecture]
        self.kind = config.layer_types[layer_id]
        self.spec = KINDS[self.kind]
        self.pool_index = config.layers_of_kind(self.kind).index(layer_id)
        self.residual_multiplier = config.residual_multiplier
        self.mixer_name, self.norm_names = layout.mixer_names[self.kind], layout.norm_names
        style = ARCH_NORM_STYLE[config.architecture]
        for name in self.norm_names:
            setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, style))
        setattr(self, self.mixer_name, self.spec.build(config, dtype))
        self.ffn_names = []
        for name in layout.ffn_names:
            part = build_ffn(config, name, dtype, layer_id)
            if part is not None:
                setattr(self, name, part)
                self.ffn_names.append(name)

    @property
    def is_attention(self) -> bool:
        return self.kind == "attention"

    def _state(self, pool: PoolTensors) -> tuple[Tensor, ...]:
        return tuple(pool.tensor(name)[self.pool_index] for name in self.spec.state)

    def prefill(self, h: Tensor, batch: ForwardBatch, pool: PoolTensors, kernels: Kernels) -> Tensor:
        """The next tokens of each sequence of a prefill batch, rows concatenated. h (T, hidden)."""
        x = getattr(self, self.norm_names[0])(h)
        mixed = self.spec.prefill(getattr(self, self.mixer_name), x, batch, self._state(pool), kernels)
        return self._feed_forward(self._residual(h, mixed), kernels)

    def decode(self, h: Tensor, batch: ForwardBatch, pool: PoolTensors, kernels: Kernels) -> Tensor:
        """One token per request. h (R, hidden) -> (R, hidden)."""
        x = getattr(self, self.norm_names[0])(h)
        mixed = self.spec.decode(getattr(self, self.mixer_name), x, batch, self._state(pool), kernels)
        return self._feed_forward(self._residual(h, mixed), kernels)

    def _residual(self, h: Tensor, update: Tensor) -> Tensor:
        if self.residual_multiplier != 1.0:
            update = update * self.residual_multiplier
        return h + update  # (T, hidden)

    def _feed_forward(self, h: Tensor, kernels: Kernels) -> Tensor:
        if not self.ffn_names:
            return h
        x = getattr(self, self.norm_names[1])(h)
        out = getattr(self, self.ffn_names[0])(x, kernels)  # (T, hidden)
        for name in self.ffn_names[1:]:
            out = out + getattr(self, name)(x, kernels)
        return self._residual(h, out)  # (T, hidden)


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")


@contextlib.contextmanager
def unfilled_parameters() -> Iterator[None]:
    """Modules built inside skip `torch.nn.init`'s fills: their parameters are loaded from a
    checkpoint afterwards. On the meta device a fill would import torch._dynamo (~1.4 s of every
    worker's start-up, for values that are thrown away)."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class HybridLM(nn.Module):
    """Bamba-style hybrid LM whose state lives in an external pool.

    Args:
        config: hyper-parameters.
        dtype: parameter / activation dtype (the SSM state is always fp32).
        device: where the (empty) parameters are allocated.
        invariant_tile: rows per matrix-kernel call in decode (see `tiled_linear`); None runs
            plain F.linear and elementwise functions over the whole batch (faster, not
            batch-invariant).

    Example:
        model, config = load_preset("tiny", torch.float32, "cpu")
        logits = model(batch, pool)  # (B, vocab) fp32, last token of each sequence
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu",
                 invariant_tile: int | None = DECODE_TILE) -> None:
        super().__init__()
        self.config, self.dtype, self.invariant_tile = config, dtype, invariant_tile
        with torch.device("meta"), unfilled_parameters():
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(DecoderLayer(config, i, dtype)
                                        for i in range(config.num_hidden_layers))
            self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype,
                                           ARCH_NORM_STYLE[config.architecture])
            if not config.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                         dtype=dtype)
        self.to_empty(device=device)
        self.requires_grad_(False)
        self.rowdot = True  # fp32 CPU products through the kernel `actors.kernel_choice` picks per
        #   shape and phase (False: all on MKL's probed path, as where rowdot does not build)
        self.linear_kernel: str | None = None  # one of `kernel_choice.candidates()` forced for every
        #   fp32 CPU product (None: the chooser's)
        self._linears: dict[tuple, TiledLinear] = {}
        self._packs: dict[int | tuple[str, int], tuple[Tensor, Tensor]] = {}  # packed weights, shared by
        #   the kernels

    @property
    def device(self) -> torch.device:
        """Where the parameters live."""
        return self.embed_tokens.weight.device

    @property
    def lm_head_weight(self) -> Tensor:
        """(vocab, hidden): the embedding matrix when the config ties them."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        return self.lm_head.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: PoolTensors) -> Tensor:
        """Run a prefill or decode batch: fp32 logits of each sequence's last token (B, vocab)."""
        if not batch.is_prefill:
            return self._decode(batch, pool)
        return self._prefill(batch, pool, last_only=True)  # (B, vocab)

    @torch.inference_mode()
    def forward_all_logits(self, batch: ForwardBatch, pool: PoolTensors) -> Tensor:
        """Like `forward`, but a prefill returns the logits of every token (T, vocab), fp32."""
        if not batch.is_prefill:
            return self._decode(batch, pool)
        return self._prefill(batch, pool, last_only=False)  # (T, vocab)

    def _prefill(self, batch: ForwardBatch, pool: PoolTensors, last_only: bool) -> Tensor:
        """The whole stack over all sequences' new tokens at once; logits (B or T, vocab)."""
        kernels = self.prefill_kernels()
        h = self._embed(batch.input_ids)  # (T, hidden)
        for layer in self.layers:
            h = layer.prefill(h, batch, pool, kernels)  # (T, hidden)
        if last_only:
            h = h[[seg.rows.stop - 1 for seg in batch.segments]]  # (B, hidden)
        return self._logits(h, kernels)

    def _decode(self, batch: ForwardBatch, pool: PoolTensors) -> Tensor:
        """One token per request; logits (R, vocab)."""
        if batch.kv_slots is None and batch.table is None and self.config.num_attention_layers:
            raise ValueError("decode batch needs kv_slots (or a KV table) for the attention layers")
        kernels = self.decode_kernels()
        h = self._embed(batch.input_ids)  # (R, hidden)
        for layer in self.layers:
            h = layer.decode(h, batch, pool, kernels)  # (R, hidden)
        return self._logits(h, kernels)

    def decode_kernels(self) -> Kernels:
        """Batch-invariant kernels for decode, or plain ones when invariant_tile is None."""
        if self.invariant_tile is None:
            return Kernels()
        if triton_route.routes(self.embed_tokens.weight):  # CUDA: the fixed-tile Triton matmul
            return Kernels(linear=triton_route.linear, pointwise=rowwise)
        return Kernels(linear=self._tiled(self.invariant_tile, True, MAX_CALL_ROWS), pointwise=rowwise,
                       **self.fused_updates())

    def fused_updates(self) -> dict:
        """Decode's Mamba2 state updates in one pass over each state, and its attention read
        from the pool by slot, as `Kernels` fields (`rowdot.ssd_update`, `rowdot.decode_attention`:
        the same bits on every build; `rowdot.conv_update`: the torch path's bits) on the CPU
        where rowdot loads and `rowdot` is on (the attention not on the portable build, slower
        there than torch's); {} elsewhere (the torch calls of `actors.mamba.ssd_step`,
        `causal_conv_step` and `actors.attention.chunked_decode_attention`)."""
        cpu = self.device.type == "cpu" and self.invariant_tile is not None
        if not (cpu and self.rowdot and rowdot.available()):
            return {}
        fused = {"ssd_update": rowdot.ssd_update, "conv_update": rowdot.conv_update}
        if _vector_rowdot():
            fused["decode_attention"] = rowdot.decode_attention
        return fused

    def fused_prefill(self) -> dict:
        """Prefill's conv and its scan's recurrence over chunks in one pass each
        (`rowdot.conv_prefill`, `rowdot.ssd_carry`: the fp32 torch path's bits) as `Kernels`
        fields, where `fused_updates` gives decode's, and on a vector build the whole SSD scan
        in one pass per head and the causal attention row by row (`rowdot.ssd_scan`,
        `rowdot.prefill_attention`: the same bits on every build); {} elsewhere."""
        fused = self.fused_updates()
        if not fused:
            return {}
        out = {"conv_prefill": rowdot.conv_prefill, "ssd_carry": rowdot.ssd_carry}
        if _vector_rowdot():
            out.update(ssd_scan=rowdot.ssd_scan, prefill_attention=rowdot.prefill_attention)
        return out

    def prefill_kernels(self) -> Kernels:
        """Batch-invariant kernels for prefill, or plain ones when invariant_tile is None.

        A prefill forward holds the new rows of several sequences, so, as in decode, a row's
        bits must not depend on the other rows: matrix products are row-free packed calls of
        up to `PREFILL_CALL_ROWS` rows (or tiles of `PREFILL_TILE` where the probe fails) and
        elementwise functions run `rowwise`."""
        if self.invariant_tile is None:
            return Kernels()
        if triton_route.routes(self.embed_tokens.weight):  # CUDA: the fixed-tile Triton matmul
            return Kernels(linear=triton_route.linear, pointwise=rowwise)
        return Kernels(linear=self._tiled(PREFILL_TILE, True, PREFILL_CALL_ROWS), pointwise=rowwise,
                       **self.fused_prefill())

    def _tiled(self, tile: int, pack: bool, max_rows: int | None) -> TiledLinear:
        """One `TiledLinear` per (tile, pack, max_rows, rowdot, linear_kernel), kept so its packed
        weights are made once (and shared between decode's and prefill's)."""
        key = (tile, pack, max_rows, self.rowdot, self.linear_kernel)
        lin = self._linears.get(key)
        if lin is None:
            lin = self._linears[key] = TiledLinear(tile, pack, self._packs, max_rows, native=self.rowdot,
                                                   kernel=self.linear_kernel)
        return lin.refresh()

    def _embed(self, input_ids: Tensor) -> Tensor:
        """(T,) -> (T, hidden), times Granite's embedding multiplier."""
        h = F.embedding(input_ids, self.embed_tokens.weight)  # (T, hidden)
        m = self.config.embedding_multiplier
        return h if m == 1.0 else h * m

    def _logits(self, h: Tensor, kernels: Kernels) -> Tensor:
        """Final norm and LM head: h (T, hidden) -> fp32 logits (T, vocab) (/ Granite's scaling)."""
        logits = kernels.linear(self.final_layernorm(h), self.lm_head_weight, None)
        scaling = self.config.logits_scaling
        return (logits if scaling == 1.0 else logits / scaling).float()
