"""Mamba2 mixer of a Bamba layer: free functions for each stage plus a module holding the weights.

Stages, in order (names from the Mamba2 / SSD paper):

    in_proj(h)            -> [z | x | B | C | dt]
    causal depthwise conv -> over xBC only (kernel d_conv, with bias), then SiLU
    dt                    =  softplus(dt + dt_bias), clamped to time_step_limit
    A                     = -exp(A_log)                     (one scalar per head)
    SSD scan              :  state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T ;  y_t = state_t C_t
    skip                  :  y += D x
    gated RMSNorm         :  norm(y * silu(z)) per group, times weight  (gate before the norm)
    out_proj(y)

Head h reads the B/C of group h // (n_heads // n_groups). The SSM runs in fp32 whatever the
model dtype; the conv runs in the model dtype.

Prefill handles the next tokens of several sequences at once (their rows concatenated; the
projections and elementwise stages run over all rows, the conv and the scan per sequence,
`conv_segments` / `scan_segments`), each from zero state (a fresh sequence) or from the
conv/SSM state its earlier tokens left in the pool (chunked prefill, a restored prefix):
`causal_conv_prefill` takes the previous K-1 conv inputs as left context and `ssd_chunked`
(with `ssd_sequential_ref` as its reference twin; `ssd_fused` runs the same algorithm through
`actors.rowdot.ssd_scan` on the CPU) an initial SSM state; decode handles one token per request and updates the pool's conv/SSM state at
the request's slot (`causal_conv_step`, `ssd_step`). The decode functions use only elementwise
products, reductions over the last dim and batched products of one fixed shape per request and
head, and apply their nonlinear functions through `Kernels.pointwise`, so a request's result
never depends on which other requests share the batch.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actors import rowdot, triton_route
from actors.batch import Segment, by_row_blocks, cat_rows
from actors.config import ModelConfig
from actors.kept import kept
from actors.norms import in_one_pass, inv_rms

SlotRun = "tuple[int, int] | None"  # slots as one ascending run (start, count) (`ForwardBatch.mamba_run`)
LinearFn = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]
Pointwise = Callable[[Callable[[Tensor], Tensor], Tensor], Tensor]
StateUpdate = Callable[..., Tensor]  # a fused decode update of a pool state: `actors.rowdot.ssd_update`, `conv_update`
ConvPrefill = Callable[..., Tensor]  # (window, taps, bias, out=None) -> pre-activation:
#   `actors.rowdot.conv_prefill`


def silu_(x: Tensor) -> Tensor:
    """SiLU in place (the bits of `F.silu`): a long prefill's activations need no second buffer."""
    return F.silu(x, inplace=True)


