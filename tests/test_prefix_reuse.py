"""Prefix reuse through the worker (no Ray): points at every prefill chunk boundary, K/V in
blocks parked once, and restores that are bit-identical to an uncached run.

- A prompt prefilled in chunks of C parks a point at every multiple of C (its recurrent state)
  and offers each K/V block once; the prompt's end and the finished turn park points too, whose
  own K/V starts after the blocks.
- A request that shares the first k chunks with it, restored at boundary k (blocks 0..k-1 + the
  point) and prefilled on from there, runs the chunks an uncached run runs: every logit
  `torch.equal` to the uncached run's, for every k. Negative control: the same prefix restored
  from a prefill chunked at another size gives different logits.
- A restore at a point that is not a chunk boundary (a finished turn) goes on to the next
  multiple of C first; such a request parks no boundary points (its state is not an uncached
  prefill's) and its later points reuse only the blocks it was restored with.
"""

from __future__ import annotations

import pytest
import torch

from raysched.config import PoolConfig, SchedulerConfig, ServeConfig
from raysched.messages import PrefillItem, StepPlan
from raysched.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6)
C = 16  # prefill chunk = block tokens


def make_worker(kv_tokens: int = 1024):
    """A worker (no Ray); the chunk size comes with each step plan, so one worker serves all."""
    from actors.worker import Worker

    cfg = ServeConfig(model="tiny", device="cpu", pool=PoolConfig(kv_tokens=kv_tokens, state_slots=4))
    w = Worker(cfg, 0)
    w.engine.record_logits = True
    return w


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drive(w, rid: str, tokens: list[int], chunk: int = C, park: int = 0, prefix: list | None = None,
          park_at: tuple[int, ...] = (), trail_calls: int = 0):
    """Run one request to the end, one chunk per call (pausing to park at `park_at`; keeping
    `trail_calls` calls' scan states); (tokens, logits, parked points, their objects by key,
    tokens restored)."""
    item = PrefillItem(rid, tuple(tokens), len(tokens), GREEDY.to_dict())
    common = dict(decode_steps=1, park_min_tokens=park, prefill_chunk_tokens=chunk, trail_calls=trail_calls)
    plan = StepPlan(prefill=(item,), prefix=(rid,) if prefix else (),
                    park_at=tuple((rid, p) for p in park_at), **common)
    new, parked, cached = [], [], None
    while True:
        result = w.step(plan, *([prefix] if prefix and cached is None else []))
        assert not result.prefix_failed, result.prefix_failed
        cached = result.cached.get(rid, 0) if cached is None else cached
        new += result.new_tokens.get(rid, [])
        parked += result.parked
        if rid in result.finished:
            break
        plan = StepPlan(**common)
    keys = [p.key for p in parked] + [p.block_key(i) for p in parked for i, _ in p.blocks]
    objects = w.take_parked(keys) if keys else ()
    objects = (objects,) if len(keys) == 1 else objects
    return new, w.engine.logits.pop(rid), parked, dict(zip(keys, objects)), cached


@pytest.mark.parametrize("turns", [False, True], ids=["no-turn-points", "control-turn-points"])
def test_without_turn_points_a_prompt_parks_only_what_another_prompt_can_share(turns: bool) -> None:
    """`state_cache.turn_points: false` (`StepPlan.park_turns`), for single-turn traffic: an
    80-token prompt parks its chunk boundaries (16 .. 64), not its prompt end or its finished
    turn, and the worker holds nothing after the request ends. Control: with turn points it
    parks those two as well."""
    w = make_worker()
    item = PrefillItem("t", tuple(prompt(80, seed=1)), 80, GREEDY.to_dict())
    common = dict(decode_steps=1, park_min_tokens=16, prefill_chunk_tokens=C, park_turns=turns)
    plan, parked = StepPlan(prefill=(item,), **common), []
    while True:
        result = w.step(plan)
        parked += [(p.kind, p.num_tokens) for p in result.parked]
        if "t" in result.finished:
            break
        plan = StepPlan(**common)
    w.discard_parked([("t", kind, n) for kind, n in parked] + [("t", "block", i) for i in range(5)])
    chunks = [("chunk", n) for n in (16, 32, 48, 64)]
    assert parked == chunks + ([("prompt", 80), ("finished", 85)] if turns else [])
    assert w.is_idle() and not w._parked and not w.engine.held


