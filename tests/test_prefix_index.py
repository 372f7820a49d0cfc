"""The prefix index (`raysched.state_cache.StateCache`), pure: no Ray, no torch.

- Longest match over whole token blocks and point tails; the prompt must extend the point.
- K/V blocks are stored once and shared by every point that contains them; a point adds only
  its own state and tail; eviction is LRU among points no lookup matched, a block goes with its
  last user, and matched points outlive a burst of one-off prompts (negative control: plain LRU)
  up to their share of the budget, beyond which the least recently used is demoted.
- A point whose blocks are missing (and not offered) is not parked.
- Branch points (`BranchPoints`): where a prompt leaves an earlier one, rounded down to the grid
  (against a token-by-token reference); every point proposed is passed by two prompts (negative
  control: a point at every grid step of every prompt keeps many no other prompt passes).
- At 10k points a lookup probes as many nodes as the prompt has blocks, no more (the cost does
  not grow with the number of points); the timings are printed, not asserted.
"""

from __future__ import annotations

import random
import time

import pytest

from raysched.sampling import RequestError
from raysched.scheduler.state_cache import BlockRef, Place, StateCache

B = 4  # block tokens


def blocks_for(tokens: tuple[int, ...], count: int, nbytes: int = 100) -> dict[int, BlockRef]:
    return {i: BlockRef(f"blk{tokens[:(i + 1) * B]}", nbytes) for i in range(count)}


