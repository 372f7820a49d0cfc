"""`linear`: fp32 matrix products on the CPU that are batch invariant by construction.

`actors/rowdot.c` computes each output element as one 8-lane dot product in a fixed order (see
its header), so a row's bits depend on nothing but that row and the weight: not on the call's
row count, nor on the other rows. MKL gives no such contract (its kernel, and so a row's bits,
changes with the call's rows on some CPUs; `actors.model.TiledLinear` probes around that), and
measured on an AMD EPYC Zen 2 (1 thread, every `small` weight in turn) this kernel is also the
faster one at every batch: 12 ms against MKL's padded 4-row packed calls' 30 at 1 row, 58
against 72 at 32 rows, and on par at 2,048.

The C source is compiled once per machine with the system C compiler (about a second) into a
cache directory (`RAYSCHED_KERNEL_CACHE`, else `$XDG_CACHE_HOME/raysched`, else
`~/.cache/raysched`; where that cannot be written, a per-user directory under the system's
temporary one), named by a hash of the source, the flags and the compiler, and loaded with
ctypes. Builds (`BUILDS`): "avx512f" (16 lanes, fused multiply-add) where the CPU has AVX-512F,
"avx2+fma" (8 lanes, fused multiply-add) where it has AVX2 and FMA, "portable" (8 lanes,
multiply then add) everywhere; `variant()` is the widest this CPU runs, and
`actors.kernel_choice` measures each build this CPU runs (`builds_here()`) against MKL's packed
path per weight shape. The bits differ between builds, never within one (so, as with MKL,
workers whose products take different builds do not agree bit for bit). `compile_only` builds
without loading: the AVX-512 source is compile-checked on CPUs that cannot run it. Without a compiler, or with `RAYSCHED_ROWDOT=0`, `available()` is False and the
products take MKL's probed path (one warning line says why).

`panel_product` is the same product with no sum across lanes: the weight packed once in
panels of columns (`pack_panels`), each output one lane of a fused multiply-add chain over k in
order, rows sharing each weight load in blocks of up to 8. Its bits do not depend on the build
(AVX-512, AVX2 and the portable build's `fmaf` agree), and it is the fastest candidate where
measured (an AMD EPYC Zen 4, 1 thread: 104-110 GFLOP/s at 8 to 256 rows against 63-84 for the
dot-product builds and 59-92 for MKL; see `benchmarks/README.md`).

`ssd_update` and `conv_update` (the same library) are decode's Mamba2 state updates in one pass
over each request's state, fused from the torch calls of `actors.mamba.ssd_step` and
`causal_conv_step`, and `conv_prefill` and `ssd_carry` are prefill's conv (`causal_conv_prefill`)
and its scan's recurrence over chunks (`actors.mamba._carry_states`) in one pass;
plain C built without fused multiply-adds, so their bits are the same on every build (and the
convs' are the fp32 torch path's: the same products and adds, in its order). `rms_norm` is an
RMSNorm in one pass a row, its mean square summed in the fixed tree order that
`actors.norms.tree_inv_rms` writes out in torch ops (the same bits, every build).

`decode_attention` (decode's attention, each request's keys read from the pool by slot: no
gather), `prefill_attention` (prefill's causal attention, each query row on its own: no tiles)
and `ssd_scan` (prefill's whole chunked SSD scan, chunk by chunk with every head's state kept in
cache) have orders of their own, not torch's: lane-wise fused multiply-add chains, sums folded
in one fixed tree, and an exp of their own (`rowdot_exp`), so their bits are the same on every
build. Measured on an AMD EPYC Zen 4 (1 thread): decode attention at batch 8 over 1,700-token
contexts 1.0 ms a layer against the torch path's 4.5-6; a 2,048-token `small` layer's prefill
attention 50 ms against one causal SDPA call's 65-68, and its scan 11 ms against 22-26. The model takes them on the vector builds only (the portable build's
per-lane `fmaf` is slower than torch).

Threads: a call is one thread; with torch set to more than one thread, a large call's columns
(an SSD update's requests) are split among a pool (ctypes releases the GIL), which changes no bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from actors.cpu_info import cpu_flags
from actors.kept import kept
from actors.pages import huge_page_empty

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rowdot.c")
ENV_SWITCH = "RAYSCHED_ROWDOT"  # "0": never use the kernel
SPLIT_MACS = 1 << 22  # a call of at least this many multiply-adds is split among threads
SPLIT_STATE = 1 << 20  # an SSD update over at least this many state elements is split among threads
BUILDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # name -> (CPU flags it needs, cc flags)
    "avx512f": (("avx512f", "avx2", "fma"), ("-mavx512f", "-mavx2", "-mfma")),
    "avx2+fma": (("avx2", "fma"), ("-mavx2", "-mfma")),
    "portable": ((), ("-DROWDOT_PORTABLE",)),
}  # widest first
_STATE: dict[str, object] = {}  # "lib": the loaded library or None; "why": why not
_BUILT: dict[str, tuple[object, str | None]] = {}  # build name -> load()'s answer, this process
_LOCK = threading.Lock()
_CHECKED: dict = {}  # the slots `_slots` checked last (`actors.kept`)


def available() -> bool:
    """Whether `linear` can run here (built and loaded once per process, on first ask)."""
    return _library() is not None


def variant() -> str | None:
    """"avx512f", "avx2+fma" or "portable": the widest build this CPU runs (the default); None
    when none loads."""
    lib = _library()
    return None if lib is None else lib.rowdot_variant().decode()


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    _library()
    return _STATE.get("why")  # type: ignore[return-value]


def builds_here() -> tuple[str, ...]:
    """The builds this CPU can run, widest first ("portable" always last)."""
    flags = cpu_flags()
    return tuple(name for name, (needs, _) in BUILDS.items() if set(needs) <= flags)


def library(build: str):
    """The loaded `build` (one of `builds_here()`), once per process; None where it does not load."""
    if build not in _BUILT:
        with _LOCK:
            if build not in _BUILT:
                _BUILT[build] = load(build=build)
    return _BUILT[build][0]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, lib=None) -> Tensor:
    """x (M, in) @ weight (out, in)^T + bias (out,) -> (M, out), fp32 on the CPU (`lib`: a build
    from `load`, default this process's)."""
    return product(weight, bias, lib)(x)


def product(weight: Tensor, bias: Tensor | None, lib=None) -> Callable[[Tensor], Tensor]:
    """`linear` with this weight and bias, x (M, in) -> (M, out): what depends on the weight alone
    (its checks, its shape, the build) is worked out here, once, so that a call costs little more
    than the C call (a decode step makes ~45 of them, at batch 1 each a few microseconds). The
    weight is read in place on every call (a copy, kept, only where it is not contiguous)."""
    lib = _lib(lib)
    weight = weight.contiguous()
    N, K = weight.shape
    bias = _bias(bias, N)
    run = lib.rowdot_linear

    def call(x: Tensor) -> Tensor:  # (M, K) -> (M, N)
        x = _rows(x, K)
        M = x.shape[0]
        y = torch.empty(M, N, dtype=torch.float32)
        args = (run, x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), M, N, K)
        if M * N * K >= SPLIT_MACS:  # (`_in_parts` splits only with torch on more threads)
            _in_parts(N, True, lambda j0, j1: _columns(*args, j0, j1), align=8)
        else:
            _columns(*args, 0, N)  # small: no closure
        return y
    return call


