"""A request's life as the scheduler tracks it (torch-free).

    WAITING --admit--> RUNNING --finish--> FINISHED
                         |  ^
                 retract |  | resume (snapshot restore, or recompute prefill)
                         v  |
                      RETRACTED
    any state --abort--> ABORTED;  unrecoverable error --> FAILED
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from raysched.sampling import SamplingParams


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RETRACTED = "retracted"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def is_done(self) -> bool:
        return self in (State.FINISHED, State.ABORTED, State.FAILED)


@dataclass
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0  # lower is more urgent
    arrival_s: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    state: State = State.WAITING
    worker: int | None = None  # where it runs now
    workers: list[int] = field(default_factory=list)  # every worker it ran on, in order
    retractions: int = 0
    snapshot_ref: Any = None  # ray.ObjectRef of its Snapshot while RETRACTED by snapshot
    snapshot_bytes: int = 0  # its payload size, once the retraction reported it
    snapshot_node: str | None = None  # the node whose object store holds the snapshot
    recompute: bool = False  # resume by re-prefilling prompt + outputs instead of a snapshot
    target_worker: int | None = None  # a hand-over's decode worker (see `scheduler.roles`), or a
    #   recompute migration's destination: no other live worker resumes it
    streaming: bool = False  # a client reads its tokens as they come (`next_tokens`): its
    #   worker's calls send each decode step's tokens as the step completes
    handover_s: float | None = None  # when its hand-over was sent, until it is restored
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens restored (prefix reuse) instead of prefilled
    cache_kind: str | None = None  # which point it restored: "chunk" | "prompt" | "finished"
    cache_source: str | None = None  # where that point lay: "same_worker" | "same_node" | "other_node"
    text_stream: Any = None  # raysched.tokenizer.TextStream when the request has stop strings
    shared_prefix: int = 0  # prompt tokens its client says other prompts share (a chat's system
    #   message): prefix reuse parks a point there (`PrefixCache._declared`)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + tuple(self.output_ids)

    @property
    def num_tokens(self) -> int:
        """len(token_ids), without building them."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def num_cached(self) -> int:
        """Tokens whose KV/Mamba state exists while running (the last token is not fed yet)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def remaining(self) -> int:
        return self.sampling.max_new_tokens - len(self.output_ids)

    def add_tokens(self, tokens: list[int], now: float) -> None:
        if tokens and self.first_token_s is None:
            self.first_token_s = now
        self.output_ids.extend(tokens)

    def result(self) -> dict:
        """The public record of a finished request (what `RequestHandle.result()` returns)."""
        return {
            "request_id": self.request_id, "prompt_ids": list(self.prompt_ids),
            "token_ids": list(self.output_ids), "state": self.state.value,
            "finish_reason": self.finish_reason, "error": self.error,
            "workers": list(self.workers), "retractions": self.retractions,
            "priority": self.priority, "cached_tokens": self.cached_tokens, "cache_kind": self.cache_kind,
            "cache_source": self.cache_source,
            "ttft_s": None if self.first_token_s is None else self.first_token_s - self.arrival_s,
            "latency_s": None if self.finish_s is None else self.finish_s - self.arrival_s,
        }


def enqueue(queue: deque[Request], req: Request, front: bool = False) -> None:
    """Insert `req` in a queue kept in priority order (lower value first), first come first
    served within a priority; `front` puts it before the others of its priority (a request
    going back to where it was). With every priority equal this is append / appendleft."""
    if front:
        if not queue or queue[0].priority >= req.priority:
            queue.appendleft(req)  # (the common case, O(1): no scan of a long queue)
            return
        index = next((i for i, r in enumerate(queue) if r.priority >= req.priority), len(queue))
    else:
        if not queue or queue[-1].priority <= req.priority:
            queue.append(req)
            return
        index = next((i for i, r in enumerate(queue) if r.priority > req.priority), len(queue))
    queue.insert(index, req)
