"""The autoscale policy (pure: no Ray, no asyncio, no clock of its own): grow or shrink the
worker set from snapshots of the load.

Each `decide(load)` looks at one `Load` (the time, the waiting requests, every live worker's
running count and draining flag, the grows and shrinks in flight) and answers one `Decision`:

- grow by one worker when at least `scale_up_waiting` requests per undrained worker have waited
  without a break for `scale_up_after_s`, the set (draining workers and workers starting
  included) is below `max_workers`, and no grow is in flight; the pressure clock restarts after
  each grow and while one is in flight, so a new worker gets `scale_up_after_s` to take the
  queue before the next one is asked for;
- shrink (drain, then remove) the newest worker that has held no request, with nothing waiting,
  for `scale_down_idle_s`, when more than `min_workers` undrained workers remain and no grow or
  shrink is in flight. Anything waiting restarts every idle clock, and so does a worker joining
  the set (by a grow, or added by hand): the set was just made larger on purpose, so the
  idleness from before it does not count towards removing another worker at once.

    policy = AutoscalePolicy(config.autoscale)
    decision = policy.decide(Load(now=12.5, waiting=9, workers=(WorkerLoad(0, 2),)))
    decision.grow, decision.shrink                      # -> True, None  (once pressure lasted)
"""

from __future__ import annotations

from dataclasses import dataclass

from raysched.config import AutoscaleConfig


@dataclass(frozen=True)
class WorkerLoad:
    """One live worker as the policy sees it."""

    index: int
    running: int  # requests it holds (running, prefilling, being moved off)
    draining: bool = False  # takes no new work (drained by hand, or being removed)


@dataclass(frozen=True)
class Load:
    """A snapshot of the load at time `now` (seconds, any monotonic clock)."""

    now: float
    waiting: int  # requests waiting for a worker (new, and retracted ones waiting to resume)
    workers: tuple[WorkerLoad, ...]  # the live workers
    growing: int = 0  # workers being started (by a grow or a replacement)
    shrinking: int = 0  # workers this policy is draining and removing


@dataclass(frozen=True)
class Decision:
    grow: bool = False
    shrink: int | None = None  # index of the worker to drain and remove

    @property
    def nothing(self) -> bool:
        return not self.grow and self.shrink is None


NOTHING = Decision()


class AutoscalePolicy:
    """The decisions, with the two clocks they need: since when the queue has been under
    pressure, and since when each worker has been idle."""

    def __init__(self, cfg: AutoscaleConfig) -> None:
        self.cfg = cfg
        self.pressure_since: float | None = None
        self.idle_since: dict[int, float] = {}
        self.members: frozenset[int] = frozenset()  # the workers of the last load seen

    def decide(self, load: Load) -> Decision:
        self._tick_pressure(load)
        self._tick_idle(load)
        if self._should_grow(load):
            self.pressure_since = None
            return Decision(grow=True)
        victim = self._idle_victim(load)
        if victim is not None:
            del self.idle_since[victim]
            return Decision(shrink=victim)
        return NOTHING

    # ------------------------------------------------------------------ clocks
    def _tick_pressure(self, load: Load) -> None:
        """Start the pressure clock when the queue is over the threshold (and no grow is in
        flight); stop it otherwise."""
        if load.growing or not self._pressure(load):
            self.pressure_since = None
        elif self.pressure_since is None:
            self.pressure_since = load.now

    def _pressure(self, load: Load) -> bool:
        taking = sum(not w.draining for w in load.workers)
        return load.waiting >= self.cfg.scale_up_waiting * max(taking, 1)

    def _tick_idle(self, load: Load) -> None:
        """Each undrained worker holding nothing, with nothing waiting, keeps (or starts) its idle
        clock; every other worker loses its clock. A worker that joined restarts every clock."""
        members = frozenset(w.index for w in load.workers)
        if members - self.members:
            self.idle_since = {}
        self.members = members
        idle = {w.index for w in load.workers if not w.draining and not w.running and not load.waiting}
        self.idle_since = {i: self.idle_since.get(i, load.now) for i in sorted(idle)}

    # ------------------------------------------------------------------ decisions
    def _should_grow(self, load: Load) -> bool:
        lasted = self.pressure_since is not None and load.now - self.pressure_since >= self.cfg.scale_up_after_s
        return lasted and len(load.workers) + load.growing < self.cfg.max_workers

    def _idle_victim(self, load: Load) -> int | None:
        """The newest worker idle for `scale_down_idle_s`, if one may go."""
        taking = sum(not w.draining for w in load.workers)
        if load.growing or load.shrinking or load.waiting or taking <= self.cfg.min_workers:
            return None
        due = [i for i, since in self.idle_since.items() if load.now - since >= self.cfg.scale_down_idle_s]
        return max(due, default=None)