def _bias(bias: Tensor | None, N: int) -> Tensor | None:
    """A product's bias, contiguous, after checking it has one value per output (N,)."""
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"rowdot: the bias has shape {tuple(bias.shape)}, the weight {N} rows")
    return bias.contiguous() if bias is not None else None


def _rows(x: Tensor, K: int) -> Tensor:
    """A product's input, contiguous, after checking it is (M, K) fp32 on the CPU: the kernels
    read raw pointers, so anything else would be read out of bounds or as the wrong numbers."""
    if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"rowdot: x must be (M, {K}) fp32 on the CPU, got {tuple(x.shape)} {x.dtype} "
                         f"on {x.device}")
    return x.contiguous()


def pack_panels(weight: Tensor, lib=None) -> Tensor:
    """weight (out, in) fp32 -> the panels `rowdot_panel_linear` reads: (ceil(out / cols), in, cols),
    panel p holding columns [p * cols, (p + 1) * cols) k-major, the last one zero-padded; `cols`
    is the build's `rowdot_panel_cols()` (32 on AVX-512, 16 elsewhere). A copy of the weight, on
    huge pages where the system gives them (`actors.pages`)."""
    cols = _lib(lib).rowdot_panel_cols()
    w = weight.float()
    N, K = w.shape
    whole, rest = divmod(N, cols)
    packed = huge_page_empty((whole + (rest > 0), K, cols))  # streamed by every call
    packed[:whole].copy_(w[:whole * cols].view(whole, cols, K).transpose(1, 2))
    if rest:  # the last panel: its columns, then zeros
        packed[whole, :, rest:].zero_()
        packed[whole, :, :rest].copy_(w[whole * cols:].t())
    return packed


