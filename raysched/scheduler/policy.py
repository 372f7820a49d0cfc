"""Scheduling policy as pure functions (torch-free, no Ray): victim order, KV need, cost model."""

from __future__ import annotations

import math
from typing import Collection, Iterable

from raysched.config import VICTIM_ORDERS
from raysched.request import Request


def victim_key(order: str):
    """Sort key: the request to retract first sorts first."""
    keys = {
        # SGLang's default: fewest generated tokens first, then the longest prompt.
        "fewest_generated": lambda r: (r.num_generated, -len(r.prompt_ids)),
        "most_generated": lambda r: (-r.num_generated, -len(r.prompt_ids)),
        "newest": lambda r: -r.arrival_s,
        "oldest": lambda r: r.arrival_s,
        "largest_memory": lambda r: -r.num_cached,
    }
    if order not in keys:
        raise ValueError(f"unknown victim order {order!r}; choose from {list(VICTIM_ORDERS)}")
    return keys[order]


def order_victims(running: Iterable[Request], order: str, max_retractions: int,
                  unfed: Collection[str] = ()) -> list[Request]:
    """Retraction candidates, best victim first: the least urgent priority first, then `order`
    within a priority. Requests retracted `max_retractions` times are protected (they can no
    longer be picked), which guarantees progress; requests in `unfed` (ids of those whose prefill
    may not have started: nothing to snapshot) are never picked."""
    candidates = [r for r in running if r.retractions < max_retractions and r.request_id not in unfed]
    key = victim_key(order)
    return sorted(candidates, key=lambda r: (-r.priority, key(r)))


def pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def snapshot_cost_s(num_bytes: int, copy_bytes_per_s: float, cross_node: bool = True) -> float:
    """Time to snapshot, move and restore. The bytes cross memory three times on one node
    (gather, put into the producer's object store, scatter from the zero-copy read) and once
    more when the destination reads them from another node's store (one direct transfer: the
    scheduler never relays them)."""
    if copy_bytes_per_s <= 0:
        return math.inf
    return (3.0 + cross_node) * num_bytes / copy_bytes_per_s


def recompute_cost_s(num_tokens: int, prefill_tokens_per_s: float) -> float:
    if prefill_tokens_per_s <= 0:
        return math.inf
    return num_tokens / prefill_tokens_per_s


def choose_retract_mode(num_tokens: int, num_bytes: int, copy_bytes_per_s: float,
                        prefill_tokens_per_s: float, cross_node: bool = True) -> str:
    """'snapshot' or 'recompute', whichever is estimated cheaper for this request."""
    snap = snapshot_cost_s(num_bytes, copy_bytes_per_s, cross_node)
    recompute = recompute_cost_s(num_tokens, prefill_tokens_per_s)
    return "snapshot" if snap <= recompute else "recompute"
