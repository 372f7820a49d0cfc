"""The turn cache: complete request states parked in the object store, matched by token prefix.

Chat and agent clients resend the whole history every turn. When a request finishes (and when
its prompt's prefill completes), its worker copies the request's state (K/V of every attention
layer, conv + SSM of every Mamba layer) into a snapshot the scheduler owns; the cache keeps the
ref under the tokens that state covers (all but the last token of the request). A new request
whose prompt *starts with* a parked key (exact token match; the longest wins) and is longer
than it restores that state on any worker and prefills only the rest. A parked state stays
parked when used (the worker copies it into its own slots), so several forks of one turn all
hit. Entries are evicted least recently used when the parked bytes exceed the budget.

Pure bookkeeping (no Ray, no torch): the refs are opaque values here.

    cache = StateCache(budget_bytes=1 << 30, min_tokens=64)
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

    def __init__(self, budget_bytes: int, min_tokens: int) -> None:
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
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
        if not self.wants(len(tokens)) or nbytes > self.budget_bytes:
            return []
        self.drop(tokens)
        self._entries[tokens] = Parked(tokens, ref, nbytes, kind, node)
        self._lengths[len(tokens)] = self._lengths.get(len(tokens), 0) + 1
        self.bytes += nbytes
        evicted = []
        while self.bytes > self.budget_bytes:
            evicted.append(self._pop(next(iter(self._entries))))
            self.evictions += 1
        return evicted

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
        self.bytes = 0

    def _pop(self, tokens: tuple[int, ...]) -> Parked:
        entry = self._entries.pop(tokens)
        self.bytes -= entry.nbytes
        self._lengths[len(tokens)] -= 1
        if not self._lengths[len(tokens)]:
            del self._lengths[len(tokens)]
        return entry
