"""The turn cache: complete request states parked in the object store, matched by token prefix.

Chat and agent clients resend the whole history every turn. When a request finishes (and when
its prompt's prefill completes), its worker copies the request's state (K/V of every attention
layer, conv + SSM of every Mamba layer) into a snapshot the scheduler owns; the cache keeps the
ref under the tokens that state covers (all but the last token of the request). A new request
whose prompt *starts with* a parked key (exact token match; the longest wins) and is longer
than it restores that state on any worker and prefills only the rest. A parked state stays
parked when used (the worker copies it into its own slots), so several forks of one turn all
hit. Entries are evicted least recently used when the parked bytes exceed the budget.

Small states are special: Ray returns a call's results under `inline_limit` bytes (100 KiB by
default) into the caller's own memory, not the object store, so parked states that small live in
the scheduler's process. They have a budget of their own, `inline_budget_bytes` (a few MiB, so the
scheduler stays small), on top of counting against `budget_bytes`.

Pure bookkeeping (no Ray, no torch): the refs are opaque values here.

    cache = StateCache(budget_bytes=1 << 30, min_tokens=64, inline_budget_bytes=8 << 20)
    cache.park(tuple(range(100)), ref, nbytes=4096, kind="finished", node="n1")
    hit = cache.lookup(tuple(range(150)))   # -> the entry above (100 tokens restored)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

KINDS = ("finished", "prompt")  # a finished turn's state, or the state at the end of a prompt


@dataclass
class Parked:
    """One parked state: the tokens it covers, its snapshot's ref, size and where it lies."""

    tokens: tuple[int, ...]
    ref: Any
    nbytes: int
    kind: str  # one of KINDS
    node: str | None = None


class StateCache:
    """Parked states keyed by the exact token tuple they cover, LRU order, bounded in bytes."""

    def __init__(self, budget_bytes: int, min_tokens: int, inline_budget_bytes: int | None = None,
                 inline_limit: int = 100 * 1024) -> None:
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
        self.inline_budget_bytes = budget_bytes if inline_budget_bytes is None else inline_budget_bytes
        self.inline_limit = inline_limit  # states under this size live in the scheduler's memory
        self.inline_bytes = 0
        self._entries: OrderedDict[tuple[int, ...], Parked] = OrderedDict()  # oldest use first
        self._lengths: dict[int, int] = {}  # covered length -> how many entries have it
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def wants(self, num_tokens: int) -> bool:
        """Is a state covering `num_tokens` tokens worth parking?"""
        return num_tokens >= self.min_tokens and self.budget_bytes > 0

    def park(self, tokens: tuple[int, ...], ref: Any, nbytes: int, kind: str,
             node: str | None = None) -> list[Parked]:
        """Park a state covering `tokens` (a newer one replaces an equal key); evicts least
        recently used entries past the budget and returns them (their refs are dropped here)."""
        if kind not in KINDS:
            raise ValueError(f"unknown parked-state kind {kind!r}; choose from {list(KINDS)}")
        if not self.wants(len(tokens)) or nbytes > self._budget_for(nbytes):
            return []
        self.drop(tokens)
        self._entries[tokens] = Parked(tokens, ref, nbytes, kind, node)
        self._lengths[len(tokens)] = self._lengths.get(len(tokens), 0) + 1
        self._count(nbytes, +1)
        evicted = []
        while self.bytes > self.budget_bytes or self.inline_bytes > self.inline_budget_bytes:
            over_inline = self.bytes <= self.budget_bytes
            oldest = next(t for t, e in self._entries.items() if not over_inline or self._inline(e.nbytes))
            evicted.append(self._pop(oldest))
            self.evictions += 1
        return evicted

    def _inline(self, nbytes: int) -> bool:
        return nbytes < self.inline_limit

    def _budget_for(self, nbytes: int) -> int:
        return min(self.budget_bytes, self.inline_budget_bytes) if self._inline(nbytes) else self.budget_bytes

    def _count(self, nbytes: int, sign: int) -> None:
        self.bytes += sign * nbytes
        if self._inline(nbytes):
            self.inline_bytes += sign * nbytes

    def lookup(self, prompt: tuple[int, ...]) -> Parked | None:
        """The entry with the longest key that `prompt` starts with and extends by at least one
        token (that token, at least, is prefilled); marks it recently used. None on a miss."""
        for n in sorted((n for n in self._lengths if n < len(prompt)), reverse=True):
            entry = self._entries.get(prompt[:n])
            if entry is not None:
                self._entries.move_to_end(entry.tokens)
                return entry
        return None

    def drop(self, tokens: tuple[int, ...]) -> Parked | None:
        """Forget the entry with exactly these tokens (e.g. its object was lost)."""
        return self._pop(tokens) if tokens in self._entries else None

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.bytes = self.inline_bytes = 0

    def _pop(self, tokens: tuple[int, ...]) -> Parked:
        entry = self._entries.pop(tokens)
        self._count(entry.nbytes, -1)
        self._lengths[len(tokens)] -= 1
        if not self._lengths[len(tokens)]:
            del self._lengths[len(tokens)]
        return entry
