"""Prefix reuse, the scheduler's side (the glue between the dispatcher and the index): lookups
at admission, placement hints, holding back a request whose prefix another one is prefilling,
taking over the points workers park, and the hit counts. With reuse off every answer is empty.

The index itself (`state_cache.StateCache`) is pure; this part talks to workers: a
worker that parked points in a call lists them in `StepResult.parked`; `take` hands the ones
the index keeps (and the K/V blocks it lacks) over to the scheduler with `Worker.take_parked`
(their return values: the scheduler owns them, they stay in that worker's node store and
outlive the worker) and tells the worker to drop the rest (`Worker.discard_parked`).

Placement: when a waiting request's match lies on worker h and h's room is within `slack` of
the roomiest worker's, h admits it (no transfer); hits are counted by where the point came from
(same worker, same node, other node). A request whose prompt shares more whole blocks with a
prompt being prefilled right now than the index holds waits for those blocks' points (`held`)
instead of prefilling them a second time. A request with no home and whole blocks to prefill
goes where the fewest blocks wait to be prefilled (`Placement.pending`), room breaking ties.

Branch points (`branch_points=True`): at admission each new prompt is added to a radix tree of
recent prompts on the workers' scan grid (32 tokens on the CPU) (`state_cache.BranchPoints`); where it leaves an
earlier one (rounded down to the grid, short of its last token) is a point two prompts pass.
When the index has no state there, the plan asks for one (`park_at(worker)`, sent as
`StepPlan.park_at`): the earlier request parks it if it starts in the same plan (the new one
waits for it, held back like a block's producer). When the earlier one's prefill already ran
(the new prompt came while its call did) and its worker keeps its recent calls' scan states
(`late_calls`, `StepPlan.trail_calls`), its worker is asked for the point from those (a *late*
ask: the new one waits for that worker's next reply, parked or not). Otherwise the new request
parks it itself (the next prompt sharing it restores it). A repeated prompt's point is its last
grid point. A request whose client declares a shared prefix (`Request.shared_prefix`: a chat's
system message) parks a point there itself, shared or not yet (`_declared`).

No Ray import: worker handles are opaque.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from raysched.messages import ParkedPoint, StepResult
from raysched.request import Request, State
from raysched.scheduler.fleet import WorkerSlot
from raysched.scheduler.planner import Decision
from raysched.scheduler.state_cache import GRID_TOKENS, BlockRef, BranchPoints, Match, Place, StateCache
from raysched.scheduler.table import RequestTable
from raysched.stats import Counters

log = logging.getLogger("raysched.scheduler")

LOOKAHEAD = 64  # waiting requests looked at per plan for placement and holding back
LATE_TRIED = 4096  # branch points asked late, remembered so that none is asked late twice
SOURCES = ("same_worker", "same_node", "other_node")


@dataclass(frozen=True)
class Placement:
    """Where the next waiting requests' matched points lie; the planner asks `admits_here`."""

    home: dict[str, int]  # request id -> index of the worker holding its match (or its producer)
    rooms: dict[int, float]  # live worker index -> room (fraction of its scarcer pool free;
    #   -1.0: draining, it takes nothing new)
    slack: float
    pending: dict[int, int] = field(default_factory=dict)  # live worker index -> whole blocks of the
    #   prompts its producers (requests prefilling blocks no point holds yet) are prefilling, each
    #   producer's counted whole until its prefill ends
    block_tokens: int = 0
    _least: dict[int, int | None] = field(default_factory=dict)  # index -> least `pending` among the
    #   other workers with room (worked out once per decision, not once per waiting request)

    def admits_here(self, r: Request, index: int, room: float, best_elsewhere: float,
                    admitted: Sequence[Request] = ()) -> bool:
        """Should the worker `index` (with `room`, having admitted `admitted` in this decision)
        admit `r` now? Its home worker when that one has room within `slack` of the best;
        with no home, a prompt of whole blocks goes where the fewest such blocks wait to be
        prefilled (`_less_pending`), anything else to the roomiest worker, as without reuse."""
        home = self.home.get(r.request_id)
        if home is None or home not in self.rooms:
            less = self._less_pending(r, index, admitted)
            return room >= best_elsewhere if less is None else less
        if home == index:
            return room >= best_elsewhere - self.slack
        return self.rooms[home] < room - self.slack and room >= best_elsewhere

    def _less_pending(self, r: Request, index: int, admitted: Sequence[Request]) -> bool | None:
        """For a prompt with no home and whole blocks to prefill (a group's first request):
        whether this worker has fewer blocks waiting to be prefilled (counting the ones it
        admitted in this decision) than the least of the other workers with room; None on a
        tie, or for a shorter prompt. Room alone would hand a burst's long first prompts to
        whichever worker decides first (rooms are equal at the start), which then prefills them
        one after another while another worker has none to prefill."""
        if not self._blocks(r):
            return None
        if index not in self._least:
            self._least[index] = min((n for i, n in self.pending.items()
                                      if i != index and self.rooms.get(i, -1.0) > 0), default=None)
        least = self._least[index]
        if least is None:
            return None
        mine = self.pending.get(index, 0) + sum(self._blocks(a) for a in admitted if a.request_id not in self.home)
        return None if mine == least else mine < least

    def _blocks(self, r: Request) -> int:
        return len(r.prompt_ids) // self.block_tokens if self.block_tokens else 0

    def waits_elsewhere(self, r: Request, index: int) -> bool:
        """Whether `r` waits for another live worker, the one holding its match: a worker that
        does not admit it passes it over and admits the requests behind it (one request
        waiting for its home does not hold back those whose home this worker is)."""
        home = self.home.get(r.request_id)
        return home is not None and home != index and home in self.rooms


