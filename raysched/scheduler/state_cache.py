"""The prefix index: restorable points parked in the object store, K/V stored once per block.

A *point* is a state a new request can start from: the recurrent state (conv + SSM of every
Mamba layer, ...) after some prefix of tokens, plus the K/V of that prefix. Points are parked
- at every prefill chunk boundary of a prompt (`kind="chunk"`; multiples of the block size from
  token 0, where the state is exactly that of an uncached chunked prefill),
- at the end of a prompt (`"prompt"`) and when a request finishes (`"finished"`), at any length.

K/V is parked per *block* (`block_tokens` tokens, the prefill chunk), once, and shared by every
point whose prefix contains it: a point holds only its own recurrent state and its *tail*, the
K/V of its tokens after its last parked block. Blocks sit in a radix tree whose edges are whole
token blocks (a child is found by the exact tuple of its block's tokens), so a lookup walks one
node per block of the prompt: its cost grows with the prompt's length, never with the number of
points kept. Each node keeps its points in a dict keyed by their tail tokens.

Eviction is by hits and age (a segmented LRU): points no lookup has matched since they were
parked (or since they were demoted) go first, oldest first; points a request matched are kept
until none of the others is left, or until they hold more than `protected_fraction` of the
budget, when the least recently used of them is demoted (it joins the others as their newest).
A burst of prompts nobody shares (each parks points) cannot push out the ones being shared; a
block goes when no kept point uses it.

Prompt and finished points (*turn points*) are parked before anyone asks for them, a bet that a
repeat or a chat's next turn comes. With `turn_window` W, the index keeps the bet only while it
pays: when the last W turn points parked got no hit among them, it *pauses* (`turns_pay` is
False, so plans ask for none) and drops the turn points without hits; `resume_turns` (the
scheduler saw a prompt that contains an earlier prompt whole: a repeat or a next turn) starts a
new window. Parked
bytes (blocks + points) stay within `budget_bytes`; objects under `inline_limit` (Ray returns
results that small into the caller's memory, so they live in the scheduler's process) also
within `inline_budget_bytes`.

Pure bookkeeping (no Ray, no torch): the refs are opaque values here.

    index = StateCache(budget_bytes=1 << 30, min_tokens=64, block_tokens=512)
    index.park(prompt[:1024], point_ref, 4096, "chunk", kv_from=1024, exact=True,
               blocks={0: BlockRef(ref0, 65536), 1: BlockRef(ref1, 65536)})
    hit = index.lookup(prompt)          # -> Match: 1024 tokens, refs [ref0, ref1, point_ref]
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from raysched.messages import GRID_TOKENS  # branch points lie on this grid until the workers say
#   theirs (`WorkerInfo.prefix_grid`: a multiple of every position-dependent blocking of their
#   prefill, 32 for every preset on the CPU, the model's scan chunk on a GPU; `PrefixCache.use_grid`)

PROTECTED_FRACTION = 0.8  # of the budget, at most, for points that lookups matched (see the module doc)
KINDS = ("chunk", "prompt", "finished")  # a prefill chunk boundary, a prompt's end, a finished turn
TURN_KINDS = ("prompt", "finished")  # parked on a bet (a repeat, a next turn), not because two prompts share it


@dataclass(frozen=True)
class Place:
    """Where a parked object lies: the node's store and the worker that made it."""

    node: str | None = None
    worker: int | None = None


@dataclass(frozen=True)
class BlockRef:
    """A parked K/V block offered with a point: its object ref, size and place."""

    ref: Any
    nbytes: int
    place: Place = Place()


@dataclass
class Point:
    """One restorable point: `num_tokens` tokens covered, its blocks up to `kv_from`, its own
    object (recurrent state + tail K/V) and where it lies."""

    num_tokens: int
    kv_from: int  # tokens covered by its blocks (a multiple of the block size)
    ref: Any
    nbytes: int
    kind: str  # one of KINDS
    exact: bool  # the state of an uncached chunked prefill at a chunk boundary
    place: Place
    node: "_Node" = field(repr=False, default=None)  # deepest block node (the root if no blocks)
    tail: tuple[int, ...] = ()
    key: int = 0
    hits: int = 0  # lookups that matched it since it was parked or demoted (0: evicted first)