def whole(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """Apply an elementwise fn to the whole tensor at once."""
    return fn(x)


VECTOR_BLOCK = 64  # elements a CPU elementwise kernel handles per vector step, at most (bf16, AVX-512)


def row_align() -> int:
    """Row length (elements) at which no element of a row can fall in a scalar tail: a whole
    number of vector blocks per row and per thread's share (ATen splits an elementwise loop
    into `threads` equal ranges)."""
    return VECTOR_BLOCK * max(1, torch.get_num_threads())


def rowwise(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """Apply an elementwise fn so that each row's result is independent of the other rows.

    CPU kernels of functions such as silu, softplus and sigmoid finish a tensor with a scalar
    tail whose rounding differs from the vector body, so an element's bits depend on its offset
    in the tensor. On the CPU every row (x[i], any shape) is zero-padded to a multiple of
    `row_align()` elements (rows already that long go as they are) and the whole batch goes in
    one call: no element of a real row then falls in a scalar tail, whatever the row count
    (tests/test_batch_invariance.py holds this, with a negative control). Rows already that
    long go as they lie, also when they are spaced apart (a column slice, as z of the Mamba
    projection: the kernel runs each row's elements as one contiguous stretch, or a thread's
    part of it, a whole number of vector blocks either way). GPU kernels compute every element
    alike, so there the whole tensor goes at once.
    """
    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    flat = x.dim() == 2
    rows = x if flat else x.reshape(x.shape[0], -1)  # (R, n)
    n, align = rows.shape[1], row_align()
    if n % align == 0 and rows.stride(1) == 1:
        out = fn(rows)  # rows already whole vector blocks: no padding copy
    else:
        out = fn(torch.constant_pad_nd(rows, (0, -n % align)))[:, :n]  # (R, n') padded to a multiple of align
    return out if flat else out.reshape(x.shape)


def derived(module: nn.Module, name: str, param: Tensor, make: Callable[[Tensor], Tensor]) -> Tensor:
    """make(param), kept on `module` until the parameter changes (`actors.kept`): a decode
    step's constants (the conv taps, -exp(A_log), D) are not made again, one op each, in every
    layer of every step."""
    return kept(module.__dict__.setdefault("_derived", {}), name, param, lambda: make(param))


def conv_taps(weight: Tensor) -> Tensor:
    """A depthwise conv weight (D, 1, K) as contiguous taps (K, D)."""
    return weight[:, 0, :].t().contiguous()


@dataclass(frozen=True)
class Kernels:
    """How a forward runs its matrix products and nonlinear elementwise functions.

    The defaults call torch directly (prefill: one sequence per call). Batch-invariant decode
    passes `actors.model.tiled_linear` and `rowwise`.
    """

    linear: LinearFn = F.linear
    pointwise: Pointwise = whole
    ssd_update: StateUpdate | None = None  # decode's SSD recurrence in one pass over each state
    #   (`actors.rowdot.ssd_update`, CPU); None: the torch calls of `ssd_step`
    conv_update: StateUpdate | None = None  # decode's conv and its state's shift in one pass
    #   (`actors.rowdot.conv_update`, CPU, fp32: the torch path's bits); None: `causal_conv_step`'s calls
    ssd_scan: Callable[..., tuple[Tensor, Tensor, Tensor | None]] | None = None  # prefill's SSD scan
    #   in one pass per head (`actors.rowdot.ssd_scan`, CPU, fp32); None: `ssd_chunked`'s torch calls
    prefill_attention: Callable[..., Tensor] | None = None  # prefill's causal attention, row by row
    #   (`actors.rowdot.prefill_attention`, CPU, fp32); None: tiles of `PREFILL_TILE` through SDPA
    decode_attention: Callable[..., Tensor] | None = None  # decode attention reading the pool by slot
    #   (`actors.rowdot.decode_attention`, CPU, fp32); None: `actors.attention.chunked_decode_attention`
    conv_prefill: ConvPrefill | None = None  # prefill's conv in one pass (`actors.rowdot.conv_prefill`,
    #   CPU, fp32: the torch path's bits); None: `causal_conv_prefill`'s calls
    ssd_carry: Callable[[Tensor, Tensor, Tensor], None] | None = None  # prefill's scan: its recurrence
    #   over chunks in one pass per chunk (`actors.rowdot.ssd_carry`, CPU: the torch path's bits)


@dataclass(frozen=True)
class Marks:
    """One scan's states inside the rows it ran over (`Segment.trail`): `at(r)` is the state
    (its pool layout, for one sequence) after the first r rows, for 0 < r < rows with r a
    multiple of `every` (the scan's chunk: the states it carries between chunks anyway, kept
    by reference, so keeping them costs memory, not arithmetic). They are the bits a prefill
    that paused after r rows would have left in the pool (`tests/test_prefix_branch.py`)."""

    every: int
    rows: int
    at: Callable[[int], Tensor]

    def has(self, r: int) -> bool:
        return 0 < r < self.rows and r % self.every == 0


# ---------------------------------------------------------------------------- SSD (the scan)
def expand_groups(BC: Tensor, n_heads: int) -> Tensor:
    """Give every head its group's B (or C): (..., G, N) -> (..., n_heads, N)."""
    n_groups = BC.shape[-2]
    return BC.repeat_interleave(n_heads // n_groups, dim=-2)  # (..., H, N)


def ssd_sequential_ref(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                       initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Reference SSD: the plain recurrence, one token at a time (twin of `ssd_chunked`).

    x (L, H, P), dt (L, H), A (H,), B and C (L, G, N); `chunk_size` is ignored (same signature as
    `ssd_chunked`). Returns y (L, H, P) and the final state (H, P, N), both fp32.
    """
    x, dt, A = x.float(), dt.float(), A.float()  # (L, H, P), (L, H), (H,)
    Bh = expand_groups(B.float(), x.shape[1])  # (L, H, N)
    Ch = expand_groups(C.float(), x.shape[1])  # (L, H, N)
    state = _start_state(x, B, initial_state)  # (H, P, N)
    ys = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * A)  # (H,)
        dBx = (dt[t, :, None] * Bh[t])[:, None, :] * x[t, :, :, None]  # (H, P, N)
        state = state * decay[:, None, None] + dBx  # (H, P, N)
        ys.append((state * Ch[t][:, None, :]).sum(-1))  # (H, P)
    return torch.stack(ys) if ys else x.new_zeros(x.shape), state  # (L, H, P), (H, P, N)


def _start_state(x: Tensor, B: Tensor, initial_state: Tensor | None) -> Tensor:
    """fp32 start state (H, P, N): the given one, or zeros."""
    if initial_state is not None:
        return initial_state.float().clone()  # (H, P, N)
    return x.new_zeros(x.shape[1], x.shape[2], B.shape[-1], dtype=torch.float32)  # (H, P, N)


SCAN_BLOCK = 32  # longest chunk the prefill scans (SSD, delta rule) run with on the CPU (the model's own if shorter)
# A chunked scan is exact for any chunk length; the length only moves work between the
# quadratic diagonal blocks and the recurrence over chunks. On the CPU, 64 took 227 ms where
# `small`'s 128 took 335 (6 layers, 2,048 tokens, 1 thread; stop 22); 32 gives the same prefill
# time as 64 (`small`, 2,048 tokens, 1 thread, Zen 3: 1.931 s vs 1.933 s, best of 3, alternating;
# the delta rule at 2,048 tokens, 16 heads of 128: 0.215-0.25 s vs 0.246-0.261 s) and a 32-token
# grid of exact prefix points (`actors.engine.prefix_grid`). A GPU keeps the model's chunk size
# (not measured there; more chunks mean more launches).


def scan_chunk(model_chunk: int, device: torch.device) -> int:
    """The chunk a prefill scan (SSD, delta rule) runs with on `device`: a prefill that pauses
    and resumes on a multiple of it gives an uncached run's bits (`actors.engine.prefix_grid`)."""
    return min(model_chunk, SCAN_BLOCK) if device.type == "cpu" else model_chunk

LOG_DECAY_FLOOR = -60.0  # log-decays below this count as 0 (exp(-60) ~ 1e-26)


def decay_exp_(log_decay: Tensor) -> Tensor:
    """exp of a tensor of log-decays (<= 0), in place, exactly 0 below `LOG_DECAY_FLOOR`.

    A strongly decaying head (dt A of -20 per step is common) drives exp into fp32's subnormal
    range, and every product that touches a subnormal runs ~10x slower on x86 (measured: the
    SSD prefill of a `small` layer took 55 ms instead of 26). Weights below e^-60 are far under
    fp32's resolution of any sum they join, so they become exact zeros, which are fast.
    """
    return F.threshold_(log_decay, LOG_DECAY_FLOOR, -1000.0).exp_()  # exp(-1000) = 0 exactly


def segment_sum(a: Tensor) -> Tensor:
    """out[..., i, j] = a[..., j+1] + ... + a[..., i] for i >= j, and -inf above the diagonal.

    a (..., l) -> (..., l, l). Built from a masked cumsum (no differences of large sums), so
    exp(out) is the decay from step j to step i, exactly 1 on the diagonal. (The reference form;
    `ssd_chunked` takes differences of the chunk's cumulative sums, like the fused kernels.)
    """
    l = a.shape[-1]
    strict = torch.tril(torch.ones(l, l, dtype=torch.bool, device=a.device), diagonal=-1)  # (l, l)
    rows = a[..., :, None].expand(*a.shape, l).masked_fill(~strict, 0.0)  # (..., l, l): a_i, i > j
    out = torch.cumsum(rows, dim=-2)  # (..., l, l)
    causal = torch.tril(torch.ones(l, l, dtype=torch.bool, device=a.device))  # (l, l)
    return out.masked_fill(~causal, float("-inf"))  # (..., l, l)


def ssd_chunked(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                initial_state: Tensor | None = None, marks: list | None = None,
                carry: Callable[[Tensor, Tensor, Tensor], None] | None = None) -> tuple[Tensor, Tensor]:
    """Chunked SSD for one sequence of any length (the last chunk is zero-padded internally).

    x (L, H, P), dt (L, H), A (H,), B and C (L, G, N). Within a chunk the output is a masked
    "attention" C_l B_s^T decay(s->l) dt_s x_s; across chunks the state is carried by a short
    recurrence over chunk boundaries. Returns y (L, H, P) and the final state (H, P, N), fp32.
    With `marks`, appends the states entering each chunk (`Marks`, every `chunk_size`). `carry`:
    `Kernels.ssd_carry` (the recurrence over chunks in one pass per chunk, the same bits).

    B and C stay per group (G of them, each shared by K = H/G heads): C_l B_s^T is computed once
    per group, and heads are viewed as (G, K) wherever they meet B or C, never expanded.
    """
    L, H, P = x.shape
    G = B.shape[-2]
    xc, ac, Bc, Cc = _into_chunks(x, dt, A, B, C, chunk_size)  # (c,l,H,P) (c,H,l) (c,l,G,N) x2
    c, l = ac.shape[0], ac.shape[-1]
    a_cum = torch.cumsum(ac, dim=-1)  # (c, H, l)
    xg = xc.view(c, l, G, H // G, P)  # (c, l, G, K, P)
    y_diag = _intra_chunk(xg, a_cum, Bc, Cc)  # (c, l, G, K, P)
    local = _chunk_states(xg, a_cum, Bc)  # (c, G, N, K, P)
    starts, final = _carry_states(local, a_cum[..., -1], _start_state(x, B, initial_state), carry,
                                  reuse=marks is None)  # (marks hold the starts past this call)
    if marks is not None:  # (G, N, K, P) -> (H, P, N), as `final`
        marks.append(Marks(chunk_size, L, lambda r: starts[r // chunk_size].permute(0, 2, 3, 1).reshape(H, P, -1)))
    y_off = torch.bmm(Cc.transpose(1, 2).reshape(c * G, l, -1).contiguous(),  # C (l, N) @ start (N, K*P)
                      starts.view(c * G, -1, (H // G) * P)).view(c, G, l, H // G, P).transpose(1, 2)  # (contiguous
    #   whatever c is, as in `_chunk_states`)
    y_off.mul_(decay_exp_(a_cum.clone()).permute(0, 2, 1).reshape(c, l, G, H // G, 1))  # decayed from the chunk start
    y = torch.add(y_diag, y_off, out=xg.new_empty(c, l, G, H // G, P))  # (c, l, G, K, P), one pass
    return y.view(-1, H, P)[:L], final  # (L, H, P)


def ssd_fused(scan: Callable[..., tuple[Tensor, Tensor, Tensor | None]], x: Tensor, dt: Tensor, A: Tensor,
              B: Tensor, C: Tensor, chunk_size: int, initial_state: Tensor | None = None,
              marks: list | None = None) -> tuple[Tensor, Tensor]:
    """`ssd_chunked` through a fused scan (`Kernels.ssd_scan`: `actors.rowdot.ssd_scan`, the same
    algorithm, chunk by chunk from the state entering each): y (L, H, P) and the final state
    (H, P, N), fp32; with `marks`, appends the states entering each chunk as `ssd_chunked` does."""
    y, final, starts = scan(x, dt, A, B, C, chunk_size, initial_state, marks is not None)
    if marks is not None and starts is not None:  # (chunks, H, N, P) -> the pool's (H, P, N)
        marks.append(Marks(chunk_size, x.shape[0], lambda r: starts[r // chunk_size].transpose(1, 2).contiguous()))
    return y, final


def _into_chunks(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                 chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Discretise (x*dt, dt*A), zero-pad to whole chunks and split (B and C stay per group).

    Padded steps have dt = 0: no input and decay 1, so they leave the final state unchanged.
    """
    L, H, P = x.shape
    pad = (-L) % chunk_size
    xdt = x.float() * dt.float()[..., None]  # (L, H, P)
    a = dt.float() * A.float()  # (L, H)
    xdt, a, Bf, Cf = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) if pad else t
                      for t in (xdt, a, B.float(), C.float()))
    n = (L + pad) // chunk_size
    xc = xdt.view(n, chunk_size, H, P)  # (c, l, H, P)
    ac = a.view(n, chunk_size, H).permute(0, 2, 1)  # (c, H, l)
    return xc, ac, Bf.view(n, chunk_size, *B.shape[1:]), Cf.view(n, chunk_size, *C.shape[1:])


def _intra_chunk(xg: Tensor, a_cum: Tensor, Bc: Tensor, Cc: Tensor) -> Tensor:
    """Output from inputs of the same chunk (the diagonal blocks): (c, l, G, K, P).

    xg (c, l, G, K, P), a_cum (c, H, l) with H = G*K, Bc and Cc (c, l, G, N)."""
    c, l, G, K, _ = xg.shape
    causal = torch.tril(torch.ones(l, l, dtype=torch.bool, device=a_cum.device))  # (l, s)
    # Above the diagonal the log-decays are > 0: clamped to 0 (no overflow, no -inf, whose exp
    # takes a slow path), and the zeros come from CB, masked once per group rather than per head
    decay = decay_exp_((a_cum[..., :, None] - a_cum[..., None, :]).clamp_max_(0.0))  # (c, H, l, s)
    CB = torch.einsum("clgn,csgn->cgls", Cc, Bc).masked_fill_(~causal, 0.0)  # (c, G, l, s): once per group
    scores = decay.view(c, G, K, l, l).mul_(CB[:, :, None])  # (c, G, K, l, s)
    return torch.einsum("cgkls,csgkp->clgkp", scores, xg)  # (c, l, G, K, P)


def _chunk_states(xg: Tensor, a_cum: Tensor, Bc: Tensor) -> Tensor:
    """State each chunk builds from its own inputs, decayed to the chunk's end: (c, G, N, K, P).

    Kept in the layout its product gives, B^T (N, l) @ x (l, K*P) per (chunk, group): x is read
    row by row (about 1.7x faster than the (K*P, l) @ (l, N) form), and the recurrence over
    chunks and the readout read it contiguously (a state's usual (H, P, N) order would make
    every step of the recurrence a strided pass: 6.6 ms instead of ~1 per `small` layer)."""
    c, l, G, K, P = xg.shape
    N = Bc.shape[-1]
    to_end = decay_exp_(a_cum[..., -1:] - a_cum)  # (c, H, l)
    x_decayed = xg * to_end.permute(0, 2, 1).reshape(c, l, G, K, 1)  # (c, l, G, K, P)
    # contiguous whatever c is: with one chunk both reshapes are views, strided otherwise than
    # the copies more chunks give, and MKL's product takes another path for them (other bits
    # with MKL on its AVX2 code: a chunk's state must not depend on how many chunks the scan ran)
    x_rows = x_decayed.view(c, l, G, K * P).transpose(1, 2).reshape(c * G, l, K * P).contiguous()
    b_t = Bc.permute(0, 2, 3, 1).reshape(c * G, N, l).contiguous()  # (c*G, N, l)
    return torch.bmm(b_t, x_rows).view(c, G, N, K, P)  # (c, G, N, K, P)


def _carry_states(local: Tensor, chunk_log_decay: Tensor, state: Tensor,
                  fused: Callable[[Tensor, Tensor, Tensor], None] | None = None,
                  reuse: bool = False) -> tuple[Tensor, Tensor]:
    """Recurrence over chunk boundaries: the state entering each chunk, and the final state.

    local (c, G, N, K, P) (`_chunk_states`' layout), chunk_log_decay (c, H), state (H, P, N) ->
    starts (c, G, N, K, P), final (H, P, N) contiguous. `fused` (`Kernels.ssd_carry`, CPU): the
    same products and adds in one pass per chunk. `reuse`: the starts are not needed past the
    caller's use, so on the CPU they go in this thread's scratch buffer (`_scratch`).
    """
    c, G, N, K, P = local.shape
    decay = torch.exp(chunk_log_decay)  # (c, H)
    shape = (c + 1, G, N, K, P)  # entering each chunk, then the final one
    states = _scratch(shape, local) if reuse and local.device.type == "cpu" else local.new_empty(shape)
    states[0] = state.view(G, K, P, N).permute(0, 3, 1, 2)
    if fused is not None and local.device.type == "cpu":
        fused(states, local.contiguous(), decay.view(c, G, K).contiguous())
    else:
        decay = decay.view(c, G, 1, K, 1)  # (c, G, 1, K, 1)
        for k in range(c):
            torch.mul(states[k], decay[k], out=states[k + 1]).add_(local[k])
    final = states[c].permute(0, 2, 3, 1).reshape(G * K, P, N).clone(memory_format=torch.contiguous_format)  # (H, P, N), its own
    return states[:c], final


_SCRATCH = threading.local()


def _scratch(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialised tensor of `shape` in this thread's reused buffer (grown as needed): a
    long prefill's chunk states (16 MB at 2,048 tokens of `small`) in fresh memory each call
    cost more in first-touch page faults than in arithmetic (~8 against ~2 ms a layer). Valid
    until the thread's next call."""
    n = math.prod(shape)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < n or buf.dtype != like.dtype \
            or buf.is_inference() != torch.is_inference_mode_enabled():  # (one made in inference mode is read-only outside it)
        buf = _SCRATCH.buf = like.new_empty(n)
    return buf[:n].view(shape)


def ssd_step(ssm_state: Tensor, slots: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
             C: Tensor, pointwise: Pointwise = whole, run: SlotRun = None,
             fused: StateUpdate | None = None) -> Tensor:
    """One decode token per request: update `ssm_state[slots]` in place and return y.

    ssm_state (S, H, P, N) fp32 (one Mamba layer of the pool), slots (R,), x (R, H, P),
    dt (R, H), A (H,), B and C (R, G, N). Returns y (R, H, P) fp32.

    The state is the big tensor here (R x 256 KiB for the `small` preset), so it is touched as
    few times as possible: when the slots are one ascending run (`run`,
    `ForwardBatch.mamba_run`; the engine sorts its decode batch by slot) it is updated in place in the pool, else gathered
    once and scattered back.
    The K = H/G heads of a group share its B and C, so each (request, group) is one matrix
    (K*P, N): the rank-1 update is (x dt)(K*P) times B (N) and the readout is C (1, N) times
    the state transposed, batched products of one fixed shape per (request, group) (the
    transposed readout reads the state about 2.5x faster than a matrix-vector product per
    head). Like the elementwise decay, a request's result does not depend on the others
    (with `pointwise=rowwise` for exp). With `fused` (`Kernels.ssd_update`) the update and the
    readout run in one pass over each request's state instead (other roundings: a different
    kernel, as a different matmul build is).
    """
    R, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    dt = dt.float()  # (R, H)
    xdt = x.float() * dt[..., None]  # (R, H, P)
    decay = pointwise(torch.exp, dt * A.float())  # (R, H)
    if fused is not None:
        return fused(ssm_state, slots, decay, xdt, B.float(), C.float())
    xdt = xdt.view(R * G, 1, -1)  # (R*G, 1, K*P)
    state = ssm_state.narrow(0, run[0], R) if run else ssm_state.index_select(0, slots)
    state.mul_(decay[..., None, None])  # (R, H, P, N)
    flat_t = state.view(R * G, -1, N).transpose(1, 2)  # (R*G, N, K*P), a view
    routed = triton_route.routes(state)  # CUDA: cuBLAS would pick its kernel (and FMA) by R
    if routed:
        flat_t.add_(B.float().reshape(R * G, N, 1) * xdt)  # += B (x dt)^T: one product, one add
    else:
        flat_t.baddbmm_(B.float().reshape(R * G, N, 1), xdt)  # += B (x dt)^T
    if run is None:
        ssm_state.index_copy_(0, slots, state)
    readout = triton_route.bmm if routed else torch.bmm
    return readout(C.float().reshape(R * G, 1, N), flat_t).view(R, H, P)  # (R, H, P)


# ---------------------------------------------------------------------------- causal conv
def causal_conv_prefill(xBC: Tensor, weight: Tensor, bias: Tensor | None,
                        initial: Tensor | None = None,
                        pointwise: Pointwise = whole, marks: list | None = None,
                        fused: ConvPrefill | None = None) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv + SiLU over one sequence (or one chunk of it), and the state it leaves.

    xBC (L, D) pre-activation conv inputs, weight (D, 1, K), bias (D,), initial (D, K-1) the
    conv state before the first token (the previous K-1 inputs, oldest first; None = zeros, a
    sequence's start). Returns the activated output (L, D) and the state (D, K-1): the last K-1
    inputs of [initial | xBC], oldest first. With `marks`, appends the state after each row
    (`Marks`, every 1).

    The taps are summed in order. In fp32 on the CPU, one product then one add each (not a
    fused multiply-add, which ATen's `addcmul_` becomes or not depending on how it was built):
    the bits of `fused` (`Kernels.conv_prefill`, the same sums in one pass) on every CPU.
    """
    L, D, K = xBC.shape[0], xBC.shape[1], weight.shape[-1]
    left = initial.t().to(xBC.dtype) if initial is not None else xBC.new_zeros(K - 1, D)  # (K-1, D)
    taps = conv_taps(weight)  # (K, D)
    fp32_cpu = xBC.dtype == torch.float32 and xBC.device.type == "cpu"
    if fused is not None and fp32_cpu:
        out = _fused_conv(fused, left, xBC, taps, bias)  # (L, D): [left | xBC] never built whole
    else:
        window = torch.cat([left, xBC])  # (K-1+L, D): time-major, no transposes of the long side
        out = window[:L] * taps[0]  # (L, D): tap k meets input t + k of the window
        for k in range(1, K):
            if fp32_cpu:
                out.add_(window[k:k + L] * taps[k])
            else:
                out.addcmul_(window[k:k + L], taps[k])
        if bias is not None:
            out += bias
    if marks is not None:
        marks.append(Marks(1, L, lambda r: _window_rows(left, xBC, r, r + K - 1).t()))  # (D, K-1)
    state = _window_rows(left, xBC, L, L + K - 1).t().contiguous()  # (D, K-1)
    return pointwise(silu_, out), state  # (L, D) (out itself, activated)


def _window_rows(left: Tensor, x: Tensor, a: int, b: int) -> Tensor:
    """Rows [a, b) of the conv window [left | x] (time-major), without building it whole."""
    k1 = left.shape[0]
    if a >= k1:
        return x[a - k1:b - k1]
    if b <= k1:
        return left[a:b]
    return torch.cat([left[a:], x[:b - k1]])


def _fused_conv(fused: ConvPrefill, left: Tensor, x: Tensor, taps: Tensor, bias: Tensor | None) -> Tensor:
    """`fused` (`Kernels.conv_prefill`) over [left | x]: the first K-1 rows from a small window
    of their own, the rest with x itself as the window (its rows read in place). -> (L, D)."""
    L, D, k1 = x.shape[0], x.shape[1], left.shape[0]
    out = torch.empty(L, D, dtype=x.dtype)
    head = min(L, k1)  # rows whose window reaches into `left`
    if head:
        fused(_window_rows(left, x, 0, head + k1).contiguous(), taps, bias, out=out[:head])
    if L > k1:
        fused(x, taps, bias, out=out[k1:])
    return out


def causal_conv_step(conv_state: Tensor, slots: Tensor, xBC: Tensor, weight: Tensor,
                     bias: Tensor | None, pointwise: Pointwise = whole, run: SlotRun = None,
                     fused: StateUpdate | None = None, taps: Tensor | None = None) -> Tensor:
    """One decode token per request: conv over [state | new], SiLU; shift the state in place.

    conv_state (S, D, K-1) (one Mamba layer of the pool), slots (R,), xBC (R, D),
    weight (D, 1, K), bias (D,); taps: `conv_taps(weight)` when the caller keeps it. Returns (R, D).

    The taps are summed in order with one elementwise multiply and add per tap (no window is
    built, no reduction over the short K axis); when the slots are one ascending run (`run`,
    `ForwardBatch.mamba_run`) the pool's rows are shifted in place, column by column. With
    `fused` (`Kernels.conv_update`) and an fp32 state, the same products and adds run in one
    pass per request (the same bits).
    """
    R, K = xBC.shape[0], weight.shape[-1]
    taps = conv_taps(weight) if taps is None else taps  # (K, D)
    if fused is not None and conv_state.dtype == torch.float32:
        return pointwise(F.silu, fused(conv_state, slots, xBC, taps, bias))
    old = conv_state.narrow(0, run[0], R) if run else conv_state[slots]  # (R, D, K-1)
    out = old[..., 0] * taps[0]  # (R, D)
    for k in range(1, K - 1):
        out.add_(old[..., k] * taps[k])
    out.add_(xBC * taps[K - 1])
    if bias is not None:
        out.add_(bias)
    if run:  # shift the pool's rows in place: oldest column out, the new input in
        for k in range(K - 2):
            old[..., k].copy_(old[..., k + 1])
        old[..., K - 2].copy_(xBC)
    else:
        conv_state[slots] = torch.cat([old[..., 1:], xBC.unsqueeze(-1).to(old.dtype)], dim=-1)
    return pointwise(F.silu, out)


def conv_segments(xBC: Tensor, segments: list[Segment], conv_state: Tensor, weight: Tensor,
                  bias: Tensor | None, pointwise: Pointwise = whole, fused: ConvPrefill | None = None) -> Tensor:
    """`causal_conv_prefill` of each sequence's rows of xBC (T, D), from the conv state at its
    slot (zeros for a fresh sequence); writes each one's final conv state back. -> (T, D)."""
    return scan_segments(segments, conv_state, lambda rows, initial, marks: causal_conv_prefill(
        xBC[rows], weight, bias, initial, pointwise, marks, fused))


def scan_segments(segments: list[Segment], state: Tensor,
                  scan: Callable[[slice, Tensor | None, list | None], tuple[Tensor, Tensor]]) -> Tensor:
    """Run `scan(rows, initial state or None, marks)` -> (y (L, ...), final state) for each
    sequence, from the recurrent state at its slot (None for a fresh sequence); writes each
    one's final state back (`marks`: its `Segment.trail`, where the scan appends its `Marks`).
    Returns the y's concatenated (T, ...)."""
    ys = []
    for seg in segments:
        y, final = scan(seg.rows, state[seg.mamba_slot] if seg.start else None, seg.trail)
        state[seg.mamba_slot] = final
        ys.append(y)
    return cat_rows(ys)


# ---------------------------------------------------------------------------- small stages
def discretize_dt(dt: Tensor, dt_bias: Tensor, limit: tuple[float, float],
                  pointwise: Pointwise = whole) -> Tensor:
    """dt = softplus(dt + dt_bias) clamped to `limit`, fp32. dt (T, H), dt_bias (H,).

    transformers clamps only in its prefill, not in its decode step; with the default limits
    (0, inf) the clamp changes nothing, and applying it in both keeps prefill and decode alike.
    """
    dt = pointwise(F.softplus, dt.float() + dt_bias.float())  # (T, H)
    return dt.clamp(limit[0], limit[1])


def gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, group_size: int, eps: float,
                   pointwise: Pointwise = whole, out: Tensor | None = None,
                   gate_in_place: bool = False) -> Tensor:
    """RMSNorm of y * silu(z) over groups of `group_size` channels, computed in fp32.

    y, z (T, I), weight (I,). Returns (T, I) in the weight's dtype, written into `out` (T, I)
    when given (an fp32 `out` holds the fp32 work as it goes: nothing is copied). With
    `gate_in_place` an fp32 z is scratch: its SiLU (and, without an fp32 `out`, the rest of the
    work) may be computed in it, with the same bits and no second buffer.
    """
    T = y.shape[0]
    gate = pointwise(silu_ if gate_in_place else F.silu, z.float())  # (T, I): z itself or a fresh tensor
    h = torch.mul(gate, y.float(), out=out) if out is not None and out.dtype == torch.float32 else gate.mul_(y.float())
    g = h.view(T, -1, group_size)  # (T, G, I/G): in place from here
    if in_one_pass(g, weight):  # fp32 on the CPU: the two steps below in one call
        rowdot.rms_norm(g, eps, weight, out=g)
    else:
        g.mul_(inv_rms(g, eps))  # (T, G, I/G)
        h.mul_(weight.float())  # (T, I)
    if out is None:
        return h.to(weight.dtype)
    return out if h is out else out.copy_(h)


# ---------------------------------------------------------------------------- the mixer
class MambaMixer(nn.Module):
    """Weights of one Mamba2 mixer, under Hugging Face Bamba's names (`mamba.*`).

    Parameters are created empty; fill them with `actors.loader.load_hf_state_dict`.
    `prefill` and `decode` take the layer's slice of the pool: conv (S, conv_dim, d_conv-1) in
    the model dtype and ssm (S, H, P, N) in fp32.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c, H = config, config.mamba_n_heads
        self.config = c
        self.in_proj = nn.Linear(c.hidden_size, c.in_proj_dim, bias=c.mamba_proj_bias, dtype=dtype)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.mamba_d_conv, groups=c.conv_dim,
                                bias=c.mamba_conv_bias, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(H, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(H, dtype=dtype))
        self.D = nn.Parameter(torch.empty(H, dtype=dtype))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(c.mamba_intermediate, dtype=dtype))
        self.out_proj = nn.Linear(c.mamba_intermediate, c.hidden_size, bias=c.mamba_proj_bias,
                                  dtype=dtype)

    def prefill(self, h: Tensor, segments: list[Segment], conv_state: Tensor, ssm_state: Tensor,
                kernels: Kernels = Kernels()) -> Tensor:
        """The next tokens of each sequence (`segments`: their rows of h, concatenated), from the
        conv/SSM state at each one's slot (a sequence with `start` 0 begins from zero state,
        whatever its slot holds); writes each one's final state there. h (T, hidden) ->
        (T, hidden). Projections and elementwise stages run over all rows at once, the conv and
        the scan per sequence.
        """
        c = self.config
        z, xBC, dt = self._project(h, kernels)  # (T, I), (T, conv_dim), (T, H)
        xBC = conv_segments(xBC, segments, conv_state, self.conv1d.weight, self.conv1d.bias,
                            kernels.pointwise, kernels.conv_prefill)  # (T, conv_dim)
        x, B, C = self._split_xBC(xBC)  # (T, H, P), (T, G, N), (T, G, N)
        dt = discretize_dt(dt, self.dt_bias, c.time_step_limit, kernels.pointwise)  # (T, H) fp32
        A = self._A()
        chunk = scan_chunk(c.mamba_chunk_size, h.device)
        fused = kernels.ssd_scan if x.dtype == torch.float32 and chunk <= 64 else None
        y = scan_segments(segments, ssm_state, lambda rows, s0, marks: ssd_chunked(
            x[rows], dt[rows], A, B[rows], C[rows], chunk, s0, marks, kernels.ssd_carry) if fused is None
            else ssd_fused(fused, x[rows], dt[rows], A, B[rows], C[rows], chunk, s0, marks))  # (T, H, P)
        return self._output(y, x, z, kernels)

    def decode(self, h: Tensor, conv_state: Tensor, ssm_state: Tensor, slots: Tensor,
               kernels: Kernels, run: SlotRun = None) -> Tensor:
        """One token per request, updating the conv/SSM state at `slots` (R,) (`run`: the
        same as one ascending run, `ForwardBatch.mamba_run`). h (R, hidden)."""
        pw = kernels.pointwise
        z, xBC, dt = self._project(h, kernels)  # (R, I), (R, conv_dim), (R, H)
        xBC = causal_conv_step(conv_state, slots, xBC, self.conv1d.weight, self.conv1d.bias, pw, run,
                               kernels.conv_update, derived(self, "taps", self.conv1d.weight, conv_taps))
        x, B, C = self._split_xBC(xBC)  # (R, H, P), (R, G, N), (R, G, N)
        dt = discretize_dt(dt, self.dt_bias, self.config.time_step_limit, pw)  # (R, H) fp32
        y = ssd_step(ssm_state, slots, x, dt, self._A(), B, C, pw, run, kernels.ssd_update)  # (R, H, P)
        return self._output(y, x, z, kernels)

    def _A(self) -> Tensor:
        return derived(self, "A", self.A_log, lambda a: -torch.exp(a.float()))  # (H,)

    def _project(self, h: Tensor, kernels: Kernels) -> tuple[Tensor, Tensor, Tensor]:
        """in_proj and split into z (T, I), xBC (T, conv_dim), dt (T, H)."""
        c = self.config
        zxbcdt = kernels.linear(h, self.in_proj.weight, self.in_proj.bias)  # (T, in_proj_dim)
        return zxbcdt.split([c.mamba_intermediate, c.conv_dim, c.mamba_n_heads], dim=-1)

    def _split_xBC(self, xBC: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """xBC (T, conv_dim) -> x (T, H, P), B (T, G, N), C (T, G, N)."""
        c, T = self.config, xBC.shape[0]
        gn = c.mamba_n_groups * c.mamba_d_state
        x, B, C = xBC.split([c.mamba_intermediate, gn, gn], dim=-1)
        return (x.reshape(T, c.mamba_n_heads, c.mamba_d_head),
                B.reshape(T, c.mamba_n_groups, c.mamba_d_state),
                C.reshape(T, c.mamba_n_groups, c.mamba_d_state))

    def _output(self, y: Tensor, x: Tensor, z: Tensor, kernels: Kernels) -> Tensor:
        """D skip, gated RMSNorm, out_proj. y (T, H, P) fp32, x (T, H, P), z (T, I).

        The skip and the norm run in blocks of rows (`by_row_blocks`), so a long prefill's
        temporaries stay in cache (about 14 against 9 ms per `small` layer at 2,048 tokens)."""
        c, T = self.config, y.shape[0]
        D = derived(self, "D", self.D, lambda d: d.float()[:, None])  # (H, 1)
        group = c.mamba_intermediate // c.mamba_n_groups

        out = y.new_empty((T, c.mamba_intermediate), dtype=self.norm.weight.dtype)  # (T, I)

        def block(rows: slice) -> Tensor:  # (n, I), written into out's rows
            skip = y[rows] + D * x[rows].float()  # (n, H, P)
            return gated_rms_norm(skip.view(skip.shape[0], -1), z[rows], self.norm.weight, group,
                                  c.rms_norm_eps, kernels.pointwise, out=out[rows], gate_in_place=True)

        out = by_row_blocks(block, y, out=out)  # (T, I)
        return kernels.linear(out, self.out_proj.weight, self.out_proj.bias)  # (T, hidden)
