"""The hybrid memory pool: a paged KV pool for attention layers and a state pool for the others.

Ownership rules
- A request owns a list of KV pages (its token slots, in order) and exactly one Mamba slot.
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

from actors.config import ModelConfig
from raysched.messages import Usage


class PoolError(RuntimeError):
    """Misuse of a pool: double free, or freeing slots the request does not own."""


class KVPool:
    """Paged token slots for the K/V of all attention layers."""

    def __init__(self, config: ModelConfig, num_tokens: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, scratch: bool = False) -> None:
        if num_tokens <= 0 or page_size <= 0:
            raise ValueError(f"KVPool: num_tokens ({num_tokens}) and page_size ({page_size}) must be > 0")
        self.page_size = page_size
        self.num_pages = -(-num_tokens // page_size)
        # the scratch token slot: first slot of the page past the last (None without scratch)
        self.scratch_slot = self.num_pages * page_size if scratch else None
        shape = (config.num_attention_layers, (self.num_pages + int(scratch)) * page_size,
                 config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free_pages = list(range(self.num_pages - 1, -1, -1))  # pop() gives the lowest page
        self._pages: dict[str, list[int]] = {}
        self._lens: dict[str, int] = {}
        self._slots: dict[str, torch.Tensor] = {}  # (capacity,) int64 token slots on CPU, the
        #   first `_lens` valid: grown in place as pages are added (doubling), never rebuilt

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    def pages_needed(self, request_id: str, total_tokens: int) -> int:
        """Pages `request_id` would have to take to hold `total_tokens` tokens."""
        have = len(self._pages.get(request_id, ()))
        return max(0, -(-total_tokens // self.page_size) - have)

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def can_allocate(self, num_tokens: int, request_id: str | None = None) -> bool:
        return self.pages_needed(request_id or "", num_tokens) <= len(self._free_pages)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Give a new request room for `num_tokens` tokens. False (nothing taken) if it does not fit."""
        if request_id in self._pages:
            raise PoolError(f"KVPool: request {request_id!r} already holds KV pages")
        self._pages[request_id], self._lens[request_id] = [], 0
        self._slots[request_id] = torch.empty(max(num_tokens, 1), dtype=torch.int64)
        if not self.extend(request_id, num_tokens):
            del self._pages[request_id], self._lens[request_id], self._slots[request_id]
            return False
        return True

    def extend(self, request_id: str, total_tokens: int) -> bool:
        """Grow a request to `total_tokens` tokens. False (nothing taken) if pages run out."""
        pages = self._owned(request_id)
        need = self.pages_needed(request_id, total_tokens)
        if need > len(self._free_pages):
            return False
        if need:
            taken = self._free_pages[-need:]  # the lowest free pages sit at the end
            del self._free_pages[-need:]
            self._add_slots(request_id, len(pages), list(reversed(taken)))
            pages.extend(reversed(taken))
        if total_tokens > self._lens[request_id]:
            self._lens[request_id] = total_tokens
        return True

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

    def num_request_tokens(self, request_id: str) -> int:
        self._owned(request_id)
        return self._lens[request_id]

    def free(self, request_id: str) -> None:
        pages = self._owned(request_id)
        self._free_pages.extend(reversed(pages))
        del self._pages[request_id], self._lens[request_id], self._slots[request_id]

    def owners(self) -> list[str]:
        return list(self._pages)

    def _owned(self, request_id: str) -> list[int]:
        try:
            return self._pages[request_id]
        except KeyError:
            raise PoolError(f"KVPool: request {request_id!r} holds no KV pages (double free?)") from None