@dataclass(frozen=True)
class Match:
    """A lookup's answer: the point and the blocks before it, in token order."""

    point: Point
    blocks: tuple[BlockRef, ...]

    @property
    def num_tokens(self) -> int:
        return self.point.num_tokens

    @property
    def kind(self) -> str:
        return self.point.kind

    @property
    def refs(self) -> list[Any]:
        """The objects a worker reads to restore it: the blocks in order, then the point."""
        return [b.ref for b in self.blocks] + [self.point.ref]

    @property
    def nbytes(self) -> int:
        return self.point.nbytes + sum(b.nbytes for b in self.blocks)


class _Node:
    """A tree node: one block of tokens under its parent. The root has no block."""

    __slots__ = ("parent", "key", "depth", "block", "children", "points", "tail_lengths", "users")

    def __init__(self, parent: "_Node | None", key: tuple[int, ...], block: BlockRef | None) -> None:
        self.parent, self.key, self.block = parent, key, block
        self.depth = 0 if parent is None else parent.depth + 1  # blocks from the root, itself included
        self.children: dict[tuple[int, ...], _Node] = {}
        self.points: dict[tuple[int, ...], Point] = {}  # tail tokens -> point
        self.tail_lengths: dict[int, int] = {}  # tail length -> points with it (longest tried first)
        self.users = 0  # points at or under this node (they all need its block)

    def chain(self) -> list["_Node"]:
        """This node and its ancestors with blocks, root first."""
        nodes, n = [], self
        while n.parent is not None:
            nodes.append(n)
            n = n.parent
        return nodes[::-1]