def refs_for(objects: dict, rid: str, kind: str, num_tokens: int, num_blocks: int) -> list:
    return [objects[(rid, "block", i)] for i in range(num_blocks)] + [objects[(rid, kind, num_tokens)]]


@pytest.fixture(scope="module")
def producer():
    """An 80-token prompt prefilled in chunks of 16, parking: its points and objects."""
    w = make_worker()
    p = prompt(80, seed=1)
    _, _, parked, objects, _ = drive(w, "p", p, park=16)
    return w, p, parked, objects


@pytest.fixture(scope="module")
def uncached(producer):
    """A prompt sharing the producer's first 4 chunks, run uncached: (prompt, tokens, logits)."""
    w, p, _, _ = producer
    q = p[:64] + prompt(30, seed=2)  # shares 4 chunks with p, then differs
    tokens, logits, _, _, _ = drive(w, "ref", q)
    return q, tokens, logits


def test_a_chunked_prompt_parks_a_point_per_boundary_and_each_kv_block_once(producer) -> None:
    w, p, parked, objects = producer
    assert [(x.kind, x.num_tokens, x.kv_from, x.exact) for x in parked] == [
        ("chunk", 16, 16, True), ("chunk", 32, 32, True), ("chunk", 48, 48, True), ("chunk", 64, 64, True),
        ("prompt", 80, 80, True), ("finished", 85, 80, False)]
    offered = [i for x in parked for i, _ in x.blocks]
    assert offered == [0, 1, 2, 3, 4]  # each block once, with the first point that needs it
    kv_per_token = w.engine.config.kv_bytes_per_token(4)
    assert all(objects[("p", "block", i)].nbytes == C * kv_per_token for i in offered)
    state_only = objects[("p", "chunk", 32)]
    assert state_only.part("kv").shape[2] == 0  # a boundary point adds only its recurrent state
    assert objects[("p", "finished", 85)].part("kv").shape[2] == 5  # the finished turn: its 5-token tail
    assert w.is_idle() and not w._parked


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_a_restore_at_any_chunk_boundary_is_bit_identical_to_an_uncached_run(producer, uncached, k) -> None:
    w, _, _, objects = producer
    q, want_tokens, want_logits = uncached
    tokens, logits, parked, _, cached = drive(w, f"q{k}", q, park=16,
                                              prefix=refs_for(objects, "p", "chunk", k * C, k))
    assert cached == k * C and tokens == want_tokens and len(logits) == len(want_logits)
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    assert [x.num_tokens for x in parked if x.kind == "chunk"] == [16 * j for j in range(k + 1, 6)]
    assert [i for x in parked for i, _ in x.blocks] == list(range(k, 5))  # only blocks it computed


def test_negative_control_a_prefix_prefilled_in_other_chunks_is_not_bit_identical(producer, uncached) -> None:
    w, p, _, _ = producer
    q, _, want_logits = uncached
    _, _, _, objects, _ = drive(w, "p20", p, chunk=20, park=16)  # boundaries at 20, 40, 60
    tokens, logits, _, _, cached = drive(w, "q", q, prefix=refs_for(objects, "p20", "chunk", 40, 2))
    assert cached == 40 and not torch.equal(logits[0], want_logits[0])


