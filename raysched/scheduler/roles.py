"""Worker roles: prefill, decode, or both (pure: no Ray, no torch). The one place the idea lives.

A worker's role is part of the scheduler's view of it (`WorkerView.role`); the data plane never
knows it, it follows the plans these rules shape:

    BOTH     takes new prompts, prefills and decodes them (colocated serving, the default);
    PREFILL  takes new prompts and prefills them in chunks. Once a prompt's prefill ends and its
             first token is sampled, the request is *handed over*: a planned retraction by
             snapshot, targeted at the decode worker with the most room (`choose_target`);
    DECODE   restores handed-over (and retracted) snapshots and decodes them; never prefills a
             new prompt. Under pressure it retracts as any worker does.

A request that must be recomputed (its snapshot lost, refused, or retracted by recompute) needs a
prefill, so it goes to a prefill worker, which hands it over again when done. When no live worker
of one role is left, the others act as BOTH (`effective_role`), so a lost worker never strands a
request. Roles come from the config (`roles: {prefill: P, decode: D}`: workers 0..P-1 prefill,
the rest decode); a replacement takes the role of the worker it replaces.

    roles = initial_roles(config)               # one Role per worker index
    decision = planner.plan_for_role(view, waiting, retracted, cfg, best_room, others)

The planner's decisions per role are `planner.plan_for_role`; everything else about roles is here.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING

from raysched.config import ServeConfig
from raysched.request import Request

if TYPE_CHECKING:
    from raysched.scheduler.planner import WorkerView


class Role(enum.Enum):
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


def initial_roles(config: ServeConfig) -> list[Role]:
    """The role of each of the `config.workers` workers, by index."""
    if config.roles is None:
        return [Role.BOTH] * config.workers
    return [Role.PREFILL] * config.roles.prefill + [Role.DECODE] * config.roles.decode


def effective_role(view: WorkerView, others: Iterable[WorkerView]) -> Role:
    """`view.role`, or BOTH when no other live worker has the complementary role."""
    if view.role is Role.BOTH:
        return Role.BOTH
    partner = Role.DECODE if view.role is Role.PREFILL else Role.PREFILL
    return view.role if any(o.role in (partner, Role.BOTH) for o in others) else Role.BOTH


def needs_prefill(r: Request) -> bool:
    """A retracted request that resumes by a prefill (recompute, or a mid-prefill snapshot)."""
    return r.recompute or r.num_generated == 0


def choose_target(views: Iterable[WorkerView]) -> int | None:
    """The decode worker a hand-over goes to: the one with the most room (then fewest running)."""
    decoders = [v for v in views if v.role is Role.DECODE]
    if not decoders:
        return None
    return max(decoders, key=lambda v: (v.room(), -len(v.running), -v.index)).index


def note_prefilled(view: WorkerView, new_tokens: Iterable[str], finished: Iterable[str]) -> None:
    """After a prefill worker's call: the requests that got a token (their prefill ended) and
    did not finish are ready to hand over. (Also while it stands in for a lost decode worker:
    once a decode worker is back, what it decodes meanwhile is handed over.)"""
    if view.role is Role.PREFILL:
        done = set(finished)
        view.ready.update(rid for rid in new_tokens if rid not in done)
        view.ready.intersection_update(r.request_id for r in view.running)


def takes_new_prompts(view: WorkerView, others: Iterable[WorkerView]) -> bool:
    """Does this worker admit waiting requests now (so a waiting one is a decision for it)?"""
    return effective_role(view, others) is not Role.DECODE


def role_stats(views: Iterable[WorkerView]) -> list[dict]:
    """Per worker: its role (what `raysched status` shows)."""
    return [{"worker": v.index, "role": v.role.value} for v in views]