class PrefixCache:
    """The index (None: reuse off), the matches of admitted requests, in-flight producers and
    placement."""

    def __init__(self, index: StateCache | None, table: RequestTable, counters: Counters,
                 slack: float = 0.25, branch_points: bool = False, late_calls: int = 0,
                 turn_points: bool = True) -> None:
        self.index = index
        self.turn_points = turn_points
        self.branches = BranchPoints(GRID_TOKENS) if index is not None and branch_points else None
        self.late_calls = late_calls if self.branches is not None else 0
        self._park_at: dict[int, list[tuple[str, int]]] = {}  # worker -> `StepPlan.park_at` of its next plan
        self._branching: dict[int, tuple[str, int]] = {}  # hash of a branch prefix -> (request
        #   asked to park it, its length), until that request's prefill is over
        self._late: dict[int, tuple[int, bool]] = {}  # key of a late ask -> (its worker, sent),
        #   until that worker's reply to the plan that carried it
        self._late_tried: dict[int, None] = {}  # keys asked late once (not again), recent first
        self.table = table
        self.counters = counters
        self.slack = slack
        self._match_of: dict[str, Match] = {}  # admitted id -> its match, until its call returns
        self._producers: dict[str, tuple[Request, int, set[int]]] = {}  # id -> (request, worker,
        #   keys of the whole-block prefixes it will park: `_block_keys`)
        self._inflight: dict[int, int] = {}  # key of a block-aligned prefix -> producers

    def park_min_tokens(self) -> int:
        """What a step plan asks the worker to park (0: nothing)."""
        return self.index.min_tokens if self.index is not None else 0

    def park_turns(self) -> bool:
        """`StepPlan.park_turns`: park prompt points and finished turns too (while they pay:
        `StateCache.turns_pay`)."""
        return self.turn_points and (self.index is None or self.index.turns_pay())

    def trail_calls(self) -> int:
        """`StepPlan.trail_calls`: the prefill calls whose scan states a worker keeps."""
        return self.late_calls

    def late_unsent(self) -> set[int]:
        """Workers with a late ask waiting for their next plan: a long call there is ended
        (`Fleet.interrupt`), since the states it asks for age out and its request may finish."""
        return {worker for worker, sent in self._late.values() if not sent}

    def park_at(self, worker: int) -> tuple[tuple[str, int], ...]:
        """`StepPlan.park_at` of the plan about to go to `worker`: the branch points its
        requests were asked to park by this plan's admissions (each asked once), and the late
        asks for it (sent now: resolved by its reply)."""
        for key, (target, _) in self._late.items():
            if target == worker:
                self._late[key] = (worker, True)
        return tuple(self._park_at.pop(worker, ()))

    # ------------------------------------------------------------------ admission
    def survey(self, waiting: deque[Request], rooms: dict[int, float]) -> tuple[set[str], Placement | None]:
        """For the first LOOKAHEAD waiting requests: those held back (their prompt shares more
        whole blocks with a prompt being prefilled now than the index holds for them: they wait
        for those points instead of computing them twice), and everyone's home worker (where
        its match lies, or where its producer runs). None: nothing to say (reuse off)."""
        held, home = set(), {}
        if self.index is None:
            return held, None
        self._sweep_branching()  # (a late ask's parker may have ended since a reply last swept)
        for r in _head(waiting):
            match = self.index.lookup(r.prompt_ids, touch=False) if not r.num_generated else None
            if self.branches is not None and not r.num_generated and not self.branches.knows(r.request_id):
                self._arrived(r, match)
            producer = None if r.num_generated else self._producer_of(r, match.num_tokens if match else 0)
            producer = self._branch_producer(r, match) if producer is None else producer
            if producer is not None:
                held.add(r.request_id)
                home[r.request_id] = producer
            elif match is not None and match.point.place.worker is not None:
                home[r.request_id] = match.point.place.worker
        return held, Placement(home, rooms, self.slack, self._pending(rooms), self.index.block_tokens)

    def _pending(self, rooms: dict[int, float]) -> dict[int, int]:
        """Live worker index -> whole blocks of the prompts its producers are prefilling (a
        producer's blocks count until its prefill ends: the scheduler sees no progress within it)."""
        self._sweep_producers()
        pending = dict.fromkeys(rooms, 0)
        for _, worker, keys in self._producers.values():
            if worker in pending:
                pending[worker] += len(keys)
        return pending

    def admit(self, admitted: list[Request], worker: int) -> tuple[list[tuple[Request, Match]], list[Request]]:
        """Look up each request a plan admits, in order: ((request, match) for the hits, the
        requests to put back: those whose blocks a request admitted before them (in this plan or
        earlier) is about to prefill). Requests that will park boundary points become producers."""
        hits, back, here = [], [], set()
        if self.index is None:
            return hits, back
        for r in admitted:
            match = self.index.lookup(r.prompt_ids) if not r.num_generated else None
            restored = match.num_tokens if match else 0
            if not r.num_generated and not r.retractions and self._producer_of(r, restored) is not None:
                back.append(r)
                continue
            exact = match is None or match.point.exact
            if self._branch(r, restored, exact, here, worker):
                back.append(r)
                continue
            self._declared(r, restored, exact, worker)
            here.add(r.request_id)
            if match is not None:
                hits.append((r, match))
                self._match_of[r.request_id] = match
            if not r.num_generated and (match is None or match.point.exact):
                self._add_producer(r, worker, restored)
        return hits, back

    # ------------------------------------------------------------------ branch points
    def _branch(self, r: Request, restored: int, exact: bool, here: set[str], worker: int) -> bool:
        """Ask for a state at `r`'s branch point when the index has none: from the earlier
        request that passes it if that one starts in this plan (`here`), else from `r` (unless
        `r` starts from an inexact state: it parks no exact points). True: `r` waits for a state
        another request is asked for (now or before)."""
        if self.branches is None or r.num_generated:
            return False
        point, owner = self.branches.add(r.request_id, r.prompt_ids)
        if point < self.index.min_tokens or restored >= point:
            return False
        key = hash(r.prompt_ids[:point])
        asked = self._branching.get(key)
        if asked is not None and asked[0] != r.request_id:
            return True
        late = None if asked or owner in here else self._late_parker(r, point, key)
        if late is not None:
            self._ask_late(key, point, *late)
            return True
        parker = asked[0] if asked else owner if owner in here else r.request_id
        if parker == r.request_id and not exact:
            return False
        self._ask(key, point, parker, worker)
        return parker != r.request_id

    def _declared(self, r: Request, restored: int, exact: bool, worker: int) -> None:
        """`r`'s client said its first `shared_prefix` tokens are shared (a chat's system
        message): unless the index has a state there or past it on `r`'s path, or one is asked
        for, `r` parks one there (rounded down to the grid) in this plan, so that the next
        prompt sharing it hits even when it comes after `r` ended."""
        if self.branches is None or r.num_generated or not exact or not r.shared_prefix:
            return
        point = min(r.shared_prefix, len(r.prompt_ids) - 1) // self.branches.grid * self.branches.grid
        key = hash(r.prompt_ids[:point])
        if point < self.index.min_tokens or restored >= point or key in self._branching:
            return
        self._ask(key, point, r.request_id, worker)

    def _arrived(self, r: Request, match: Match | None) -> None:
        """A prompt first seen waiting joins the branch tree (so the first of two prompts is
        asked for their point when it starts); if an earlier prompt's prefill already passed
        their branch point and the index has no state there, that request's worker is asked
        for it now (late), not when `r` is admitted: by then the states it keeps may be gone."""
        if not self.index.turns_pay() and self.branches.contains_earlier(r.prompt_ids):
            self.index.resume_turns()  # a repeat or a next turn: turn points would have paid
        point, _ = self.branches.add(r.request_id, r.prompt_ids)
        if point < self.index.min_tokens or (match is not None and match.num_tokens >= point):
            return
        key = hash(r.prompt_ids[:point])
        late = None if key in self._branching else self._late_parker(r, point, key)
        if late is not None:
            self._ask_late(key, point, *late)

    def _ask_late(self, key: int, point: int, parker: str, worker: int) -> None:
        """Ask `parker` (on `worker`) for the point its prefill passed, in that worker's next
        plan; whoever needs it waits for that worker's reply (`_sweep_branching`)."""
        self._ask(key, point, parker, worker)
        self._late[key] = (worker, False)
        self._late_tried[key] = None
        while len(self._late_tried) > LATE_TRIED:
            del self._late_tried[next(iter(self._late_tried))]

    def _ask(self, key: int, point: int, parker: str, worker: int) -> None:
        """Have `parker` park its state after `point` tokens (the prefix keyed `key`) in
        `worker`'s next plan (`StepPlan.park_at`); other requests sharing it wait for it."""
        self._park_at.setdefault(worker, []).append((parker, point))
        self._branching[key] = (parker, point)

    def _late_parker(self, r: Request, point: int, key: int) -> tuple[str, int] | None:
        """(the request, its worker) to ask for `r`'s branch point that the first prompt
        passing it has prefilled past already (from the scan states its worker keeps), or None:
        late asks off, asked late before, or that request is not running on a worker."""
        if not self.late_calls or key in self._late_tried:
            return None
        first = self.table.requests.get(self.branches.first(r.prompt_ids, point) or "")
        if first is None or first is r or first.state is not State.RUNNING or first.worker is None:
            return None
        return first.request_id, first.worker

    def _branch_producer(self, r: Request, match: Match | None) -> int | None:
        """The worker parking the state at `r`'s branch point for another request, if any."""
        if self.branches is None or r.num_generated or not self._branching:
            return None
        point, _ = self.branches.find(r.prompt_ids, r.request_id)
        if point < self.index.min_tokens or (match is not None and match.num_tokens >= point):
            return None
        asked = self._branching.get(hash(r.prompt_ids[:point]))
        if asked is None or asked[0] == r.request_id:
            return None
        parker = self.table.requests.get(asked[0])
        return parker.worker if parker is not None and parker.worker is not None else None

    def _sweep_branching(self, replied: int | None = None) -> None:
        """Forget branch points whose parker's prefill is over (parked, or it never will be);
        a late ask once the worker `replied` to the plan that carried it, or its parker no
        longer runs there (ended, retracted, moved, its worker lost)."""
        for key, (rid, _) in list(self._branching.items()):
            r = self.table.requests.get(rid)
            late = self._late.get(key)
            if r is None or r.state.is_done or r.state is State.RETRACTED:
                over = True
            elif late is None:
                over = bool(r.num_generated)
            else:
                over = r.state is not State.RUNNING or r.worker != late[0] or late == (replied, True)
            if over:
                del self._branching[key]
                self._late.pop(key, None)

    # ------------------------------------------------------------------ producers
    def _block_keys(self, prompt: tuple[int, ...]) -> list[int]:
        """One key per whole block of `prompt`: key k stands for prompt[:(k + 1) * B], a hash
        chained over the blocks (O(prompt) for all of them, not a slice and a hash per prefix).
        A collision only makes a request wait for a producer it does not share blocks with."""
        b, keys, h = self.index.block_tokens, [], 0
        for start in range(0, len(prompt) - b + 1, b) if b else ():
            h = hash((h, prompt[start:start + b]))
            keys.append(h)
        return keys

    def _block_prefixes(self, prompt: tuple[int, ...], after: int) -> set[int]:
        """The keys of the whole blocks of `prompt` past its first `after` tokens."""
        if not self.index.block_tokens or len(prompt) < self.index.min_tokens:
            return set()
        return set(self._block_keys(prompt)[after // self.index.block_tokens:])

    def _add_producer(self, r: Request, worker: int, restored: int) -> None:
        keys = self._block_prefixes(r.prompt_ids, restored)
        if keys:
            self._producers[r.request_id] = (r, worker, keys)
            for k in keys:
                self._inflight[k] = self._inflight.get(k, 0) + 1

    def _drop_producer(self, rid: str) -> None:
        _, _, keys = self._producers.pop(rid)
        for k in keys:
            self._inflight[k] -= 1
            if not self._inflight[k]:
                del self._inflight[k]

    def _producer_of(self, r: Request, parked: int) -> int | None:
        """The worker of a live producer of a whole block of `r`'s prompt past `parked` tokens."""
        b = self.index.block_tokens
        if not b or not self._inflight:
            return None
        chain = self._block_keys(r.prompt_ids)
        for k in range(len(r.prompt_ids) // b, parked // b, -1):
            if k * b >= len(r.prompt_ids) or not self._inflight.get(chain[k - 1]):
                continue
            self._sweep_producers()
            for p, worker, keys in self._producers.values():
                if chain[k - 1] in keys and p is not r:
                    return worker
        return None

    def _sweep_producers(self) -> None:
        """Forget producers that finished their prefill (or ended, or were retracted)."""
        for rid, (p, _, _) in list(self._producers.items()):
            if p.state.is_done or p.state is State.RETRACTED or p.num_generated:
                self._drop_producer(rid)

    # ------------------------------------------------------------------ results
    def on_result(self, w: WorkerSlot, decision: Decision, result: StepResult) -> None:
        """Count hits (by source) and misses of the admitted requests, forget points that could
        not be used, and take over the points this call parked."""
        if self.index is None:
            return
        for r in decision.admit:
            match = self._match_of.pop(r.request_id, None)
            if r.request_id in result.not_admitted:
                if r.request_id in self._producers:
                    self._drop_producer(r.request_id)
                continue  # looked up again when it is admitted
            r.cached_tokens = result.cached.get(r.request_id, 0)
            r.cache_kind = match.kind if match is not None and r.cached_tokens else None
            r.cache_source = _source(match, w) if r.cache_kind else None
            self.counters.on_cache_lookup(r.cached_tokens, r.cache_kind, r.cache_source)
            if r.request_id in result.prefix_failed and match is not None:
                log.warning("parked state for %s not used on worker %d (%s); prefilled in full",
                            r.request_id, w.index, result.prefix_failed[r.request_id])
                self.index.discard(match)
                self.counters.state_cache_fallbacks += 1
        if result.parked:
            self.take(w, result.parked)
        self._sweep_producers()
        self._sweep_branching(replied=w.index)

    def forget_lookups(self, admitted: list[Request]) -> None:
        """The call failed: these are looked up again when admitted again."""
        ids = {r.request_id for r in admitted}
        for r in admitted:
            self._match_of.pop(r.request_id, None)
            if r.request_id in self._producers:
                self._drop_producer(r.request_id)
        for key, (rid, _) in list(self._branching.items()):
            if rid in ids:
                del self._branching[key]
                self._late.pop(key, None)

    def take(self, w: WorkerSlot, parked: list[ParkedPoint]) -> None:
        """Keep the points the index wants (with the blocks it lacks): `Worker.take_parked` hands
        them over as return values, so the scheduler owns them, they stay in the worker node's
        store, and outlive the worker process. The worker drops every other copy."""
        place, handle = Place(w.info.node_id, w.index), w.handle
        keep: list[tuple[ParkedPoint, tuple[int, ...]]] = []
        wanted: list[tuple] = []
        for p in parked:
            req = self.table.requests.get(p.request_id)
            if req is None or req.state is not State.RUNNING or req.num_tokens <= p.num_tokens:
                continue
            tokens = req.token_ids[:p.num_tokens]
            missing = self._missing_blocks(tokens, p)
            if missing is None or not self.index.wants(p.num_tokens, p.kind):
                continue
            keep.append((p, tokens))
            wanted += [p.key] + [p.block_key(i) for i in missing]
        refs = handle.take_parked.options(num_returns=len(wanted)).remote(wanted) if wanted else []
        refs = {k: ref for k, ref in zip(wanted, [refs] if len(wanted) == 1 else refs)}
        for p, tokens in keep:
            blocks = {i: BlockRef(refs[p.block_key(i)], size, place) for i, size in p.blocks
                      if p.block_key(i) in refs}
            self.index.park(tokens, refs[p.key], p.nbytes, p.kind, p.kv_from, p.exact, blocks, place)
        unwanted = [k for p in parked for k in [p.key] + [p.block_key(i) for i, _ in p.blocks] if k not in refs]
        if unwanted:
            handle.discard_parked.remote(unwanted)

    def _missing_blocks(self, tokens: tuple[int, ...], p: ParkedPoint) -> list[int] | None:
        """Indices of the point's blocks the index lacks (all offered by it), or None when one
        is lacking and not offered (the point cannot be kept)."""
        b = self.index.block_tokens
        count = p.kv_from // b if b else 0
        have = min(self.index.parked_blocks(tokens), count)
        offered = {i for i, _ in p.blocks}
        missing = list(range(have, count))
        return missing if all(i in offered for i in missing) else None

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        i = self.index if self.index is not None else StateCache(0, 1)  # off: every count 0 (an empty
        #   index is falsy, `StateCache.__len__`: it still reports its budget)
        by_kind = {f"state_cache_bytes_{kind}": n for kind, n in i.kind_bytes.items()}
        return {"state_cache_bytes": i.bytes, **by_kind,
                "state_cache_bytes_blocks": i.bytes - sum(i.kind_bytes.values()), "state_cache_entries": i.num_points,
                "state_cache_points": i.num_points, "state_cache_chunks": i.num_blocks,
                "state_cache_evictions": i.evictions, "state_cache_budget_bytes": i.budget_bytes,
                "state_cache_inline_bytes": i.inline_bytes, "state_cache_turn_pauses": i.turn_pauses,
                "state_cache_turn_points_dropped": i.turn_points_dropped,
                "state_cache_turns_paused": int(i.turns_paused)}

    def use_grid(self, grids: list[int]) -> None:
        """Branch points on the grid the workers share (the least common multiple of their
        `WorkerInfo.prefix_grid`) from now on: prompts remembered on another grid are forgotten."""
        grid = math.lcm(*grids) if grids else GRID_TOKENS
        if self.branches is not None and grid != self.branches.grid:
            self.branches = BranchPoints(grid, self.branches.capacity)

    def clear(self) -> None:
        if self.index is not None:
            self.index.clear()
        self._match_of.clear()
        self._producers.clear()
        self._inflight.clear()
        self._park_at.clear()
        self._branching.clear()
        self._late.clear()
        self._late_tried.clear()
        if self.branches is not None:
            self.branches = BranchPoints(self.branches.grid, self.branches.capacity)


def _head(waiting: deque[Request]) -> list[Request]:
    return [r for _, r in zip(range(LOOKAHEAD), waiting)]


def _source(match: Match | None, w: WorkerSlot) -> str | None:
    """Where a restored point came from, seen from the worker that restored it."""
    if match is None:
        return None
    place = match.point.place
    if place.worker == w.index:
        return "same_worker"
    return "same_node" if place.node == w.info.node_id else "other_node"

