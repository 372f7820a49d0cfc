"""The pools' bookkeeping without tensors (no torch): who holds which KV pages and state slot.

`PageLedger` (paged token slots), `SlotLedger` (one state slot per request) and `PoolLedger` (both,
taken together or not at all) are the accounting of `actors.pools`: `KVPool`, `StatePool` and
`HybridPool` extend them with the tensors the model reads; the simulated data plane
(`actors.sim`) uses them as they are. So a simulated worker runs out of room, stalls and reports
`Usage` exactly as a real one with the same pool sizes.

Ownership rules: a request owns a list of KV pages (its token slots, in order) and exactly one
state slot. `PoolLedger.admit` takes both or neither; `release` frees both. Running out is a normal
outcome (`admit` / `extend` return False); freeing what a request does not own, or twice, raises
`PoolError`: it is always a bug.
"""

from __future__ import annotations

from raysched.messages import Usage


class PoolError(RuntimeError):
    """Misuse of a pool: double free, or freeing slots the request does not own."""


class PageLedger:
    """Paged token slots: the free pages (lowest handed out first) and each request's pages."""

    def __init__(self, num_tokens: int, page_size: int) -> None:
        if num_tokens <= 0 or page_size <= 0:
            raise ValueError(f"KVPool: num_tokens ({num_tokens}) and page_size ({page_size}) must be > 0")
        self.page_size = page_size
        self.num_pages = -(-num_tokens // page_size)
        self._free_pages = list(range(self.num_pages - 1, -1, -1))  # pop() gives the lowest page
        self._pages: dict[str, list[int]] = {}
        self._lens: dict[str, int] = {}

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def pages_needed(self, request_id: str, total_tokens: int) -> int:
        """Pages `request_id` would have to take to hold `total_tokens` tokens."""
        have = len(self._pages.get(request_id, ()))
        return max(0, -(-total_tokens // self.page_size) - have)

    def can_allocate(self, num_tokens: int, request_id: str | None = None) -> bool:
        return self.pages_needed(request_id or "", num_tokens) <= len(self._free_pages)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Give a new request room for `num_tokens` tokens. False (nothing taken) if it does not fit."""
        if request_id in self._pages:
            raise PoolError(f"KVPool: request {request_id!r} already holds KV pages")
        self._pages[request_id], self._lens[request_id] = [], 0
        self._on_new(request_id, num_tokens)
        if not self.extend(request_id, num_tokens):
            self._forget(request_id)
            return False
        return True

    def extend(self, request_id: str, total_tokens: int) -> bool:
        """Grow a request to `total_tokens` tokens. False (nothing taken) if pages run out."""
        pages = self._owned(request_id)
        need = -(-total_tokens // self.page_size) - len(pages)  # `pages_needed` (this runs per token)
        if need > 0:
            free = self._free_pages
            if need > len(free):
                return False
            taken = free[-need:][::-1]  # the lowest free pages sit at the end
            del free[-need:]
            self._on_pages(request_id, len(pages), taken)
            pages.extend(taken)
        if total_tokens > self._lens[request_id]:
            self._lens[request_id] = total_tokens
        return True

    def num_request_tokens(self, request_id: str) -> int:
        self._owned(request_id)
        return self._lens[request_id]

    def free(self, request_id: str) -> None:
        pages = self._owned(request_id)
        self._free_pages.extend(reversed(pages))
        self._forget(request_id)

    def owners(self) -> list[str]:
        return list(self._pages)

    def _owned(self, request_id: str) -> list[int]:
        try:
            return self._pages[request_id]
        except KeyError:
            raise PoolError(f"KVPool: request {request_id!r} holds no KV pages (double free?)") from None

    def _forget(self, request_id: str) -> None:
        del self._pages[request_id], self._lens[request_id]

    # hooks for a pool with tensors (`actors.pools.KVPool` keeps each request's slot table)
    def _on_new(self, request_id: str, num_tokens: int) -> None:
        pass

    def _on_pages(self, request_id: str, first_page: int, new_pages: list[int]) -> None:
        pass


class SlotLedger:
    """One state slot per running request."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"StatePool: num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str, zero: bool = True) -> int | None:
        """A slot for the request, or None when all slots are taken. (`zero`: see `StatePool`.)"""
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
        """Reset the state at `slot` (no state to reset here)."""

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


class PoolLedger:
    """KV pages + a state slot per request, taken and freed together (see the module doc).
    `kv` and `states` are ledgers, or pools built on them."""

    def __init__(self, kv: PageLedger, states: SlotLedger) -> None:
        self.kv = kv
        self.mamba = states  # (the attribute name the model code reads; any recurrent state)

    def can_admit(self, num_tokens: int) -> bool:
        return self.mamba.num_free_slots > 0 and self.kv.can_allocate(num_tokens)

    def admit(self, request_id: str, num_tokens: int, zero_state: bool = True) -> bool:
        """Take a state slot and room for `num_tokens` tokens, both or neither. The state starts
        at zero unless `zero_state` is False (the caller writes all of it, as restore does)."""
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
        """Free the request's token slots and state slot."""
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