def park_boundaries(cache: StateCache, tokens: tuple[int, ...], state_bytes: int = 10) -> None:
    """Points at every block boundary of `tokens` (as a chunked prefill parks them)."""
    for k in range(1, len(tokens) // B + 1):
        cache.park(tokens[:k * B], f"pt{k}", state_bytes, "chunk", kv_from=k * B, exact=True,
                   blocks={k - 1: BlockRef(f"blk{k - 1}", 100)})


def test_the_longest_point_wins_at_a_block_boundary_or_at_any_length() -> None:
    cache = StateCache(budget_bytes=10_000, min_tokens=2, block_tokens=B)
    shared = tuple(range(12))
    park_boundaries(cache, shared)
    finished = shared + (50, 51, 52)  # a finished turn: blocks 0-2 + a 3-token tail
    cache.park(finished, "fin", 30, "finished", kv_from=12)
    hit = cache.lookup(shared + (50, 51, 52, 53))
    assert hit.point.ref == "fin" and hit.num_tokens == 15 and len(hit.blocks) == 3
    assert hit.refs == ["blk0", "blk1", "blk2", "fin"]
    assert cache.lookup(shared + (50, 51, 9), touch=False).point.ref == "pt3"  # the tail does not match: boundary 12
    assert cache.lookup(shared[:10] + (0, 0)).point.ref == "pt2"  # diverges inside block 2
    assert cache.lookup(shared).point.ref == "pt2"  # pt3 covers all of it: a token must be left
    assert cache.lookup(shared[:3] + (9,) * 9) is None
    assert cache.lookup((99,) + shared) is None


def test_a_first_hit_on_a_chunk_point_drops_the_unmatched_chunk_points_before_it() -> None:
    """Requests share a 12-token prefix; a chunked prefill parked points at 4, 8 and 12. The
    first match of the point at 12 drops those at 4 and 8 (nothing matched them, and only a
    prompt leaving the prefix before 12 could), so a shared prefix keeps one state where its
    prompts go on, not one per chunk. Its blocks stay. Controls: a point matched before stays;
    a point off the path stays; a matched finished turn (inexact) drops nothing."""
    cache = StateCache(budget_bytes=10_000, min_tokens=2, block_tokens=B)
    shared = tuple(range(12))
    park_boundaries(cache, shared)  # pt1 (4), pt2 (8), pt3 (12)
    other = shared[:8] + (70, 71, 72, 73)
    cache.park(other, "off", 10, "chunk", kv_from=12, exact=True, blocks={2: BlockRef("oblk2", 100)})
    assert cache.lookup(shared[:4] + (99,) * 5).point.ref == "pt1"  # pt1 matched once: it stays
    assert cache.lookup(shared + (1,)).point.ref == "pt3" and cache.superseded == 1
    assert sorted(p.ref for p in cache._points.values()) == ["off", "pt1", "pt3"]
    assert cache.num_blocks == 4 and cache.lookup(shared[:8] + (5,), touch=False).point.ref == "pt1"
    fin = StateCache(budget_bytes=10_000, min_tokens=2, block_tokens=B)
    park_boundaries(fin, shared)
    fin.park(shared + (50, 51), "fin", 30, "finished", kv_from=12)
    assert fin.lookup(shared + (50, 51, 52)).point.ref == "fin" and fin.num_points == 4


def test_kv_blocks_are_stored_once_for_every_point_that_shares_them() -> None:
    """A 4k prompt in 512-token blocks with 8 points: 8 blocks + 8 states, not 8 full copies;
    a second prompt sharing 3 blocks adds only its own blocks and points."""
    cache = StateCache(budget_bytes=1 << 40, min_tokens=1, block_tokens=512)
    kv, state = 512 * 2048, 1_655_808  # the `small` preset: K/V per block, recurrent state
    prompt = tuple(random.Random(0).randrange(8192) for _ in range(4096))
    for k in range(1, 9):
        cache.park(prompt[:k * 512], f"p{k}", state, "chunk", kv_from=k * 512, exact=True,
                   blocks={i: BlockRef(f"b{i}", kv) for i in range(k)})  # every block offered again
    assert cache.num_points == 8 and cache.num_blocks == 8
    assert cache.bytes == 8 * kv + 8 * state
    one_snapshot = 4096 * 2048 + state
    print(f"\n4k prompt, 8 points: {cache.bytes / one_snapshot:.2f}x one full snapshot "
          f"(K/V once: {8 * kv / (4096 * 2048):.2f}x its K/V)")
    other = prompt[:1536] + tuple(range(600))
    used, _ = cache.park(other[:2048], "q4", state, "chunk", kv_from=2048, exact=True,
                         blocks={i: BlockRef(f"c{i}", kv) for i in range(4)})
    assert used == {3} and cache.num_blocks == 9  # blocks 0-2 were parked already
    assert cache.lookup(other + (1,)).refs == ["b0", "b1", "b2", "c3", "q4"]


def test_eviction_is_lru_over_points_and_a_block_goes_with_its_last_user() -> None:
    cache = StateCache(budget_bytes=3 * 100 + 3 * 10, min_tokens=1, block_tokens=B)
    a = tuple(range(12))
    park_boundaries(cache, a)  # blocks 0-2, points 4, 8, 12: exactly the budget
    assert cache.bytes == 330 and cache.evictions == 0
    cache.lookup(a[:4] + (7,))  # pt1 (4 tokens) is now the most recently used
    _, dropped = cache.park(a[:4] + (9, 9, 9, 9, 9), "x", 10, "prompt", kv_from=4)
    # over budget by 10: the least recently used point (pt2) goes, but its blocks stay (pt3 uses them)
    assert dropped == ["pt2"] and cache.num_blocks == 3 and cache.evictions == 1
    _, dropped = cache.park((5,) * 8, "y", 10, "chunk", kv_from=8, exact=True,
                            blocks={0: BlockRef("y0", 100), 1: BlockRef("y1", 100)})
    # 210 more bytes: pt3 goes (LRU), and with it blocks 2 and 1 (no user left), not block 0
    assert dropped == ["pt3"] and cache.num_blocks == 3 and cache.bytes == 330
    assert cache.lookup(a + (1,)).point.ref == "pt1" and cache.lookup(a[:4] + (9,) * 6).point.ref == "x"
    assert cache.lookup((5,) * 9).point.ref == "y"
    assert cache.kind_bytes == {"chunk": 20, "prompt": 10, "finished": 0}  # pt1, y; x (blocks: the other 300)


def test_a_point_whose_blocks_are_missing_is_not_parked() -> None:
    cache = StateCache(budget_bytes=10_000, min_tokens=1, block_tokens=B)
    used, _ = cache.park(tuple(range(8)), "p", 10, "chunk", kv_from=8, blocks={0: BlockRef("b0", 100)})
    assert used == set() and cache.num_points == 0 and cache.num_blocks == 0 and cache.bytes == 0
    cache.park(tuple(range(5)), "short", 10, "prompt")  # no blocks: all of its K/V in its own object
    assert cache.lookup(tuple(range(6))).refs == ["short"]


def test_a_lost_match_is_discarded_with_every_point_sharing_its_blocks() -> None:
    cache = StateCache(budget_bytes=10_000, min_tokens=1, block_tokens=B)
    park_boundaries(cache, tuple(range(12)))
    cache.park((7,) * 5, "other", 10, "prompt")
    assert cache.discard(cache.lookup(tuple(range(13)), touch=False)) == 3
    assert cache.num_points == 1 and cache.num_blocks == 0 and cache.bytes == 10


def test_short_and_oversized_points_are_not_parked_and_an_equal_key_replaces_the_old_one() -> None:
    cache = StateCache(budget_bytes=100, min_tokens=4)
    assert cache.park((1, 2, 3), "short", 10, "prompt") == (set(), []) and len(cache) == 0
    cache.park((1, 2, 3, 4), "big", 101, "prompt")
    assert len(cache) == 0
    cache.park((1, 2, 3, 4), "old", 10, "prompt")
    assert cache.park((1, 2, 3, 4), "new", 20, "finished")[1] == ["old"]
    assert len(cache) == 1 and cache.bytes == 20 and cache.lookup((1, 2, 3, 4, 5)).point.ref == "new"
    assert cache.lookup((1, 2, 3, 4, 6)).point.ref == "new"  # a used point stays: two forks both hit


def test_small_objects_that_live_in_the_scheduler_have_their_own_budget() -> None:
    cache = StateCache(budget_bytes=1000, min_tokens=1, inline_budget_bytes=25, inline_limit=50)
    cache.park((1,), "big-old", 60, "finished")  # object store: counts against budget_bytes only
    dropped = [d for i in range(2, 5) for d in cache.park((i,), f"small{i}", 10, "finished")[1]]
    dropped += cache.park((9,), "small9", 10, "prompt")[1]
    assert dropped == ["small2", "small3"]  # the oldest small ones; big-old, older still, stays
    assert cache.inline_bytes == 20 and cache.bytes == 80
    assert cache.park((8,), "too-big-inline", 30, "prompt") == (set(), [])
    uncapped = StateCache(budget_bytes=1000, min_tokens=1, inline_limit=50)  # negative control
    for i in range(2, 6):
        uncapped.park((i,), f"small{i}", 10, "finished")
    assert uncapped.inline_bytes == 40 and len(uncapped) == 4


class CountingCache(StateCache):
    """Counts a lookup's work: each node on the prompt's path, and each tail length a node may try."""
    probes = 0

    def _path(self, prompt):
        path = super()._path(prompt)
        CountingCache.probes += len(path)
        return path

    def _longest_tail(self, node, prompt):
        CountingCache.probes += len(node.tail_lengths)
        return super()._longest_tail(node, prompt)


def _fill(cache: StateCache, num_prompts: int, rng: random.Random) -> list[tuple[int, ...]]:
    """`num_prompts` prompts of 4-16 blocks in 64 families (a shared first block), each with a
    point at every boundary and a prompt-end point."""
    prompts = []
    for i in range(num_prompts):
        family = (i % 64,) * 64
        tail = tuple(rng.randrange(8192) for _ in range(64 * rng.randrange(3, 15) + rng.randrange(1, 60)))
        p = family + tail
        for k in range(1, len(p) // 64 + 1):
            cache.park(p[:k * 64], ("pt", i, k), 10, "chunk", kv_from=k * 64, exact=True,
                       blocks={k - 1: BlockRef(("b", i, k), 100)})
        cache.park(p, ("end", i), 10, "prompt", kv_from=len(p) // 64 * 64)
        prompts.append(p)
    return prompts


def test_a_lookup_costs_the_same_at_10k_points_as_at_a_hundred() -> None:
    """The same 10 queries against a cache of 10 prompts (~100 points) and one holding those 10
    prompts and 1,090 more (over 10,000 points, many in the same families): each query does the
    same work in both (nodes on its path, plus every tail length those nodes may try) and finds
    a point of the same length, so the cost does not grow with the points kept. The reference: the small
    cache. Control: the big cache really holds more at the nodes the queries share (the family
    blocks have more children), so a scan of a node's children or points would count more."""
    queries, work, found, caches = None, {}, {}, {}
    for num_prompts in (10, 1100):
        cache = caches[num_prompts] = CountingCache(budget_bytes=1 << 40, min_tokens=1, block_tokens=64)
        prompts = _fill(cache, num_prompts, random.Random(1))  # the first 10 prompts are the same
        if queries is None:
            rng = random.Random(2)
            queries = [p[:rng.randrange(64, len(p))] + (1, 2, 3) for p in prompts]
        work[num_prompts], found[num_prompts] = [], []
        t0 = time.perf_counter()
        for q in queries:
            CountingCache.probes = 0
            hit = cache.lookup(q)
            work[num_prompts].append(CountingCache.probes)
            found[num_prompts].append(hit.num_tokens)  # (a shared block's point is the last parker's)
            assert hit.num_tokens >= (len(q) - 3) // 64 * 64  # the last whole block inside q, at least
        print(f"\n{cache.num_points} points: {(time.perf_counter() - t0) / len(queries) * 1e6:.0f} us a lookup")
    assert caches[1100].num_points >= 10_000 and caches[10].num_points < 200
    assert work[1100] == work[10] and found[1100] == found[10]
    family = (0,) * 64
    assert len(caches[1100].root.children[family].children) > len(caches[10].root.children[family].children)


def test_a_point_parked_again_on_blocks_only_it_uses_keeps_its_blocks() -> None:
    """Parking the same tokens again (a repeated greedy prompt's point) replaces the old point;
    when the old one was its blocks' only user, the blocks must stay for the new one: before,
    they went with the old point, the new one hung on a detached node (never found again), and
    its eviction raised KeyError inside the scheduler's dispatch loop. Control: with a second
    user of the blocks, they stayed even then."""
    for other_user in (False, True):
        cache = StateCache(budget_bytes=10_000, min_tokens=1, block_tokens=B)
        tokens = tuple(range(8)) + (40, 41)
        if other_user:
            cache.park(tokens[:8] + (90,), "fork", 10, "finished", kv_from=8, blocks=blocks_for(tokens, 2))
        cache.park(tokens, "old", 10, "finished", kv_from=8, blocks=blocks_for(tokens, 2))
        assert cache.park(tokens, "new", 20, "finished", kv_from=8)[1] == ["old"]  # blocks kept: none offered
        hit = cache.lookup(tokens + (42,))
        assert hit is not None and hit.point.ref == "new" and len(hit.blocks) == 2
        assert cache.num_blocks == 2 and cache.bytes == 200 + 20 + (10 if other_user else 0)
        assert cache.discard(hit) == 1 + other_user  # forgetting it now must not raise
        assert cache.num_blocks == 0 and cache.bytes == 0


# ---------------------------------------------------------------------------- branch points


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def brute_branch_point(prompt: tuple[int, ...], earlier: list[tuple[int, ...]], grid: int) -> int:
    """The reference: the longest prefix shared with any earlier prompt, both of them still
    feeding a token after it, rounded down to the grid (token by token, no hashing)."""
    best = max((min(common_prefix(prompt, e), len(prompt) - 1, len(e) - 1) for e in earlier), default=0)
    return best // grid * grid


def chat_like_prompts(seed: int, count: int = 60) -> list[tuple[int, ...]]:
    """Groups sharing system prompts of various lengths, some repeated prompts, some unique."""
    rng = random.Random(seed)
    tok = lambda n: tuple(rng.randrange(50) for _ in range(n))  # noqa: E731
    systems = [tok(n) for n in (30, 64, 130, 300, 700)]
    prompts = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.15 and prompts:
            prompts.append(rng.choice(prompts))  # sent again
        elif kind < 0.8:
            prompts.append(rng.choice(systems) + tok(rng.randint(1, 90)))
        else:
            prompts.append(tok(rng.randint(1, 400)))
    return prompts


def test_a_branch_point_is_where_a_prompt_leaves_an_earlier_one_rounded_down_to_the_grid() -> None:
    from raysched.scheduler.state_cache import BranchPoints

    for seed in range(3):
        tree, prompts = BranchPoints(grid=16), chat_like_prompts(seed)
        for i, p in enumerate(prompts):
            point, owner = tree.add(f"r{i}", p)
            assert point == brute_branch_point(p, prompts[:i], 16), (seed, i)
            if point:  # the owner passes the point too: it can park it
                o = prompts[int(owner[1:])]
                assert o[:point] == p[:point] and len(o) > point


def test_the_branch_policy_keeps_no_point_that_no_second_request_shares() -> None:
    """Every point it proposes is passed by two prompts; a repeated prompt gets all but its last
    block. Negative control: parking at every grid point of every prompt (the naive policy) keeps
    points no other prompt passes."""
    from raysched.scheduler.state_cache import BranchPoints

    grid, prompts = 16, chat_like_prompts(seed=7)
    tree, proposed = BranchPoints(grid=grid), set()
    for i, p in enumerate(prompts):
        point, _ = tree.add(f"r{i}", p)
        if point:
            proposed.add(p[:point])
    passes = lambda prefix: sum(p[:len(prefix)] == prefix and len(p) > len(prefix) for p in prompts)  # noqa: E731
    assert proposed and all(passes(x) >= 2 for x in proposed)
    naive = {p[:k] for p in prompts for k in range(grid, len(p), grid)}
    assert sum(passes(x) < 2 for x in naive) > 0  # the control: most of those serve nobody
    repeated = tuple(range(100))
    tree = BranchPoints(grid=grid)
    assert tree.add("a", repeated) == (0, None)
    assert tree.add("b", repeated) == (96, "a")  # 100 tokens: 96 restored, the last 4 fed
    assert tree.add("c", repeated[:96]) == (80, "b")  # a grid-long prompt feeds its last block


def test_branch_points_forget_the_oldest_prompts_beyond_capacity_and_refuse_a_bad_grid() -> None:
    from raysched.scheduler.state_cache import BranchPoints

    tree = BranchPoints(grid=4, capacity=2)
    a, b, c = tuple(range(20)), tuple(range(100, 120)), tuple(range(200, 220))
    for rid, p in (("a", a), ("b", b), ("c", c)):
        tree.add(rid, p)
    assert len(tree) == 2 and tree.add("d", a) == (0, None)  # "a" was forgotten
    assert tree.add("e", c) == (16, "c")
    with pytest.raises(ValueError, match="grid >= 1"):
        BranchPoints(grid=0)


def test_admission_asks_for_a_state_at_the_branch_point_from_the_request_that_passes_it_first() -> None:
    """Two prompts sharing a 100-token system text start in one plan: the first is asked to park
    the grid point 96 (`park_at`, on the default 32-token grid), the second waits for it (held back while the first prefills)
    and hits it once parked. A repeated prompt admitted alone parks its own last grid point.
    Negative control: with branch points off nothing is asked and nobody waits."""
    from raysched.config import ServeConfig
    from raysched.scheduler.prefix_cache import PrefixCache
    from tests.test_scheduler_parts import LIMITS, FakeWorker, parts

    def setup(on: bool):
        p = parts(ServeConfig(), [FakeWorker(0, kv=1024)])
        index = StateCache(budget_bytes=1 << 20, min_tokens=16, block_tokens=512)
        p["dispatch"].cache = PrefixCache(index, p["table"], p["counters"], branch_points=on)
        system = [t % 60 + 1 for t in range(100)]
        a, b = (p["table"].submit(system + [70 + i] * 20, {"max_new_tokens": 2}, LIMITS) for i in range(2))
        return p, index, system, a, b

    p, index, system, a, b = setup(True)
    glue, w = p["dispatch"].cache, p["fleet"].slots[0]
    hits, back = glue.admit([a, b], w.index)
    assert (hits, back, glue.park_at(w.index), glue.park_at(w.index)) == ([], [b], ((a.request_id, 96),), ())
    p["table"].waiting.remove(a)
    p["dispatch"].mark_running(w, [a])
    held, _ = glue.survey(p["table"].waiting, {0: 1.0})
    assert b.request_id in held  # waits for a's point instead of computing it again
    index.park(tuple(system[:96]), "pt96", 10, "chunk", exact=True)
    hits, back = glue.admit([b], w.index)
    assert [(r, m.num_tokens) for r, m in hits] == [(b, 96)] and back == [] and glue.park_at(w.index) == ()
    first, again = (p["table"].submit([t % 50 + 3 for t in range(200)], {"max_new_tokens": 2}, LIMITS)
                    for _ in range(2))
    glue.admit([first], w.index)
    assert glue.park_at(w.index) == ()  # a prompt seen once: no point asked for
    glue.admit([again], w.index)
    assert glue.park_at(w.index) == ((again.request_id, 192),)  # 200 tokens: its last grid point
    p, _, _, a, b = setup(False)
    glue = p["dispatch"].cache
    assert glue.admit([a, b], 0) == ([], []) and glue.park_at(0) == ()


@pytest.mark.parametrize("declared", [100, 0], ids=["shared-prefix", "control-none-declared"])
def test_a_declared_shared_prefix_is_parked_by_the_first_request_alone(declared: int) -> None:
    """A chat whose client declares its 100-token system message shared (`shared_prefix`,
    set by the HTTP chat endpoint) is asked to park the grid point 96 although no other prompt
    shares it yet, so the next chat with that system message hits even after this one ended;
    a second one admitted while the first prefills waits for that point; once it is parked
    nobody is asked again. Control: without the declaration nothing is asked (a prompt seen
    once has no branch point)."""
    from raysched.config import ServeConfig
    from raysched.scheduler.prefix_cache import PrefixCache
    from tests.test_scheduler_parts import LIMITS, FakeWorker, parts

    p = parts(ServeConfig(), [FakeWorker(0, kv=1024)])
    index = StateCache(budget_bytes=1 << 20, min_tokens=16, block_tokens=512)
    glue, w = PrefixCache(index, p["table"], p["counters"], branch_points=True), p["fleet"].slots[0]
    p["dispatch"].cache = glue
    system = [t % 60 + 1 for t in range(100)]
    a, b, c = (p["table"].submit(system + [70 + i] * 20, {"max_new_tokens": 2}, LIMITS, shared_prefix=declared)
               for i in range(3))
    for bad in (4, -1, True, 2.0):
        with pytest.raises(RequestError, match=r"shared_prefix must be an integer in \[0, 3\]"):
            p["table"].submit([1, 2, 3], {"max_new_tokens": 2}, LIMITS, shared_prefix=bad)
    assert glue.admit([a], w.index) == ([], [])
    if not declared:
        assert glue.park_at(w.index) == ()
        return
    assert glue.park_at(w.index) == ((a.request_id, 96),)
    p["table"].waiting.remove(a)
    p["dispatch"].mark_running(w, [a])
    held, _ = glue.survey(p["table"].waiting, {0: 1.0})
    assert {b.request_id, c.request_id} <= held  # they wait for a's point
    index.park(tuple(system[:96]), "pt96", 10, "chunk", exact=True)
    hits, back = glue.admit([b], w.index)
    assert [(r, m.num_tokens) for r, m in hits] == [(b, 96)] and back == [] and glue.park_at(w.index) == ()


@pytest.mark.parametrize("grids, point", [([64], 192), ([64, 128], 128), ([128, 256], 0)],
                         ids=["cpu-workers", "a-gpu-worker-joins", "coarser-than-the-prompt"])
def test_branch_points_lie_on_the_grid_every_worker_shares(grids: list[int], point: int) -> None:
    """A repeated 200-token prompt parks its last grid point: 192 on a 64-token grid;
    128 once a worker whose scan runs in 128-token chunks (a GPU keeping the model's chunk,
    `WorkerInfo.prefix_grid`) joins, since a point must be exact on whichever worker restores
    it; none where the shared grid is longer than the prompt. (The 64-token grid's answer is the
    control: the grid is the workers', not a constant.)"""
    from raysched.config import ServeConfig
    from raysched.scheduler.prefix_cache import PrefixCache
    from tests.test_scheduler_parts import LIMITS, FakeWorker, parts

    p = parts(ServeConfig(), [FakeWorker(0, kv=1024)])
    glue = PrefixCache(StateCache(budget_bytes=1 << 20, min_tokens=16, block_tokens=512), p["table"], p["counters"],
                       branch_points=True)
    glue.use_grid(grids)
    first, again = (p["table"].submit([t % 50 + 3 for t in range(200)], {"max_new_tokens": 2}, LIMITS)
                    for _ in range(2))
    glue.admit([first], 0)
    glue.admit([again], 0)
    assert glue.park_at(0) == (((again.request_id, point),) if point else ())


@pytest.mark.parametrize("surveyed", [True, False], ids=["second-seen-waiting", "control-not-seen"])
def test_the_first_of_a_group_parks_the_branch_point_for_a_second_still_waiting(surveyed: bool) -> None:
    """Two prompts share a 100-token system text; the first is admitted alone while the second
    waits (the scheduler has looked at its queue: `survey`). The first is asked to park the
    branch point (96 on the 32-token grid), so the second restores it instead of computing it
    and parking it for a third. Control: with the second never seen, the first parks nothing
    (no second prompt shares anything yet), and a prompt alone never adds a point."""
    from raysched.config import ServeConfig
    from raysched.scheduler.prefix_cache import PrefixCache
    from tests.test_scheduler_parts import LIMITS, FakeWorker, parts

    p = parts(ServeConfig(), [FakeWorker(0, kv=1024)])
    glue = PrefixCache(StateCache(budget_bytes=1 << 20, min_tokens=16, block_tokens=512), p["table"], p["counters"],
                       branch_points=True)
    system = [t % 60 + 1 for t in range(100)]
    a, b = (p["table"].submit(system + [70 + i] * 20, {"max_new_tokens": 2}, LIMITS) for i in range(2))
    if surveyed:
        glue.survey(p["table"].waiting, {0: 1.0})
    assert glue.admit([a], 0) == ([], [])
    assert glue.park_at(0) == (((a.request_id, 96),) if surveyed else ())
    lone = p["table"].submit([t % 50 + 3 for t in range(200)], {"max_new_tokens": 2}, LIMITS)
    glue.survey(p["table"].waiting, {0: 1.0})
    glue.admit([lone], 0)
    assert glue.park_at(0) == ()


@pytest.mark.parametrize("late_calls", [2, 0], ids=["late-ask", "control-late-asks-off"])
def test_a_second_prompt_that_came_after_the_first_ones_prefill_asks_its_worker_late(late_calls: int) -> None:
    """Two prompts share a 100-token system text; the second comes after the first's one-call
    prefill ran on worker 0 (`bench prefix` system300: a group's second request). With late
    asks (`state_cache.late_branch_calls`), the second is admitted by worker 1's plan, but the
    branch point (96) is asked of the first request on worker 0 (its worker kept that call's
    scan states), and the second waits for worker 0's reply to that plan: worker 1's own replies
    do not end the wait. Then it restores the point; a point worker 0 could not park ends the
    wait too, and is not asked late again (the next such request parks it itself).
    Control: with late asks off the second request parks the point itself at once."""
    from raysched.config import ServeConfig
    from raysched.messages import StepResult
    from raysched.request import State
    from raysched.scheduler.planner import Decision
    from raysched.scheduler.prefix_cache import PrefixCache
    from tests.test_scheduler_parts import LIMITS, FakeWorker, parts

    p = parts(ServeConfig(), [FakeWorker(0, kv=1024), FakeWorker(1, kv=1024)])
    index = StateCache(budget_bytes=1 << 20, min_tokens=16, block_tokens=512)
    glue = PrefixCache(index, p["table"], p["counters"], branch_points=True, late_calls=late_calls)
    w0, w1 = p["fleet"].slots[0], p["fleet"].slots[1]
    system = [t % 60 + 1 for t in range(100)]
    a = p["table"].submit(system + [70] * 20, {"max_new_tokens": 8}, LIMITS)
    assert glue.admit([a], 0) == ([], []) and glue.park_at(0) == ()
    p["table"].waiting.remove(a)
    p["dispatch"].mark_running(w0, [a])
    a.add_tokens([5], 0.0)  # its prefill ran: it has its first token
    b = p["table"].submit(system + [71] * 20, {"max_new_tokens": 8}, LIMITS)
    hits, back = glue.admit([b], 1)
    if not late_calls:
        assert (hits, back, glue.park_at(0), glue.park_at(1)) == ([], [], (), ((b.request_id, 96),))
        return
    assert (hits, back, glue.park_at(1), glue.park_at(0)) == ([], [b], (), ((a.request_id, 96),))
    glue.on_result(w1, Decision(), StepResult())  # another worker's reply: still waiting
    assert b.request_id in glue.survey(p["table"].waiting, {0: 1.0, 1: 1.0})[0]
    index.park(tuple(system[:96]), "pt96", 10, "chunk", exact=True)  # what `take` keeps
    glue.on_result(w0, Decision(), StepResult())
    assert not glue.survey(p["table"].waiting, {0: 1.0, 1: 1.0})[0]  # the wait is over
    hits, back = glue.admit([b], 1)
    assert [(r, m.num_tokens) for r, m in hits] == [(b, 96)] and back == []
    other = [61 + t % 30 for t in range(64)]
    c = p["table"].submit(other + [92] * 50, {"max_new_tokens": 8}, LIMITS)  # leaves at 64
    d = p["table"].submit(other + [93] * 50, {"max_new_tokens": 8}, LIMITS)
    glue.admit([c], 0)
    p["table"].waiting.remove(c)
    p["dispatch"].mark_running(w0, [c])
    c.add_tokens([5], 0.0)
    assert glue.admit([d], 1)[1] == [d] and glue.park_at(0) == ((c.request_id, 64),)
    glue.on_result(w0, Decision(), StepResult())  # replied without the point: wait over
    assert glue.admit([d], 1) == ([], []) and glue.park_at(1) == ((d.request_id, 64),)  # not late again
    third = [31 + t % 29 for t in range(64)]
    e, f = (p["table"].submit(third + [94 + i] * 40, {"max_new_tokens": 8}, LIMITS) for i in range(2))
    glue.admit([e], 0)
    p["table"].waiting.remove(e)
    p["dispatch"].mark_running(w0, [e])
    e.add_tokens([5], 0.0)
    assert glue.admit([f], 1)[1] == [f] and glue.park_at(0) == ((e.request_id, 64),)
    e.state, e.worker = State.WAITING, None  # its worker was lost before replying: queued again
    glue.on_result(w1, Decision(), StepResult())
    assert not glue.survey(p["table"].waiting, {0: 1.0, 1: 1.0})[0]  # nobody waits on it


def test_a_late_ask_goes_out_when_the_second_prompt_is_first_seen_waiting() -> None:
    """The second prompt waits behind full slots: the late ask goes to the first request's
    worker as soon as the scheduler sees it in its queue (`survey`), not when it is admitted
    (by then that worker's kept states may have aged out), and it is held back meanwhile; if
    the first request ends before that worker's next plan, the next look at the queue ends the
    wait (no reply will). Control: a prompt that shares nothing with a running one asks nothing
    and is not held."""
    from raysched.config import ServeConfig
    from raysched.request import State
    from raysched.scheduler.prefix_cache import PrefixCache
    from tests.test_scheduler_parts import LIMITS, FakeWorker, parts

    p = parts(ServeConfig(), [FakeWorker(0, kv=1024), FakeWorker(1, kv=1024)])
    glue = PrefixCache(StateCache(budget_bytes=1 << 20, min_tokens=16, block_tokens=512), p["table"],
                       p["counters"], branch_points=True, late_calls=2)
    system = [t % 60 + 1 for t in range(100)]
    a = p["table"].submit(system + [70] * 20, {"max_new_tokens": 8}, LIMITS)
    glue.admit([a], 0)
    p["table"].waiting.remove(a)
    p["dispatch"].mark_running(p["fleet"].slots[0], [a])
    a.add_tokens([5], 0.0)
    b = p["table"].submit(system + [71] * 20, {"max_new_tokens": 8}, LIMITS)
    alone = p["table"].submit([61 + t % 30 for t in range(120)], {"max_new_tokens": 8}, LIMITS)
    held, placement = glue.survey(p["table"].waiting, {0: 1.0, 1: 1.0})
    assert held == {b.request_id} and placement.home == {b.request_id: 0}
    assert glue.late_unsent() == {0} and glue.park_at(0) == ((a.request_id, 96),) and glue.park_at(1) == ()
    assert alone.request_id not in held
    a.state = State.FINISHED  # it ended before its worker's next plan: nobody will park it
    held, _ = glue.survey(p["table"].waiting, {0: 1.0, 1: 1.0})
    assert not held and glue.late_unsent() == set()  # the wait ends without any reply


def _shared_then_burst(protected_fraction: float) -> tuple[StateCache, tuple[int, ...]]:
    """A system prompt's point that a request matched, then 20 prompts nobody shares, each
    parking a point, through a budget of 10 points."""
    cache = StateCache(budget_bytes=10 * 10, min_tokens=1, protected_fraction=protected_fraction)
    system = (7,) * 12
    cache.park(system, "system", 10, "chunk", exact=True)
    assert cache.lookup(system + (1, 2)).point.ref == "system"  # a follower matched it
    for i in range(20):
        cache.park((100 + i,) * 9, f"once{i}", 10, "prompt")
    return cache, system


def test_points_a_request_matched_outlive_a_burst_of_prompts_nobody_shares() -> None:
    """Eviction by hits and age: the matched point stays while 20 one-off points pass through
    the budget (the newest of them are kept). Negative control: with no room for matched points
    (`protected_fraction` 0, plain LRU) the burst evicts it."""
    cache, system = _shared_then_burst(0.8)
    assert cache.lookup(system + (3,)).point.ref == "system"
    assert cache.num_points == 10 and cache.protected_bytes == 10 and cache.bytes == 100
    assert cache.lookup((119,) * 10).point.ref == "once19" and cache.lookup((100,) * 10) is None
    lru, system = _shared_then_burst(0.0)
    assert lru.lookup(system + (3,)) is None and lru.protected_bytes == 0


def test_matched_points_beyond_their_share_of_the_budget_are_demoted_oldest_first() -> None:
    """Points with hits hold at most `protected_fraction` of the budget: past it the least
    recently used of them loses its hits and joins the others as their newest (a second chance);
    the oldest without hits goes. The bytes with hits add up after every step (recounted)."""
    cache = StateCache(budget_bytes=4 * 10, min_tokens=1, protected_fraction=0.5)
    for i in range(4):
        cache.park((i,) * 5, f"p{i}", 10, "prompt")
    for i in (2, 0, 3):  # matched in this order: p2 is the least recently used of them
        cache.lookup((i,) * 6)

    def hits() -> dict[str, int]:
        counted = {p.ref: p.hits for p in cache._points.values()}
        assert cache.protected_bytes == 10 * sum(1 for h in counted.values() if h) <= 20, counted
        return counted

    _, dropped = cache.park((9,) * 5, "new", 10, "prompt")
    # 30 bytes with hits > 20: p2 is demoted behind "new"; p1, the oldest without hits, goes
    assert dropped == ["p1"] and hits() == {"p0": 1, "p3": 1, "new": 0, "p2": 0}
    _, dropped = cache.park((8,) * 5, "newer", 10, "prompt")
    assert dropped == ["new"] and hits() == {"p0": 1, "p3": 1, "p2": 0, "newer": 0}
    assert cache.lookup((2,) * 6).point.ref == "p2"  # its second chance paid: matched again
    _, dropped = cache.park((6,) * 5, "newest", 10, "prompt")
    assert dropped == ["newer"] and hits() == {"p3": 1, "p2": 1, "p0": 0, "newest": 0}


def park_turn(cache: StateCache, tokens: tuple[int, ...], kind: str, name: str) -> list:
    """A turn point (no blocks: its object holds all of its K/V); the refs the park dropped."""
    return cache.park(tokens, name, 10, kind)[1]


@pytest.mark.parametrize("matched", [False, True], ids=["no-hit-pauses", "control-a-hit-keeps-parking"])
def test_turn_points_that_nobody_matches_stop_being_parked_and_are_dropped(matched: bool) -> None:
    """`turn_window` 4: four prompt/finished points parked with no hit among them pause turn
    points (`turns_pay` False) and drop every turn point without hits, never a chunk point (one
    parked later, asked for before the pause, is refused); a
    prompt containing an earlier one whole (`resume_turns`) starts a new window. Control: one of
    the four matched keeps parking on, and nothing is dropped."""
    cache = StateCache(budget_bytes=1 << 20, min_tokens=4, block_tokens=B, turn_window=4)
    park_boundaries(cache, tuple(range(8)))  # two exact chunk points, shared by nobody yet
    dropped = []
    for i in range(4):
        prompt = tuple(range(100 * (i + 1), 100 * (i + 1) + 6))
        dropped += park_turn(cache, prompt, "prompt", f"prompt{i}")
        if matched and i == 1:
            assert cache.lookup(prompt + (7,)).point.ref == "prompt1"  # a repeat of prompt 1
        assert cache.turns_pay() or i == 3
    if matched:
        assert cache.turns_pay() and dropped == [] and cache.turn_pauses == 0
        return
    assert not cache.turns_pay() and cache.turn_pauses == 1
    assert sorted(dropped) == ["prompt0", "prompt1", "prompt2", "prompt3"] and cache.turn_points_dropped == 4
    assert cache.kind_bytes["prompt"] == 0 and cache.kind_bytes["chunk"] == 20  # chunk points stay
    late = park_turn(cache, tuple(range(600, 606)), "finished", "late")  # asked for before the pause
    assert late == [] and cache.kind_bytes["finished"] == 0 and not cache.wants(6, "finished") and cache.wants(6)
    cache.resume_turns()
    assert cache.turns_pay()
    assert park_turn(cache, tuple(range(500, 506)), "finished", "next") == [] and cache.turns_pay()


def test_a_repeat_or_a_next_turn_contains_an_earlier_prompt_and_a_shared_system_prompt_does_not() -> None:
    """`BranchPoints.contains_earlier`, the evidence that resumes turn points: a repeated prompt
    and a chat's next turn (the history plus more) contain an earlier prompt whole (up to its
    last whole grid block); a prompt that shares only a system text with earlier ones does not."""
    from raysched.scheduler.state_cache import BranchPoints

    grid = 16
    system, tree = tuple(range(1, 41)), BranchPoints(grid=grid)
    first = system + tuple(range(200, 230))
    assert not tree.contains_earlier(first)
    tree.add("a", first)
    assert not tree.contains_earlier(system + tuple(range(300, 330)))  # shares the system text only
    assert tree.contains_earlier(first)  # a repeat
    assert tree.contains_earlier(first + tuple(range(400, 450)))  # the next turn: history + answer + more
    assert not tree.contains_earlier(first[:40])


@pytest.mark.parametrize("repeat", [True, False], ids=["repeat-resumes", "control-new-prompt-stays-paused"])
def test_plans_park_turn_points_again_once_a_repeat_is_seen_waiting(repeat: bool) -> None:
    """The scheduler's side: once the index pauses turn points, plans ask for none
    (`PrefixCache.park_turns`); a waiting prompt that repeats an earlier one, first seen by
    `survey`, resumes them. Control: a new prompt that shares nothing leaves them paused."""
    from raysched.config import ServeConfig
    from raysched.scheduler.prefix_cache import PrefixCache
    from tests.test_scheduler_parts import LIMITS, FakeWorker, parts

    p = parts(ServeConfig(), [FakeWorker(0, kv=1024)])
    index = StateCache(budget_bytes=1 << 20, min_tokens=16, block_tokens=512, turn_window=2)
    glue = PrefixCache(index, p["table"], p["counters"], branch_points=True)
    first = [t % 60 + 1 for t in range(100)]
    a = p["table"].submit(first, {"max_new_tokens": 2}, LIMITS)
    glue.survey(p["table"].waiting, {0: 1.0})
    assert glue.park_turns()
    for i in range(2):
        index.park(tuple(range(1000 * (i + 1), 1000 * (i + 1) + 40)), f"turn{i}", 10, "finished")
    assert not glue.park_turns() and a.request_id
    p["table"].submit(first if repeat else [t % 50 + 3 for t in range(100)], {"max_new_tokens": 2}, LIMITS)
    glue.survey(p["table"].waiting, {0: 1.0})
    assert glue.park_turns() == repeat


@pytest.mark.parametrize("on", [True, False], ids=["empty-cache-reports-its-budget", "control-off-reports-0"])
def test_stats_report_the_budget_of_an_empty_cache(on: bool) -> None:
    """`raysched status` on a fresh server: prefix reuse on, nothing parked yet. The stats name the
    cache's budget (an empty `StateCache` has length 0, and once read as "off"). Control: with the
    cache off, the budget is 0."""
    from raysched.config import ServeConfig
    from raysched.scheduler.prefix_cache import PrefixCache
    from tests.test_scheduler_parts import FakeWorker, parts

    p = parts(ServeConfig(), [FakeWorker(0, kv=1024)])
    index = StateCache(budget_bytes=3 << 20, min_tokens=16, block_tokens=512) if on else None
    stats = PrefixCache(index, p["table"], p["counters"]).stats()
    assert (stats["state_cache_budget_bytes"], stats["state_cache_points"]) == ((3 << 20) if on else 0, 0)