def panel_product(weight: Tensor, bias: Tensor | None, lib=None, packed: Tensor | None = None
                  ) -> Callable[[Tensor], Tensor]:
    """`product` on the panel kernel (`rowdot_panel_linear`): each output one fused multiply-add
    chain over `in` in order, so its bits are the same on every build and depend on nothing but
    its row and the weight. `packed`: `pack_panels(weight, lib)` made already (else made here)."""
    lib = _lib(lib)
    N, K = weight.shape
    packed = pack_panels(weight, lib) if packed is None else packed
    cols = lib.rowdot_panel_cols()
    if packed.shape != ((N + cols - 1) // cols, K, cols) or not packed.is_contiguous():
        raise ValueError(f"rowdot: panels of shape {tuple(packed.shape)} are not {N}x{K}'s for this build")
    bias = _bias(bias, N)
    run, step = lib.rowdot_panel_linear, K * cols * 4  # bytes per panel

    def call(x: Tensor) -> Tensor:  # (M, K) -> (M, N)
        x = _rows(x, K)
        M = x.shape[0]
        y = torch.empty(M, N, dtype=torch.float32)
        xp, wp, bp, yp = x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr()
        if M * N * K < SPLIT_MACS:
            run(xp, wp, bp, yp, M, N, K, N)  # small: no closure
        else:  # column ranges start on a panel (`_in_parts` splits only with torch on more threads)
            _in_parts(N, True, lambda j0, j1: run(xp, wp + j0 // cols * step, None if bp is None else bp + 4 * j0,
                                                 yp + 4 * j0, M, j1 - j0, K, N), align=cols)
        return y
    return call


def ssd_update(state: Tensor, slots: Tensor, decay: Tensor, xdt: Tensor, B: Tensor, C: Tensor,
               lib=None) -> Tensor:
    """One decode token of the SSD recurrence, in place in `state` at `slots`, in one pass over
    each request's state (`rowdot_ssd_update` in rowdot.c: the same bits on every build).

    state (S, H, P, N) fp32 contiguous on the CPU, slots (R,) distinct, decay (R, H), xdt
    (R, H, P), B and C (R, G, N), all fp32. Returns y (R, H, P) fp32."""
    lib = _lib(lib)
    _check_state(state, "ssd_update")
    R, H, P = xdt.shape
    G, N = B.shape[-2], B.shape[-1]
    if state.shape[1:] != (H, P, N) or decay.shape != (R, H) or B.shape != (R, G, N) or C.shape != (R, G, N):
        raise ValueError(f"ssd_update: shapes {tuple(state.shape)}, {tuple(decay.shape)}, {tuple(xdt.shape)}, "
                         f"{tuple(B.shape)}, {tuple(C.shape)} do not agree")
    slots = _slots(slots, R, state.shape[0], "ssd_update")
    decay, xdt, B, C = (t.float().contiguous() for t in (decay, xdt, B, C))
    y = torch.empty(R, H, P, dtype=torch.float32)

    def rows(r0: int, r1: int) -> None:  # requests [r0, r1): each request's bits are its own
        lib.rowdot_ssd_update(state.data_ptr(), slots.data_ptr() + 8 * r0, r1 - r0, H, P, N, G,
                              decay.data_ptr() + 4 * r0 * H, xdt.data_ptr() + 4 * r0 * H * P,
                              B.data_ptr() + 4 * r0 * G * N, C.data_ptr() + 4 * r0 * G * N,
                              y.data_ptr() + 4 * r0 * H * P)

    _in_parts(R, R * H * P * N >= SPLIT_STATE, rows)
    return y


def conv_update(state: Tensor, slots: Tensor, x: Tensor, taps: Tensor, bias: Tensor | None,
                lib=None) -> Tensor:
    """One decode token of the causal depthwise conv and the shift of each request's conv
    state, in place at `slots`, in one pass (`rowdot_conv_update`: the torch path's order and
    roundings, so its bits).

    state (S, D, K-1) fp32 contiguous on the CPU, slots (R,) distinct, x (R, D), taps (K, D)
    (the weight transposed), bias (D,) or None, all fp32. Returns the pre-activation (R, D)."""
    lib = _lib(lib)
    _check_state(state, "conv_update")
    (R, D), K = x.shape, taps.shape[0]
    if state.shape[1:] != (D, K - 1) or taps.shape != (K, D) or (bias is not None and bias.shape != (D,)):
        raise ValueError(f"conv_update: shapes {tuple(state.shape)}, {tuple(x.shape)}, {tuple(taps.shape)} "
                         "do not agree")
    slots = _slots(slots, R, state.shape[0], "conv_update")
    x, taps = x.float().contiguous(), taps.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    out = torch.empty(R, D, dtype=torch.float32)
    lib.rowdot_conv_update(state.data_ptr(), slots.data_ptr(), R, D, K, x.data_ptr(), taps.data_ptr(),
                           None if bias is None else bias.data_ptr(), out.data_ptr())
    return out


def conv_prefill(window: Tensor, taps: Tensor, bias: Tensor | None, lib=None, out: Tensor | None = None) -> Tensor:
    """The causal depthwise conv over a prefill's rows in one pass (`rowdot_conv_prefill`: the
    fp32 CPU torch path's products and adds, in its order, so its bits on every build).

    window (K-1+L, D) fp32 on the CPU (the K-1 inputs before the first row, then the rows; each
    row contiguous, rows any distance apart: a slice of a wider projection is read in place),
    taps (K, D) (the weight transposed), bias (D,) or None. Returns the pre-activation (L, D),
    written into `out` (L, D) contiguous when given."""
    lib = _lib(lib)
    K, D = taps.shape
    L = window.shape[0] - (K - 1)
    if window.dtype != torch.float32 or not window.is_cpu or window.dim() != 2 or window.stride(1) != 1 \
            or window.stride(0) < D:
        raise ValueError("conv_prefill: the window must be fp32 rows on the CPU, each contiguous")
    if window.shape[1] != D or L < 0 or (bias is not None and bias.shape != (D,)):
        raise ValueError(f"conv_prefill: a window (K-1+L, D) and taps (K, D), got {tuple(window.shape)} "
                         f"and {tuple(taps.shape)}")
    taps = taps.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    if out is None:
        out = torch.empty(L, D, dtype=torch.float32)
    elif out.shape != (L, D) or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError(f"conv_prefill: out must be ({L}, {D}) fp32 contiguous")
    ld = window.stride(0)

    def rows(t0: int, t1: int) -> None:  # rows [t0, t1): each row's bits are its own
        lib.rowdot_conv_prefill(window.data_ptr() + 4 * t0 * ld, ld, t1 - t0, D, K, taps.data_ptr(),
                                None if bias is None else bias.data_ptr(), out.data_ptr() + 4 * t0 * D)

    _in_parts(L, L * D * K >= SPLIT_MACS, rows)
    return out


def ssd_carry(states: Tensor, local: Tensor, decay: Tensor, lib=None) -> None:
    """A chunked SSD scan's recurrence over chunk boundaries, in place: states[k+1] =
    states[k] * decay[k] + local[k] for each chunk k (`rowdot_ssd_carry`: the torch path's
    product and add, so its bits on every build).

    states (c+1, G, N, K, P) with the state entering the first chunk in states[0], local
    (c, G, N, K, P), decay (c, G, K); fp32 contiguous CPU tensors."""
    lib = _lib(lib)
    c, G, N, K, P = local.shape
    for name, t in (("states", states), ("local", local), ("decay", decay)):
        _check_state(t, "ssd_carry", name)
    if states.shape != (c + 1, G, N, K, P) or decay.shape != (c, G, K):
        raise ValueError(f"ssd_carry: shapes {tuple(states.shape)}, {tuple(local.shape)}, {tuple(decay.shape)} "
                         "do not agree")
    lib.rowdot_ssd_carry(states.data_ptr(), local.data_ptr(), decay.data_ptr(), c, G, N, K, P)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, starts: Tensor,
                     scale: float, lib=None) -> Tensor:
    """Decode attention of one query per request over its own keys, read in place from the pool
    by slot (`rowdot_decode_attention`: a request's bits depend on nothing but its query and its
    keys, the same on every build).

    q (R, Hq, D), k_cache and v_cache (S, Hkv, D), fp32 contiguous on the CPU; request r's key
    slots are slots[starts[r]:starts[r + 1]] (int64; `KVTable.flat`, `KVTable.starts`).
    Returns (R, Hq * D) fp32."""
    lib = _lib(lib)
    R, Hq, D = q.shape
    S, Hkv = k_cache.shape[0], k_cache.shape[1]
    for name, t in (("the keys", k_cache), ("the values", v_cache)):
        _check_state(t, "decode_attention", name)
    if k_cache.shape != (S, Hkv, D) or v_cache.shape != k_cache.shape or Hq % Hkv or starts.shape != (R + 1,):
        raise ValueError(f"decode_attention: shapes {tuple(q.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}, starts {tuple(starts.shape)} do not agree")
    q = q.float().contiguous()
    slots, starts = slots.to(torch.int64).contiguous(), starts.to(torch.int64).contiguous()
    longest = kept(_CHECKED, "attention", slots, lambda: _longest_request(slots, starts, S),
                   (S, starts.data_ptr()))  # once per batch's table, not once per layer
    scratch = _work("decode attention", max(1, Hq // Hkv * longest))
    out = torch.empty(R, Hq * D, dtype=torch.float32)
    lib.rowdot_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                                starts.data_ptr(), R, Hq, Hkv, D, scale, scratch.data_ptr(), out.data_ptr())
    return out


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, first: int, scale: float, lib=None) -> Tensor:
    """Causal attention of a prefill's new rows of one sequence (`rowdot_prefill_attention`):
    query row t, at position first + t, over keys 0 .. first + t. Each row on its own, so its
    bits depend on nothing but its query and its keys (not on where the call starts or ends),
    the same on every build.

    q (L, Hq, D); k and v (first + L, Hkv, D): the sequence's keys and values so far, the new
    rows' last; fp32 on the CPU. Returns (L, Hq * D) fp32."""
    lib = _lib(lib)
    L, Hq, D = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    if k.shape != (first + L, Hkv, D) or v.shape != k.shape or Hq % Hkv or first < 0:
        raise ValueError(f"prefill_attention: shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} "
                         f"after {first} tokens do not agree")
    if any(t.dtype != torch.float32 or not t.is_cpu for t in (q, k, v)):
        raise ValueError("prefill_attention: q, k and v must be fp32 on the CPU")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(L, Hq * D, dtype=torch.float32)

    def rows(t0: int, t1: int) -> None:  # query rows [t0, t1): each row's bits are its own
        work = _work("prefill attention", (D + 4) * (-(-S // 64) * 64))
        lib.rowdot_prefill_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), L, first, Hq, Hkv, D, scale,
                                     out.data_ptr(), t0, t1, work.data_ptr())

    _in_parts(L, L * S * Hq * D >= SPLIT_MACS, rows)
    return out


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk: int,
             initial_state: Tensor | None = None, keep_starts: bool = False,
             lib=None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The chunked SSD scan of one sequence's prefill in one pass per head (`rowdot_ssd_scan`:
    `actors.mamba.ssd_chunked`'s algorithm, each chunk's results a function of its inputs and
    the state entering it alone, the same bits on every build).

    x (L, H, P), dt (L, H) (discretised), A (H,), B and C (L, G, N), fp32 on the CPU (x, B and C
    may be row slices of one projection: rows any distance apart, each row contiguous);
    `initial_state` (H, P, N) or None (zeros); `chunk` <= 64. Returns y (L, H, P), the final
    state (H, P, N) and, with `keep_starts`, the state entering each chunk (chunks, H, N, P)."""
    lib = _lib(lib)
    L, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    _check_scan(x, dt, A, B, C, chunk, initial_state)
    x, B, C = (_row_slices(t) for t in (x, B, C))
    if B.stride(0) != C.stride(0):
        B, C = B.contiguous(), C.contiguous()
    dt, A = dt.float().contiguous(), A.float().contiguous()
    state = None if initial_state is None else initial_state.float().contiguous()
    chunks = (L + chunk - 1) // chunk
    y, final = torch.empty(L, H, P, dtype=torch.float32), torch.empty(H, P, N, dtype=torch.float32)
    starts = torch.empty(chunks, H, N, P, dtype=torch.float32) if keep_starts and L else None
    if not L:
        return y, state.clone() if state is not None else final.zero_(), starts
    cb = _work("scan products", chunks * G * chunk * chunk)  # (this thread's: the parts only read it)
    per_head, rest = N * P, chunk * (2 * P + 3) + 4 * P
    args = (x.data_ptr(), x.stride(0), dt.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(), B.stride(0),
            L, H, P, G, N, chunk, None if state is None else state.data_ptr(), final.data_ptr(),
            None if starts is None else starts.data_ptr(), y.data_ptr())

    def heads(h0: int, h1: int, make_cb: int = 0) -> None:  # each head's scan is its own
        work = _work("scan", (h1 - h0) * per_head + rest)
        lib.rowdot_ssd_scan(*args, h0, h1, cb.data_ptr(), make_cb, work.data_ptr())

    split = L * H * P * N >= SPLIT_MACS and torch.get_num_threads() > 1
    heads(0, 0 if split else H, make_cb=1)
    if split:
        _in_parts(H, True, heads)
    return y, final, starts


def _check_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk: int,
                initial_state: Tensor | None) -> None:
    (L, H, P), (G, N) = x.shape, B.shape[-2:]
    if dt.shape != (L, H) or A.shape != (H,) or B.shape != (L, G, N) or C.shape != (L, G, N) or H % G \
            or not 0 < chunk <= 64 or (initial_state is not None and initial_state.shape != (H, P, N)):
        raise ValueError(f"ssd_scan: shapes {tuple(x.shape)}, {tuple(dt.shape)}, {tuple(A.shape)}, "
                         f"{tuple(B.shape)}, {tuple(C.shape)}, chunk {chunk} do not agree")


_WORK = threading.local()


def _work(name: str, n: int) -> Tensor:
    """n fp32 of this thread's buffer `name`, grown as needed and kept: a kernel's scratch, valid
    until the thread's next call for that name (fresh memory each call would cost page faults
    that the arithmetic of a long prefill's attention or scan does not hide)."""
    buffers = _WORK.__dict__.setdefault("buffers", {})
    buf = buffers.get(name)
    if buf is None or buf.numel() < n:
        buf = buffers[name] = torch.empty(max(n, 1), dtype=torch.float32)
    return buf[:n]