def test_a_restore_off_a_boundary_realigns_its_chunks_and_parks_no_boundary_points(producer) -> None:
    w, p, parked, objects = producer
    turn1 = p + [x for x in objects[("p", "finished", 85)].token_ids[80:85]]
    turn2 = turn1 + prompt(40, seed=3)  # 85 tokens restored, 40 to prefill
    item = PrefillItem("t2", tuple(turn2), len(turn2), GREEDY.to_dict())
    w.step(StepPlan(prefill=(item,), prefix=("t2",), prefill_chunk_tokens=C, park_min_tokens=16),
           refs_for(objects, "p", "finished", 85, 5))
    assert w.engine.prefilling["t2"].num_computed == 96  # 85 -> 96, the next multiple of 16
    later = []
    while "t2" in w.engine.running or "t2" in w.engine.prefilling:
        later += w.step(StepPlan(decode_steps=1, prefill_chunk_tokens=C, park_min_tokens=16)).parked
    w.discard_parked([x.key for x in later])
    assert [x.kind for x in later] == ["prompt", "finished"]
    assert all(x.kv_from == 80 and not x.blocks and not x.exact for x in later)


# ---------------------------------------------------------------------------- on a cluster


@pytest.fixture(scope="module")
def cluster():
    from tests.conftest import local_cluster

    with local_cluster(gpu_nodes=2) as c:
        yield c


@pytest.mark.slow  # (45 s; a lost node's snapshots and turns: tests/test_faults.py, tests/test_turn_cache.py)
def test_a_lost_node_holding_parked_blocks_means_a_full_prefill_with_the_right_tokens(cluster) -> None:
    """Request A parks its chunk points on worker X; B (same 1,024-token prefix, another suffix)
    is placed on X and restores them there. X's node is removed with the only copies of its K/V
    blocks (128 KiB each: over Ray's inline size, so in X's node store): C's restore
    (on the other worker) finds them lost, prefills in full, and the index forgets them; D then
    hits the points C parked. Every request's tokens equal an uncached in-process run's.
    (A restore from the node store of a killed worker: `tests/test_turn_cache.py`.)"""
    import raysched
    from raysched.config import StateCacheConfig
    from raysched.workload import RequestSpec
    from tests.exactness import reference

    cfg = ServeConfig(workers=2, pool=PoolConfig(kv_tokens=4096, state_slots=4),
                      scheduler=SchedulerConfig(replace_failed_workers=False, prefill_chunk_tokens=512),
                      state_cache=StateCacheConfig(min_tokens=16))
    shared = prompt(1024, seed=40)
    prompts = [shared + prompt(20 + i, seed=41 + i) for i in range(4)]
    client = raysched.launch(cfg)
    try:
        run = lambda p: client.submit(p, GREEDY).result(timeout=180)  # noqa: E731
        a = run(prompts[0])
        x = a["workers"][-1]
        b = run(prompts[1])
        x_node = next(w["node"] for w in client.workers if w["worker"] == x)
        cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == x_node), allow_graceful=False)
        c = run(prompts[2])
        d = run(prompts[3])
        stats = client.stats()
    finally:
        client.shutdown()
    want = reference([RequestSpec(f"r{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)])
    assert [r["token_ids"] for r in (a, b, c, d)] == [want[f"r{i}"] for i in range(4)]
    assert a["cached_tokens"] == 0
    assert (b["cached_tokens"], b["cache_kind"], b["cache_source"], b["workers"]) == (1024, "chunk", "same_worker", [x])
    assert c["cached_tokens"] == 0 and c["workers"][-1] != x
    assert (d["cached_tokens"], d["cache_source"], d["workers"]) == (1024, "same_worker", c["workers"][-1:])
    assert stats["state_cache_fallbacks"] == 1 and stats["state_cache_hits"] == 2, stats
    assert stats["state_cache_chunks"] == 2, stats  # C's blocks only: X's were forgotten
    print(f"\nhits {stats['state_cache_hits']}, fallback after the node loss {stats['state_cache_fallbacks']}; "
          f"{stats['state_cache_points']} points, {stats['state_cache_chunks']} blocks kept")
