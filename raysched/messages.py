"""The small messages between the scheduler and a worker: a step plan in, tokens and counts out.

Only ids, token ids and integers cross the wire every step; snapshots travel as Ray object refs
passed as extra top-level arguments of `Worker.step` (so Ray resolves them zero-copy), in the
order of `StepPlan.resume`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefillItem:
    """A request to prefill: a new one, or one resumed by recompute (history includes outputs)."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt + tokens generated so far
    prompt_len: int
    sampling: dict  # SamplingParams.to_dict()


@dataclass(frozen=True)
class StepPlan:
    """What one worker does in one call, in this order: drop, resume, prefill, decode.

    The prefill continues every request the worker is still prefilling (its prompt longer than
    earlier calls' chunks) and starts the new ones in `prefill`; decode runs the others.
    """

    drop: tuple[str, ...] = ()  # free without snapshot (abort, retract-by-recompute)
    resume: tuple[str, ...] = ()  # restore from the snapshots passed alongside, same order
    prefill: tuple[PrefillItem, ...] = ()
    decode_steps: int = 0
    prefill_chunk_tokens: int = 0  # each prefilling request (new or continued) advances by at
    #   most this many tokens in this call; 0 = to the end of its prompt

    def is_empty(self) -> bool:
        return not (self.drop or self.resume or self.prefill or self.decode_steps)


@dataclass(frozen=True)
class Usage:
    kv_free_tokens: int
    kv_total_tokens: int
    mamba_free_slots: int
    mamba_total_slots: int
    page_size: int


@dataclass
class StepResult:
    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)  # id -> "length" | "stop"
    stalled: list[str] = field(default_factory=list)  # could not get KV room for the next token
    not_admitted: list[str] = field(default_factory=list)  # prefill or resume did not fit
    resume_failed: dict[str, str] = field(default_factory=dict)  # id -> why the snapshot was refused
    allocated: dict[str, int] = field(default_factory=dict)  # id -> KV tokens held, running ones
    usage: Usage | None = None
    busy_s: float = 0.0  # time the worker spent computing this call


@dataclass(frozen=True)
class WorkerInfo:
    index: int
    node_id: str
    device: str
    fingerprint: str
    vocab_size: int
    max_context: int
    usage: Usage
    kv_bytes_per_token: int
    mamba_bytes_per_slot: int
    copy_bytes_per_s: float = 0.0  # measured at start-up (for the auto retract mode)
    prefill_tokens_per_s: float = 0.0