def _row_slices(t: Tensor) -> Tensor:
    """t (L, a, b) fp32 on the CPU whose rows are each contiguous (any distance apart), else a
    contiguous copy."""
    if t.dtype != torch.float32 or not t.is_cpu:
        raise ValueError(f"ssd_scan: inputs must be fp32 on the CPU, got {t.dtype} on {t.device}")
    a, b = t.shape[1], t.shape[2]
    if t.stride(2) == 1 and t.stride(1) == b and t.stride(0) >= a * b:
        return t
    return t.contiguous()


def _longest_request(slots: Tensor, starts: Tensor, pool: int) -> int:
    """The most keys any request has, after checking the slots name the pool's and `starts` cuts
    them in order."""
    n = slots.shape[0]
    if slots.dim() != 1 or (n and (int(slots.min()) < 0 or int(slots.max()) >= pool)) or (
            starts.numel() and (int(starts[0]) != 0 or int(starts[-1]) != n or bool((starts[1:] < starts[:-1]).any()))):
        raise ValueError(f"decode_attention: key slots outside the pool's {pool}, or starts that do not "
                         f"cut the {n} slots in order")
    return int((starts[1:] - starts[:-1]).max()) if starts.numel() > 1 else 0


def rms_norm(x: Tensor, eps: float, weight: Tensor | None = None, offset: bool = False,
             out: Tensor | None = None, lib=None) -> Tensor:
    """RMSNorm over the last dim of x (..., n), fp32 on the CPU, in one pass a row
    (`rowdot_rms_norm`): y = x / sqrt(mean(x^2) + eps), the mean's sum in one fixed tree order,
    then weight * y, or y * (1 + weight) (`offset`). weight (n,), or (G * n,) for rows that are
    G groups of one weight row (a gated norm). The same bits as `actors.norms`'s torch steps.
    Returns (..., n) fp32, written into `out` when given (it may be x)."""
    lib, n = _lib(lib), x.shape[-1]
    _check_state(x, "rms_norm", "x")
    wrap = 1
    if weight is not None:
        _check_state(weight, "rms_norm", "the weight")
        if not n or weight.numel() % n:
            raise ValueError(f"rms_norm: a weight of whole rows of {n}, got {tuple(weight.shape)}")
        wrap = weight.numel() // n
    out = torch.empty_like(x) if out is None else out
    R = x.numel() // n if n else 0
    wp = None if weight is None else weight.data_ptr()

    def groups(g0: int, g1: int) -> None:  # rows [g0 * wrap, g1 * wrap); ctypes rounds 1/n, eps to fp32
        r0, r1 = g0 * wrap, g1 * wrap
        if lib.rowdot_rms_norm(x.data_ptr() + 4 * r0 * n, r1 - r0, n, 1.0 / n, eps, wp, wrap, int(offset),
                               out.data_ptr() + 4 * r0 * n):
            raise MemoryError(f"rms_norm: no memory for a row of {n}")

    _in_parts(R // wrap, R * n >= SPLIT_STATE, groups)
    return out


def _in_parts(n: int, large: bool, run, align: int = 1) -> None:
    """`run(i0, i1)` over [0, n): in one call, or, for a `large` call with torch on more than
    one thread, in ranges (starts multiples of `align`) on the pool's threads. The ranges' results
    are independent, so the split changes no bit."""
    threads = torch.get_num_threads()
    parts = min(threads, n // align) if large and threads > 1 else 1
    if parts <= 1:
        run(0, n)
        return
    bounds = [n * p // parts // align * align for p in range(parts)] + [n]
    list(_pool(parts).map(lambda p: run(bounds[p], bounds[p + 1]), range(parts)))


def _lib(lib):
    lib = lib or _library()
    if lib is None:
        raise RuntimeError(f"the rowdot kernel is not available: {unavailable_reason()}")
    return lib


def _check_state(state: Tensor, what: str, name: str = "the state") -> None:
    if state.dtype != torch.float32 or not state.is_contiguous() or state.device.type != "cpu":
        raise ValueError(f"{what}: {name} must be a contiguous fp32 CPU tensor")


def _slots(slots: Tensor, rows: int, pool: int, what: str) -> Tensor:
    """`slots` as contiguous int64, after checking each names a slot of the pool (once for the
    tensor that every Mamba layer of a decode step passes, unless it was written since:
    `actors.kept`)."""
    slots = slots.to(torch.int64).contiguous()
    kept(_CHECKED, "slots", slots, lambda: _check_slots(slots, rows, pool, what), (rows, pool))
    return slots


def _check_slots(slots: Tensor, rows: int, pool: int, what: str) -> bool:
    if slots.shape != (rows,) or (rows and (int(slots.min()) < 0 or int(slots.max()) >= pool)):
        raise ValueError(f"{what}: slots outside the pool's {pool}, or not one per request")
    return True


def _columns(run, x: int, w: int, bias: int | None, y: int, M: int, N: int, K: int, j0: int, j1: int) -> None:
    """Columns [j0, j1) of y (M, N) = x (M, K) @ w (N, K)^T + bias (N,), all fp32 contiguous,
    given by their data pointers (`run`: a build's `rowdot_linear`)."""
    run(x, w + j0 * K * 4, None if bias is None else bias + j0 * 4, y + j0 * 4, M, j1 - j0, K, N)


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """One pool per thread count asked for (torch's, which rarely changes)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="rowdot")


def _library():
    if "lib" not in _STATE:
        with _LOCK:
            if "lib" not in _STATE:
                _STATE["lib"], _STATE["why"] = load()
                if _STATE["lib"] is None:
                    log.warning("rowdot kernel not used (%s): fp32 products take MKL's probed path",
                                _STATE["why"])
    return _STATE["lib"]


def load(portable: bool = False, build: str | None = None):
    """(library, None), or (None, why not). `build`: one of `BUILDS` (default: the widest this
    CPU runs; `portable`: "portable", whatever this CPU has). A build this CPU cannot run is
    refused here (see `compile_only`)."""
    build = "portable" if portable else build or builds_here()[0]
    if build not in builds_here():
        return None, f"this CPU cannot run rowdot's {build!r} build (it runs {', '.join(builds_here())})"
    target, why = compile_only(build)
    if target is None:
        return None, why
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        return None, f"cannot load {target}: {e}"
    lib.rowdot_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4
    lib.rowdot_linear.restype = None
    lib.rowdot_panel_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4
    lib.rowdot_panel_linear.restype = None
    lib.rowdot_panel_cols.restype = ctypes.c_long
    lib.rowdot_variant.restype = ctypes.c_char_p
    lib.rowdot_ssd_update.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 5 + [ctypes.c_void_p] * 5
    lib.rowdot_ssd_update.restype = None
    lib.rowdot_conv_update.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 4
    lib.rowdot_conv_update.restype = None
    lib.rowdot_conv_prefill.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 4 + [ctypes.c_void_p] * 3
    lib.rowdot_conv_prefill.restype = None
    lib.rowdot_ssd_carry.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5
    lib.rowdot_ssd_carry.restype = None
    lib.rowdot_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_float,
                                    ctypes.c_float, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p]
    lib.rowdot_rms_norm.restype = ctypes.c_int
    lib.rowdot_decode_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 4 + [ctypes.c_float] \
        + [ctypes.c_void_p] * 2
    lib.rowdot_decode_attention.restype = None
    lib.rowdot_ssd_scan.argtypes = [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 7 \
        + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.rowdot_ssd_scan.restype = None
    lib.rowdot_prefill_attention.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 5 + [ctypes.c_float] \
        + [ctypes.c_void_p] + [ctypes.c_long] * 2 + [ctypes.c_void_p]
    lib.rowdot_prefill_attention.restype = None
    return lib, None


def compile_only(build: str) -> tuple[Path | None, str | None]:
    """(the compiled library file of `build`, None), or (None, why not), without loading it (so
    any CPU can check that the AVX-512 source compiles)."""
    if build not in BUILDS:
        raise ValueError(f"rowdot build must be one of {sorted(BUILDS)}, got {build!r}")
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"{ENV_SWITCH}=0"
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc or gcc) on PATH"
    flags = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-Wno-psabi", *BUILDS[build][1]]
    tag = hashlib.sha1(SOURCE.read_bytes() + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    return _built(compiler, flags, f"rowdot-{tag}.so")


def _built(compiler: str, flags: list[str], name: str) -> tuple[Path | None, str | None]:
    """(the library file, None), built where it is missing: in the cache directory, or, where
    that cannot be written, in a per-user temporary one; else (None, why not)."""
    why = None
    for folder in cache_dirs():
        target = folder / name
        if target.exists():
            return target, None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError as e:
            why = f"cannot write {folder}: {e.strerror or e}"
            continue
        why = _build(compiler, flags, Path(tmp), target)
        return (None, why) if why else (target, None)
    return None, why


def _build(compiler: str, flags: list[str], tmp: Path, target: Path) -> str | None:
    """Compile into `tmp` (beside `target`), then rename (several processes may build at once).
    The error's last line, or None."""
    try:
        run = subprocess.run([compiler, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                             timeout=120)
        if run.returncode != 0:
            lines = (run.stderr or run.stdout).strip().splitlines()
            return f"{Path(compiler).name} failed: {lines[-1] if lines else run.returncode}"
        os.replace(tmp, target)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"{Path(compiler).name} failed: {e}"
    finally:
        if tmp.exists():
            tmp.unlink()


def cache_dirs() -> tuple[Path, Path]:
    """Where per-machine files go, in order of preference: the cache directory, else a per-user
    one under the system's temporary directory."""
    return _cache_dir(), Path(tempfile.gettempdir()) / f"raysched-{os.getuid()}"


def _cache_dir() -> Path:
    if os.environ.get("RAYSCHED_KERNEL_CACHE"):
        return Path(os.environ["RAYSCHED_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "raysched"