class StatePool:
    """One slot per running request: every per-request state tensor of every recurrent layer.

    `tensors[name]`: (layers of the tensor's kind, num_slots, *shape) for each entry of
    `config.state_tensors`.
    """

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype,
                 device: torch.device, scratch: bool = False) -> None:
        if num_slots <= 0:
            raise ValueError(f"StatePool: num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self.scratch_slot = num_slots if scratch else None  # never handed out
        self.tensors = {
            t.name: torch.zeros((len(config.layers_of_kind(t.kind)), num_slots + int(scratch), *t.shape),
                                dtype=torch.float32 if t.fp32 else dtype, device=device)
            for t in config.state_tensors}
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str, zero: bool = True) -> int | None:
        """A slot for the request (zeroed unless the caller overwrites it, e.g. a restore), or
        None when all slots are taken."""
        if request_id in self._slot_of:
            raise PoolError(f"StatePool: request {request_id!r} already holds slot {self._slot_of[request_id]}")
        if not self._free:
            return None
        slot = self._free.pop()
        if zero:
            self.zero(slot)
        self._slot_of[request_id] = slot
        return slot

    def zero(self, slot: int) -> None:
        """Reset every state tensor at `slot`."""
        for t in self.tensors.values():
            t[:, slot].zero_()

    def slot(self, request_id: str) -> int:
        try:
            return self._slot_of[request_id]
        except KeyError:
            raise PoolError(f"StatePool: request {request_id!r} holds no state slot (double free?)") from None

    def free(self, request_id: str) -> None:
        self._free.append(self.slot(request_id))
        del self._slot_of[request_id]

    def owners(self) -> list[str]:
        return list(self._slot_of)


class HybridPool:
    """KV pool + Mamba pool, and the table request -> (token slots, Mamba slot)."""

    def __init__(self, config: ModelConfig, kv_tokens: int, mamba_slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", page_size: int = 1,
                 scratch: bool = False) -> None:
        device = torch.device(device)
        self.config = config
        self.kv = KVPool(config, kv_tokens, page_size, dtype, device, scratch)
        self.mamba = StatePool(config, mamba_slots, dtype, device, scratch)  # state slots (all kinds)

    @property
    def has_scratch(self) -> bool:
        """True when padding rows of a fixed-shape decode have slots of their own to write."""
        return self.kv.scratch_slot is not None

    @classmethod
    def from_budget(cls, config: ModelConfig, budget_bytes: int, mamba_slots: int,
                    dtype: torch.dtype, device: torch.device | str = "cpu",
                    page_size: int = 1) -> "HybridPool":
        """Size the KV pool with whatever `budget_bytes` leaves after `mamba_slots` Mamba slots."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        left = budget_bytes - mamba_slots * config.state_bytes_per_slot(itemsize)
        per_token = max(1, config.kv_bytes_per_token(itemsize))
        if left < per_token * page_size:
            raise ValueError(f"pool budget {budget_bytes} B cannot hold {mamba_slots} Mamba slots "
                             f"plus one KV page")
        return cls(config, left // per_token, mamba_slots, dtype, device, page_size)

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

    def can_admit(self, num_tokens: int) -> bool:
        return self.mamba.num_free_slots > 0 and self.kv.can_allocate(num_tokens)

    def admit(self, request_id: str, num_tokens: int, zero_state: bool = True) -> bool:
        """Take a Mamba slot and room for `num_tokens` tokens, both or neither. The Mamba state
        starts at zero unless `zero_state` is False (the caller writes all of it, as restore does)."""
        if not self.can_admit(num_tokens):
            return False
        self.mamba.allocate(request_id, zero=zero_state)
        if not self.kv.allocate(request_id, num_tokens):  # cannot happen after can_admit
            self.mamba.free(request_id)
            return False
        return True

    def extend(self, request_id: str, total_tokens: int) -> bool:
        return self.kv.extend(request_id, total_tokens)

    def release(self, request_id: str) -> None:
        """Free the request's token slots and Mamba slot."""
        self.mamba.slot(request_id)  # raises before anything is freed if it holds none
        self.kv.free(request_id)
        self.mamba.free(request_id)

    def usage(self) -> Usage:
        return Usage(self.kv.num_free_tokens, self.kv.num_tokens, self.mamba.num_free_slots,
                         self.mamba.num_slots, self.kv.page_size)

    def owners(self) -> set[str]:
        return set(self.kv.owners()) | set(self.mamba.owners())

    def is_empty(self) -> bool:
        u = self.usage()
        return (u.kv_free_tokens == u.kv_total_tokens and u.state_free_slots == u.state_total_slots
                and not self.owners())
