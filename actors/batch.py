"""The explicit input of one model forward: which tokens, where their state lives.

The engine builds a `ForwardBatch` from its requests and the pool's tables; the model reads and
writes pool tensors only at the slots named here. Nothing is global.

Two kinds:
- prefill: a ragged batch of the next `seq_lens[i]` tokens of each sequence, concatenated without
  padding (padding would corrupt the SSM state). Without `kv_slots` every sequence starts from
  zero state. With `kv_slots`, `kv_slots[i]` (S_i + L_i,) lists the token slots of sequence i
  so far, the new ones last: its S_i earlier tokens (chunked prefill, a restored prefix) already
  have K/V there and their conv/SSM state at `mamba_slots[i]`, and positions continue from S_i.
  The new tokens' K/V are written to `out_slots`, the final conv/SSM state to `mamba_slots[i]`.
- decode: one new token per request. Its K/V is written to `out_slots[i]`, attention reads
  `kv_slots[i]` (all of the request's token slots, the new one last), and the conv/SSM state at
  `mamba_slots[i]` is read and updated in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class ForwardBatch:
    is_prefill: bool
    input_ids: torch.Tensor  # (T,) int64: prefill T = sum(seq_lens), decode T = B
    positions: torch.Tensor  # (T,) int64: position of each token in its sequence
    seq_lens: list[int]  # (B,) new tokens per sequence; all 1 for decode
    out_slots: torch.Tensor  # (T,) int64: KV token slot receiving each token's K/V
    mamba_slots: torch.Tensor  # (B,) int64: Mamba pool slot of each sequence
    kv_slots: list[torch.Tensor] | None = None  # (S_i + L_i,) int64 token slots per sequence

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def kv_flat(self) -> tuple[torch.Tensor, list[int]]:
        """Every sequence's token slots in one tensor (sum S_i + L_i,) and each one's count:
        built once per batch, shared by all attention layers (one gather each)."""
        assert self.kv_slots is not None
        return torch.cat(self.kv_slots), [s.shape[0] for s in self.kv_slots]


def contiguous_run(slots: torch.Tensor) -> tuple[int, int] | None:
    """(start, length) when the CPU tensor `slots` is start, start+1, ...; None otherwise."""
    n = int(slots.numel())
    if n == 0:
        return (0, 0)
    start = int(slots[0])
    if int(slots[-1]) - start + 1 != n or not bool((slots.diff() == 1).all()):
        return None
    return start, n