class StateCache:
    """Points and blocks in a radix tree of token blocks, evicted by hits and age (see the
    module doc), bounded in bytes."""

    def __init__(self, budget_bytes: int, min_tokens: int, inline_budget_bytes: int | None = None,
                 inline_limit: int = 100 * 1024, block_tokens: int = 0,
                 protected_fraction: float = PROTECTED_FRACTION, turn_window: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
        self.block_tokens = block_tokens  # 0: no blocks, every point holds all of its K/V
        self.inline_budget_bytes = budget_bytes if inline_budget_bytes is None else inline_budget_bytes
        self.inline_limit = inline_limit
        self.root = _Node(None, (), None)
        self._points: OrderedDict[int, Point] = OrderedDict()  # oldest use first
        self._unhit: OrderedDict[int, Point] = OrderedDict()  # the points without hits, first to go
        self.protected_fraction = protected_fraction
        self.protected_bytes = 0  # bytes of the points with hits
        self._keys = itertools.count()
        self.bytes = self.inline_bytes = 0
        self.kind_bytes = dict.fromkeys(KINDS, 0)  # the points' own objects by kind (blocks: the rest)
        self.num_blocks = 0
        self.evictions = 0
        self.superseded = 0  # unmatched chunk points dropped for a deeper one on their path
        self.turn_window = turn_window  # 0: turn points always pay
        self._turn_bets: OrderedDict[int, bool] = OrderedDict()  # key of each of the last turn points
        #   parked -> matched since (at most `turn_window` of them, oldest first)
        self.turns_paused = False
        self.turn_pauses = 0  # times the index stopped parking turn points
        self.turn_points_dropped = 0  # turn points without hits dropped at a pause

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._points)

    @property
    def num_points(self) -> int:
        return len(self._points)

    def turns_pay(self) -> bool:
        """Should plans park turn points (prompt ends, finished turns)? (see the module doc)"""
        return not self.turns_paused

    def resume_turns(self) -> None:
        """Evidence that turn points would pay (a prompt containing an earlier one whole came):
        park them again, with a new window."""
        if self.turns_paused:
            self.turns_paused = False
            self._turn_bets.clear()

    def wants(self, num_tokens: int, kind: str = "chunk") -> bool:
        """Is a point of `kind` covering `num_tokens` tokens worth parking? (A turn point is not
        while turn points are paused: one a plan sent before the pause asked for.)"""
        return (num_tokens >= self.min_tokens and self.budget_bytes > 0
                and not (self.turns_paused and kind in TURN_KINDS))

    def lookup(self, prompt: tuple[int, ...], touch: bool = True) -> Match | None:
        """The point with the most tokens that `prompt` starts with and extends by at least one
        token (that token, at least, is prefilled); marks it recently used unless `touch` is
        False. None on a miss. Cost: one dict probe per block of `prompt`, plus the node's
        distinct tail lengths; independent of how many points are kept."""
        best: Point | None = None
        for node in self._path(prompt):
            found = self._longest_tail(node, prompt)
            if found is not None and (best is None or found.num_tokens > best.num_tokens):
                best = found
        if best is None:
            return None
        if touch:
            self._points.move_to_end(best.key)
            self._hit(best)
        return Match(best, tuple(n.block for n in best.node.chain()))

    def _supersede(self, p: Point) -> None:
        """`p`, an exact chunk point, is matched for the first time: traffic passes through it,
        so the shallower chunk points on its path that nothing matched yet go (only a prompt
        leaving `p`'s prefix before `p` could use them; a branch point is parked for such a
        prompt when it comes). Its blocks stay: `p` uses them."""
        chain, b = p.node.chain(), self.block_tokens
        tokens = tuple(t for n in chain for t in n.key) + p.tail
        for n in [self.root, *chain]:
            start = n.depth * b
            for q in [q for q in n.points.values() if q is not p and not q.hits and q.kind == "chunk"
                      and q.num_tokens < p.num_tokens and tokens[start:start + len(q.tail)] == q.tail]:
                self._remove_point(q)
                self.superseded += 1

    def parked_blocks(self, prompt: tuple[int, ...]) -> int:
        """How many leading whole blocks of `prompt` are parked already."""
        return len(self._path(prompt)) - 1

    def _path(self, prompt: tuple[int, ...]) -> list[_Node]:
        """The root and the nodes of `prompt`'s whole blocks that are in the tree, in order."""
        nodes, node, b = [self.root], self.root, self.block_tokens
        while b and (node.depth + 1) * b <= len(prompt):
            node = node.children.get(prompt[node.depth * b:(node.depth + 1) * b])
            if node is None:
                break
            nodes.append(node)
        return nodes

    def _longest_tail(self, node: _Node, prompt: tuple[int, ...]) -> Point | None:
        start = node.depth * self.block_tokens
        for length in sorted(node.tail_lengths, reverse=True):
            if start + length < len(prompt):
                point = node.points.get(prompt[start:start + length])
                if point is not None:
                    return point
        return None

    # ------------------------------------------------------------------ parking
    def park(self, tokens: tuple[int, ...], ref: Any, nbytes: int, kind: str, kv_from: int = 0,
             exact: bool = False, blocks: dict[int, BlockRef] | None = None,
             place: Place = Place()) -> tuple[set[int], list[Any]]:
        """Park a point covering `tokens` whose own object holds the K/V of tokens[kv_from:]
        and the recurrent state; the K/V before `kv_from` comes from blocks 0 .. kv_from/B - 1.
        Blocks already parked are used as they are; `blocks` offers the ones that may be
        missing (block index -> BlockRef). A point with an equal key replaces the old one.

        Returns (indices of the offered blocks now kept, refs of the points it evicted or replaced;
        blocks nobody uses any more go with them). A point
        that is too short, too big, or misses a block is not parked (nothing is kept).
        """
        if kind not in KINDS:
            raise ValueError(f"unknown point kind {kind!r}; choose from {list(KINDS)}")
        b = self.block_tokens
        if kv_from and (not b or kv_from % b or kv_from > len(tokens)):
            raise ValueError(f"kv_from {kv_from} is not a block boundary within {len(tokens)} tokens")
        if not self.wants(len(tokens), kind) or nbytes > self._budget_for(nbytes):
            return set(), []
        node, used = self._attach_blocks(tokens, kv_from // b if b else 0, blocks or {})
        if node is None:
            return set(), []
        tail = tuple(tokens[kv_from:])
        point = Point(len(tokens), kv_from, ref, nbytes, kind, exact, place, node, tail, next(self._keys))
        dropped = self._replace(node.points.get(tail), point)
        if kind in TURN_KINDS:
            dropped += self._bet_on(point)
        return used, dropped + self._evict()

    def _bet_on(self, p: Point) -> list[Any]:
        """Note turn point `p` parked; pause and drop the unmatched turn points when none of the
        last `turn_window` was matched. Returns the refs dropped."""
        if not self.turn_window:
            return []
        self._turn_bets[p.key] = bool(p.hits)
        while len(self._turn_bets) > self.turn_window:
            self._turn_bets.popitem(last=False)
        if len(self._turn_bets) < self.turn_window or any(self._turn_bets.values()):
            return []
        self.turns_paused = True
        self.turn_pauses += 1
        self._turn_bets.clear()
        unmatched = [q for q in self._unhit.values() if q.kind in TURN_KINDS]
        self.turn_points_dropped += len(unmatched)
        return [self._remove_point(q) for q in unmatched]

    def _attach_blocks(self, tokens: tuple[int, ...], count: int,
                       offered: dict[int, BlockRef]) -> tuple[_Node | None, set[int]]:
        """The node of block `count` - 1 of `tokens`, creating nodes for offered blocks that are
        missing; (None, {}) if one is missing and not offered (nothing changes then)."""
        b, node, path = self.block_tokens, self.root, []
        for i in range(count):
            key = tokens[i * b:(i + 1) * b]
            child = node.children.get(key)
            if child is None:
                if i not in offered:
                    for created in reversed(path):
                        self._remove_node(created)
                    return None, set()
                child = _Node(node, key, offered[i])
                node.children[key] = child
                self._count(offered[i].nbytes, +1)
                self.num_blocks += 1
                path.append(child)
            node = child
        return node, {n.depth - 1 for n in path}

    def _replace(self, old: Point | None, new: Point) -> list[Any]:
        """Put `new` in place of `old` (same node and tail; None: there is none); the blocks of
        the chain stay even when `old` was their only user. Returns the refs dropped."""
        chain = new.node.chain()
        for n in chain:
            n.users += 1
        dropped = [self._remove_point(old)] if old is not None else []
        new.hits = old.hits if old is not None else 0  # the same prefix: its standing carries over
        self._add_point(new)
        for n in chain:
            n.users -= 1
        return dropped

    def _add_point(self, p: Point) -> None:
        p.node.points[p.tail] = p
        p.node.tail_lengths[len(p.tail)] = p.node.tail_lengths.get(len(p.tail), 0) + 1
        for n in p.node.chain():
            n.users += 1
        self._points[p.key] = p
        if p.hits:
            self.protected_bytes += p.nbytes
        else:
            self._unhit[p.key] = p
        self._count(p.nbytes, +1)
        self.kind_bytes[p.kind] += p.nbytes

    def _hit(self, p: Point) -> None:
        if p.key in self._turn_bets:
            self._turn_bets[p.key] = True
        if not p.hits:
            del self._unhit[p.key]
            self.protected_bytes += p.nbytes
            if p.kind == "chunk" and p.exact:
                self._supersede(p)
        p.hits += 1

    def _remove_point(self, p: Point) -> Any:
        """Forget a point; blocks no other point uses go too (their refs are dropped here)."""
        del self._points[p.key]
        if p.hits:
            self.protected_bytes -= p.nbytes
        else:
            del self._unhit[p.key]
        del p.node.points[p.tail]
        lengths = p.node.tail_lengths
        lengths[len(p.tail)] -= 1
        if not lengths[len(p.tail)]:
            del lengths[len(p.tail)]
        self._count(p.nbytes, -1)
        self.kind_bytes[p.kind] -= p.nbytes
        for n in reversed(p.node.chain()):
            n.users -= 1
            if not n.users:
                self._remove_node(n)
        return p.ref

    def _remove_node(self, n: _Node) -> None:
        del n.parent.children[n.key]
        self._count(n.block.nbytes, -1)
        self.num_blocks -= 1

    def _evict(self) -> list[Any]:
        dropped = []
        while self._points and (self.bytes > self.budget_bytes or self.inline_bytes > self.inline_budget_bytes):
            self._demote_over_cap()
            dropped.append(self._remove_point(self._victim(over_inline=self.bytes <= self.budget_bytes)))
            self.evictions += 1
        return dropped

    def _victim(self, over_inline: bool) -> Point:
        """The point to evict: the oldest without hits, else the least recently used; only
        small (inline) ones when only the inline budget is exceeded."""
        fits = (lambda p: self._inline(p.nbytes)) if over_inline else (lambda p: True)
        for points in (self._unhit, self._points):
            found = next((p for p in points.values() if fits(p)), None)
            if found is not None:
                return found
        return next(iter(self._points.values()))

    def _demote_over_cap(self) -> None:
        """Points with hits holding more than `protected_fraction` of the budget: the least
        recently used of them lose their hits and join the points without as their newest (a
        second chance, as in a segmented LRU)."""
        cap = self.protected_fraction * self.budget_bytes
        for p in self._points.values():  # least recently used first
            if self.protected_bytes <= cap:
                return
            if p.hits:
                p.hits = 0
                self.protected_bytes -= p.nbytes
                self._unhit[p.key] = p

    def _inline(self, nbytes: int) -> bool:
        return nbytes < self.inline_limit

    def _budget_for(self, nbytes: int) -> int:
        return min(self.budget_bytes, self.inline_budget_bytes) if self._inline(nbytes) else self.budget_bytes

    def _count(self, nbytes: int, sign: int) -> None:
        self.bytes += sign * nbytes
        if self._inline(nbytes):
            self.inline_bytes += sign * nbytes

    # ------------------------------------------------------------------ forgetting
    def discard(self, match: Match) -> int:
        """Forget a match that could not be restored (an object lost or refused): its point and,
        when it has blocks, every point that shares its first block (those objects may be lost
        too). Returns the number of points forgotten."""
        if match.point.key not in self._points:
            return 0
        chain = match.point.node.chain()
        if not chain:
            self._remove_point(match.point)
            return 1
        doomed = [p for p in self._points.values() if chain[0] in p.node.chain()]
        for p in doomed:
            self._remove_point(p)
        return len(doomed)

    def clear(self) -> None:
        self.root = _Node(None, (), None)
        self._points.clear()
        self._unhit.clear()
        self.bytes = self.inline_bytes = self.num_blocks = self.protected_bytes = 0
        self.kind_bytes = dict.fromkeys(KINDS, 0)
        self._turn_bets.clear()
        self.turns_paused = False


class BranchPoints:
    """Where prompts diverge, on the scan-chunk grid: the points worth a parked state.

    A radix tree of the last `capacity` prompts, cut into `grid`-token blocks: each whole-block
    prefix is one dict key (a hash chained over the blocks: one probe per block, O(prompt) to
    key them all). A new prompt's *branch point* is its deepest block prefix an earlier prompt
    also has, capped to leave it at least one token to feed (a repeated prompt: all but its last
    block, or its last partial one). At least two prompts pass such a point, so a state parked
    there serves a second request; a point no two prompts share is never proposed. A hash
    collision only proposes a useless point (a restore checks the tokens). Waiting prompts are
    added as the scheduler looks at its queue (`PrefixCache.survey`), so the first of two
    prompts is asked for the point when it starts, and the second, still waiting, restores it.

        tree = BranchPoints(grid=32)
        tree.add("a", system + question_a)   # -> (0, None): nothing shared yet
        tree.add("b", system + question_b)   # -> (288, "a") for a 300-token system prompt
        tree.add("a", system + question_a)   # -> (288, "b"): "a" again (admitted after "b" came)
    """

    def __init__(self, grid: int = GRID_TOKENS, capacity: int = 4096) -> None:
        if grid < 1 or capacity < 1:
            raise ValueError(f"BranchPoints needs grid >= 1 and capacity >= 1, got {grid} and {capacity}")
        self.grid, self.capacity = grid, capacity
        self._owner: dict[int, tuple[str, int]] = {}  # block-prefix key -> (latest request, prompts)
        self._first: dict[int, str] = {}  # block-prefix key -> the first request remembered with it
        self._recent: deque[tuple[str, list[int]]] = deque()  # (request, its keys), oldest first
        self._ids: set[str] = set()
        self._ends: dict[int, int] = {}  # key of a remembered prompt's last whole block -> prompts

    def __len__(self) -> int:
        return len(self._recent)

    def keys(self, prompt: tuple[int, ...]) -> list[int]:
        """Key k stands for prompt[:(k + 1) * grid], for the whole blocks before its last token."""
        g, keys, h = self.grid, [], 0
        for start in range(0, (len(prompt) - 1) // g * g, g):
            h = hash((h, prompt[start:start + g]))
            keys.append(h)
        return keys

    def add(self, request_id: str, prompt: tuple[int, ...]) -> tuple[int, str | None]:
        """Remember `prompt`; (its branch point with the other prompts remembered, the latest
        other request that passes it, or itself when that one came earlier), or (0, None). A
        request added before (a waiting one, `knows`) is not added again."""
        keys = self.keys(prompt)
        found = self._deepest(keys, request_id)
        if request_id not in self._ids:
            self._remember(request_id, keys)
        return found

    def knows(self, request_id: str) -> bool:
        return request_id in self._ids

    def contains_earlier(self, prompt: tuple[int, ...]) -> bool:
        """Does `prompt` start with a whole remembered prompt (up to its last whole grid block
        before its last token)? A repeat or a chat's next turn: what a turn point serves. Ask
        before `add`ing it."""
        return any(k in self._ends for k in self.keys(prompt))

    def find(self, prompt: tuple[int, ...], request_id: str | None = None) -> tuple[int, str | None]:
        """`add`'s answer for `prompt` (whose own keys, if remembered as `request_id`, do not
        count), remembering nothing."""
        return self._deepest(self.keys(prompt), request_id)

    def first(self, prompt: tuple[int, ...], point: int) -> str | None:
        """The first request remembered whose prompt passes `prompt`'s first `point` tokens (a
        grid multiple): the likeliest to have prefilled past it already."""
        keys = self.keys(prompt[:point + 1])
        return self._first.get(keys[point // self.grid - 1]) if 0 < point <= len(keys) * self.grid else None

    def _deepest(self, keys: list[int], request_id: str | None) -> tuple[int, str | None]:
        def shared(key: int) -> bool:  # by another prompt than `request_id`'s own
            entry = self._owner.get(key)
            return entry is not None and (entry[1] > 1 or entry[0] != request_id)

        depth = next((k for k in range(len(keys), 0, -1) if shared(keys[k - 1])), 0)
        return (depth * self.grid, self._owner[keys[depth - 1]][0]) if depth else (0, None)

    def _remember(self, request_id: str, keys: list[int]) -> None:
        for k in keys:
            self._owner[k] = (request_id, self._owner.get(k, ("", 0))[1] + 1)
            self._first.setdefault(k, request_id)
        if keys:
            self._ends[keys[-1]] = self._ends.get(keys[-1], 0) + 1
        self._recent.append((request_id, keys))
        self._ids.add(request_id)
        while len(self._recent) > self.capacity:
            self._forget(*self._recent.popleft())

    def _forget(self, request_id: str, keys: list[int]) -> None:
        self._ids.discard(request_id)
        if keys:
            self._ends[keys[-1]] -= 1
            if not self._ends[keys[-1]]:
                del self._ends[keys[-1]]
        for k in keys:
            if self._first.get(k) == request_id:
                del self._first[k]
            owner, count = self._owner[k]
            if count == 1:
                del self._owner[k]
            else:
                self._owner[k] = (owner, count - 1)
