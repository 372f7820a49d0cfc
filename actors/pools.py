"""The hybrid memory pool: a paged KV pool for attention layers and a state pool for the others.

Ownership rules (the accounting is `actors.accounting`, shared with the simulated data plane)
- A request owns a list of KV pages (its token slots, in order) and exactly one state slot.
- `HybridPool.admit` takes both or neither; `HybridPool.release` frees both. Nobody else frees.
- Running out of pages or slots is a normal outcome: `admit` / `extend` return False. Freeing
  something a request does not own, or freeing twice, raises `PoolError`: it is always a bug.

Tensor layout (what the model reads and writes)
- `k`, `v`: (num_attention_layers, num_pages * page_size, kv_heads, head_dim), model dtype.
- one tensor per entry of `config.state_tensors` (what each recurrent layer kind declares):
  (num_layers_of_kind, num_slots, *shape), fp32 or model dtype. Mamba2: `conv`
  (conv_dim, d_conv - 1) and `ssm` (heads, head_dim, d_state) fp32; gated delta net: `gdn_conv`
  (2 * key_dim + value_dim, k - 1) and `gdn_state` (v_heads, d_k, d_v) fp32.
A request's one state slot indexes every state tensor. With `scratch=True` each pool has one
slot (one KV page, one state slot) past its capacity that is never handed out: the padding
rows of a fixed-shape decode step (`actors.graph`) write there. A model with no attention (or no
recurrent) layers gets zero-sized tensors; the slot accounting stays the same, so the scheduler
reasons about every model alike. `HybridPool.tensor(name)` is the one accessor the model uses.
"""

from __future__ import annotations

import torch

from actors.accounting import PageLedger, PoolError, PoolLedger, SlotLedger
from actors.config import ModelConfig

__all__ = ["HybridPool", "KVPool", "PoolError", "StatePool"]


class KVPool(PageLedger):
    """Paged token slots for the K/V of all attention layers (the accounting: `PageLedger`)."""

    def __init__(self, config: ModelConfig, num_tokens: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, scratch: bool = False) -> None:
        super().__init__(num_tokens, page_size)
        # the scratch token slot: first slot of the page past the last (None without scratch)
        self.scratch_slot = self.num_pages * page_size if scratch else None
        shape = (config.num_attention_layers, (self.num_pages + int(scratch)) * page_size,
                 config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._slots: dict[str, torch.Tensor] = {}  # (capacity,) int64 token slots on CPU, the
        #   first `_lens` valid: grown in place as pages are added (doubling), never rebuilt

    def _on_new(self, request_id: str, num_tokens: int) -> None:
        self._slots[request_id] = torch.empty(max(num_tokens, 1), dtype=torch.int64)

    def _forget(self, request_id: str) -> None:
        super()._forget(request_id)
        del self._slots[request_id]

    def _on_pages(self, request_id: str, first_page: int, new_pages: list[int]) -> None:
        self._add_slots(request_id, first_page, new_pages)

    def _add_slots(self, request_id: str, first_page: int, new_pages: list[int]) -> None:
        """Write the token slots of `new_pages` (the request's pages first_page, ...) into its
        slot table, growing the table (doubling) when it is full: O(new tokens), not O(length)."""
        at, table = first_page * self.page_size, self._slots[request_id]
        end = at + len(new_pages) * self.page_size
        if end > table.shape[0]:
            grown = torch.empty(max(end, 2 * table.shape[0]), dtype=torch.int64)
            grown[:at] = table[:at]
            self._slots[request_id] = table = grown
        if self.page_size == 1 and len(new_pages) <= 4:  # the usual decode step: a write or two
            for i, page in enumerate(new_pages):
                table[at + i] = page
            return
        page_ids = torch.tensor(new_pages, dtype=torch.int64)
        table[at:end] = (page_ids[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def token_slots(self, request_id: str) -> torch.Tensor:
        """(len,) int64: the token slot of each of the request's tokens, in order (CPU; a view
        of the request's slot table, valid until the request is freed)."""
        self._owned(request_id)
        return self._slots[request_id][: self._lens[request_id]]


class StatePool(SlotLedger):
    """One slot per running request: every per-request state tensor of every recurrent layer
    (the accounting: `SlotLedger`).

    `tensors[name]`: (layers of the tensor's kind, num_slots, *shape) for each entry of
    `config.state_tensors`.
    """

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype,
                 device: torch.device, scratch: bool = False) -> None:
        super().__init__(num_slots)
        self.scratch_slot = num_slots if scratch else None  # never handed out
        self.tensors = {
            t.name: torch.zeros((len(config.layers_of_kind(t.kind)), num_slots + int(scratch), *t.shape),
                                dtype=torch.float32 if t.fp32 else dtype, device=device)
            for t in config.state_tensors}

    def zero(self, slot: int) -> None:
        """Reset every state tensor at `slot`."""
        for t in self.tensors.values():
            t[:, slot].zero_()


class HybridPool(PoolLedger):
    """KV pool + state pool, and the table request -> (token slots, state slot); admit, extend,
    release and usage are `PoolLedger`'s."""

    def __init__(self, config: ModelConfig, kv_tokens: int, state_slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", page_size: int = 1,
                 scratch: bool = False) -> None:
        device = torch.device(device)
        self.config = config
        super().__init__(KVPool(config, kv_tokens, page_size, dtype, device, scratch),
                         StatePool(config, state_slots, dtype, device, scratch))  # state slots (all kinds)

    @property
    def has_scratch(self) -> bool:
        """True when padding rows of a fixed-shape decode have slots of their own to write."""
        return self.kv.scratch_slot is not None

    @classmethod
    def from_budget(cls, config: ModelConfig, budget_bytes: int, state_slots: int,
                    dtype: torch.dtype, device: torch.device | str = "cpu",
                    page_size: int = 1) -> "HybridPool":
        """Size the KV pool with whatever `budget_bytes` leaves after `state_slots` Mamba slots."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        left = budget_bytes - state_slots * config.state_bytes_per_slot(itemsize)
        per_token = max(1, config.kv_bytes_per_token(itemsize))
        if left < per_token * page_size:
            raise ValueError(f"pool budget {budget_bytes} B cannot hold {state_slots} Mamba slots "
                             f"plus one KV page")
        return cls(config, left // per_token, state_slots, dtype, device, page_size)

    # tensors the model reads/writes
    @property
    def k(self) -> torch.Tensor:
        return self.kv.k

    @property
    def v(self) -> torch.Tensor:
        return self.kv.v

    @property
    def conv(self) -> torch.Tensor:
        return self.mamba.tensors["conv"]

    @property
    def ssm(self) -> torch.Tensor:
        return self.mamba.tensors["ssm"]

    def tensor(self, name: str) -> torch.Tensor:
        """A pool tensor by name: "k", "v" or a state tensor's name (`config.state_tensors`)."""
        if name in ("k", "v"):
            return getattr(self.kv, name)
        try:
            return self.mamba.tensors[name]
        except KeyError:
            raise PoolError(f"pool has no tensor {name!r}; it has k, v, "
                            f"{', '.join(self.mamba.tensors)}") from None
