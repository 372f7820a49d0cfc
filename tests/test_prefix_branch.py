"""Prefix reuse at the scan-chunk grid (branch points, `StepPlan.park_at`) through the worker
(no Ray): a prompt's prefill pauses where the plan says, parks an exact point there and goes on
in the same call; another prompt that shares the first p tokens restores it and prefills the rest.

- `park_at` parks exactly the points it names (no point at the other grid steps), each holding
  its recurrent state and the K/V of its tokens (below the first 512-token block: its tail).
- Bit-exactness against the uncached run (every logit `torch.equal`), at every grid point below
  a 512-token chunk, for a follower of another length and for a repeated prompt (all but its
  last block restored), and for the producer itself (pausing changes none of its bits). It holds
  because prefill attention runs in 32-row query tiles at absolute positions
  (`actors.attention.PREFILL_TILE`): a row's kernel call has the same shape wherever a chunk
  starts. Negative control: one causal call per chunk (the attention before the tiles) gives
  other bits at some grid point, where this CPU's kernel rows depend on the call's shape (a
  row's bits in a 208-token causal call differed from the same row's in a 420-token one here);
  where they do not, the control is skipped, saying so.
- Negative control: a point off the scan grid (a scan chunk cut in two) restores to different
  logits.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_prefix_reuse import drive as reuse_drive, make_worker as reuse_worker, prompt

CHUNK = 512  # prefill chunk (= K/V block): every point below is inside the first chunk
GRID = 32  # the branch-point grid on the CPU (`actors.engine.prefix_grid`; checked below)
PRODUCER_LEN = 480
POINTS = tuple(range(GRID, PRODUCER_LEN, GRID))  # 32 .. 448


def make_worker():
    return reuse_worker(kv_tokens=4096)


def drive(w, rid: str, tokens: list[int], park_at: tuple[int, ...] = (), prefix: list | None = None,
          trail_calls: int = 0):
    """Run one request to the end, a 512-token chunk per call, parking at `park_at`; (logits,
    parked points, their objects by key, tokens restored)."""
    _, logits, parked, objects, cached = reuse_drive(w, rid, tokens, CHUNK, GRID, prefix, park_at, trail_calls)
    return logits, parked, objects, cached


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def one_call_attention(self, q, k, v, seg, k_cache, v_cache, fused=None):
    """The prefill attention before the tiles: one causal call over the chunk's queries."""
    if not seg.start:
        return self._sdpa(q, k, v, causal=True)
    L, ctx = q.shape[0], seg.context_slots
    mask = torch.ones(L, seg.start + L, dtype=torch.bool, device=q.device).tril(seg.start)
    return self._sdpa(q, k_cache[ctx], v_cache[ctx], mask=mask)


def reuse_runs(w) -> dict:
    """The producer paused at every grid point, its uncached run, and per point a follower (its
    own suffix, so another length) restored there and run uncached; plus the repeated prompt."""
    p = prompt(PRODUCER_LEN, seed=1)
    plain, _, _, _ = drive(w, "plain", p)
    paused, parked, objects, _ = drive(w, "p", p, park_at=POINTS)
    runs = {"producer": (paused, plain, 0, 0)}
    for k, at in enumerate(POINTS):
        q = p[:at] + prompt(20 + 7 * k, seed=10 + k)
        uncached, _, _, _ = drive(w, f"u{at}", q)
        restored, _, _, cached = drive(w, f"q{at}", q, prefix=[objects[("p", "chunk", at)]])
        runs[at] = (restored, uncached, cached, at)
    last = (PRODUCER_LEN - 1) // GRID * GRID
    again, _, _, cached = drive(w, "again", p, prefix=[objects[("p", "chunk", last)]])
    runs["repeated"] = (again, plain, cached, last)
    return {"runs": runs, "parked": parked, "objects": objects, "prompt": p}


@pytest.fixture(scope="module")
def tiled():
    w = make_worker()
    return reuse_runs(w), w


@pytest.fixture(scope="module")
def today(tiled):
    return tiled[0]


def test_park_at_parks_exactly_the_points_the_plan_names(today) -> None:
    parked, objects = today["parked"], today["objects"]
    chunk_points = [(x.num_tokens, x.kv_from, x.exact) for x in parked if x.kind == "chunk"]
    assert chunk_points == [(at, 0, True) for at in POINTS]  # nothing at the other grid steps
    assert [x.kind for x in parked if x.kind != "chunk"] == ["prompt", "finished"]
    assert all(objects[("p", "chunk", at)].part("kv").shape[2] == at for at in POINTS)  # tail K/V
    assert all(cached == at for _, _, cached, at in today["runs"].values())


def test_negative_control_one_attention_call_per_chunk_is_not_exact_at_every_grid_point() -> None:
    from actors.attention import Attention

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Attention, "_prefill_one", one_call_attention)
        runs = reuse_runs(make_worker())["runs"]
    bad = [name for name, (got, want, _, _) in runs.items() if not same(got, want)]
    if not bad:
        pytest.skip("this CPU's attention rows do not depend on the call's shape at these points")
    assert bad


def test_reuse_at_every_grid_point_is_bit_identical_with_the_default_kernels(tiled) -> None:
    """The engine's own prefill attention: rowdot's row-by-row kernel where it loads on a
    vector build, else the grid's tiles through SDPA (the next test runs the tiles here too)."""
    runs, _ = tiled
    bad = [name for name, (got, want, _, _) in runs["runs"].items() if not same(got, want)]
    assert not bad, f"logits differ from the uncached run at {bad}"
    assert runs["runs"]["repeated"][2] == 448  # all but the last (partial) block restored


def test_reuse_at_every_grid_point_is_bit_identical_with_grid_tiled_attention() -> None:
    from actors.model import HybridLM

    fused = HybridLM.fused_prefill
    with pytest.MonkeyPatch.context() as mp:  # SDPA in tiles, as without rowdot's prefill attention
        mp.setattr(HybridLM, "fused_prefill",
                   lambda self: {k: f for k, f in fused(self).items() if k != "prefill_attention"})
        runs = reuse_runs(make_worker())
    bad = [name for name, (got, want, _, _) in runs["runs"].items() if not same(got, want)]
    assert not bad, f"logits differ from the uncached run at {bad}"


def test_negative_control_a_point_off_the_scan_grid_restores_to_other_logits(tiled) -> None:
    runs, w = tiled
    p = runs["prompt"]
    off = 72  # `tiny` scans in chunks of 16: 72 cuts one in two
    _, _, objects, _ = drive(w, "off", p, park_at=(off,))
    q = p[:off] + prompt(30, seed=99)
    want, _, _, _ = drive(w, "u-off", q)
    got, _, _, cached = drive(w, "q-off", q, prefix=[objects[("off", "chunk", off)]])
    assert cached == off and not torch.equal(got[0], want[0])


def test_the_grid_follows_the_scan_chunk_a_gpu_keeps() -> None:
    """On a GPU the SSD scan keeps the model's chunk (`actors.mamba.scan_chunk`), 128 or 256
    tokens for real checkpoints, so a branch point on the CPU's 32-token grid would cut a scan
    chunk in two there. The engine reports its grid (`prefix_grid`, `WorkerInfo.prefix_grid`),
    and the scheduler parks on the one every worker shares. Here the scan runs in 128-token
    chunks, as on such a GPU: the engine says 128, a point at 128 restores bit-exactly, and
    (the negative control) a point at 64, on a 64-token grid, restores to other logits."""
    import actors.engine
    import actors.mamba

    with pytest.MonkeyPatch.context() as mp:
        for module in (actors.engine, actors.mamba):
            mp.setattr(module, "scan_chunk", lambda model_chunk, device: 128)
        w = make_worker()
        grid = w.engine.prefix_grid
        p = prompt(300, seed=5)
        out = {}
        for at in (64, 128):  # one producer each (a pause at 64 would cut the one at 128's chunk)
            _, _, objects, _ = drive(w, f"p{at}", p, park_at=(at,))
            q = p[:at] + prompt(40, seed=50 + at)
            want, _, _, _ = drive(w, f"u{at}", q)
            got, _, _, cached = drive(w, f"q{at}", q, prefix=[objects[(f"p{at}", "chunk", at)]])
            out[at] = (cached, same(got, want))
    assert grid == 128 and make_worker().engine.prefix_grid == GRID  # (the CPU's, unpatched)
    assert out[128] == (128, True)
    assert out[64] == (64, False)  # negative control: off the 128-token scan grid


def test_a_pause_at_a_branch_point_parks_the_other_prompts_boundaries_once() -> None:
    """Two prompts prefill in one call: "a" reaches its 512-token chunk boundary, "b" pauses at
    a branch point inside its chunk (`park_at`), then feeds the rest of it in the same call.
    Each point is parked once: "a"'s boundary was parked a second time when "b" went on (the
    pause loop counted only "b" as advancing), so the result listed its key twice and the
    scheduler's `take_parked` of both raised KeyError (seen as "Unhandled error" tracebacks in
    `bench overhead`). Every listed key is handed over. Control: "b" alone parks its point."""
    from raysched.messages import PrefillItem, StepPlan
    from tests.test_prefix_reuse import GREEDY

    def parked_keys(items: list[tuple[str, list[int]]], park_at: tuple) -> list[tuple]:
        w = make_worker()
        plan = StepPlan(prefill=tuple(PrefillItem(r, tuple(t), len(t), GREEDY.to_dict()) for r, t in items),
                        park_at=park_at, decode_steps=0, park_min_tokens=64, prefill_chunk_tokens=CHUNK)
        keys = [p.key for p in w.step(plan).parked]
        assert len(w.take_parked(keys)) == len(keys)  # every listed point is there to take
        return keys

    a, b = prompt(600, seed=3), prompt(300, seed=4)
    both = parked_keys([("a", a), ("b", b)], (("b", 96),))
    alone = parked_keys([("b", b)], (("b", 96),))
    assert sorted(both) == [("a", "chunk", 512), ("b", "chunk", 96), ("b", "prompt", 300)], both
    assert sorted(alone) == [("b", "chunk", 96), ("b", "prompt", 300)]


def test_a_prompt_parks_its_last_grid_point_so_that_sending_it_again_restores_all_but_that_block(tiled) -> None:
    """One after the other, the same prompt twice (a user retrying, `n` samples sent one by
    one): the first parks its *prompt point* at its last grid point before its end (448 of
    480), from the scan states its prefill call kept (`Engine.last_state_before`), every byte
    equal to the point a prefill paused at 448 parks; the repeat restores it and its logits are
    the uncached run's (`torch.equal`). Control: without kept states (`trail_calls` 0) the
    prompt point is the state at the prompt's end (480, not exact off a chunk boundary), which
    a repeat cannot use (it must feed at least its last token)."""
    runs, w = tiled
    p, last = runs["prompt"], (PRODUCER_LEN - 1) // GRID * GRID
    _, parked, objects, _ = drive(w, "kept", p, trail_calls=2)
    point = next(x for x in parked if x.kind == "prompt")
    assert (point.num_tokens, point.kv_from, point.exact) == (last, 0, True)
    paused = runs["objects"][("p", "chunk", last)]
    assert (objects[point.key].payload == paused.payload).all()
    again, _, _, cached = drive(w, "again-kept", p, prefix=[objects[point.key]], trail_calls=2)
    assert cached == last and same(again, runs["runs"]["repeated"][1])  # the uncached run's logits
    _, parked, _, _ = drive(w, "no-trails", p)
    assert [(x.num_tokens, x.exact) for x in parked if x.kind == "prompt"] == [(PRODUCER_LEN, False)]


# ---------------------------------------------------------------------------- late branch points
def late_points(w, rid: str, tokens: list[int], points: tuple[int, ...], trail_calls: int = 2,
                calls_between: int = 0) -> dict:
    """`tokens` prefilled in one call (the worker keeping `trail_calls` calls' scan states),
    `calls_between` other prompts' prefill calls, then a plan asking for `points`, which that
    first call passed (a second prompt sharing them came while it ran): {at: parked object}."""
    from raysched.messages import PrefillItem, StepPlan
    from tests.test_prefix_reuse import GREEDY

    common = dict(park_min_tokens=GRID, prefill_chunk_tokens=CHUNK, trail_calls=trail_calls)
    started = [PrefillItem(rid, tuple(tokens), len(tokens), GREEDY.to_dict())]
    started += [PrefillItem(f"{rid}-other{i}", tuple(prompt(64, seed=70 + i)), 64, GREEDY.to_dict())
                for i in range(calls_between)]
    keys = []
    for item in started:
        keys += [p.key for p in w.step(StepPlan(prefill=(item,), **common)).parked]
    late = w.step(StepPlan(park_at=tuple((rid, at) for at in points), decode_steps=1, **common)).parked
    w.discard_parked(keys)
    got = {p.num_tokens: p for p in late}
    objects = w.take_parked([p.key for p in late]) if late else ()
    objects = (objects,) if len(late) == 1 else objects
    w.step(StepPlan(drop=tuple(item.request_id for item in started)))
    assert w.is_idle() and not w._parked
    return {at: (got[at], obj) for at, obj in zip(got, objects)}


def test_a_point_the_prefill_already_passed_is_parked_from_the_states_its_call_kept(tiled) -> None:
    """The second prompt sharing a branch point came while the first one's one-call prefill ran
    (`bench prefix` system300: the second request of a group): the next plan asks the first
    request for a point it passed. The worker kept that call's scan states at its chunk starts
    (`state_cache.late_branch_calls`, `Engine.state_at`) and parks the point from them: every
    byte equal to the point a prefill paused there parks, and a follower restored from it gives
    the uncached run's logits (`torch.equal`)."""
    runs, w = tiled
    p = runs["prompt"]
    late = late_points(w, "late", p, POINTS)
    assert sorted(late) == list(POINTS)
    for at, (point, snap) in late.items():
        paused = runs["objects"][("p", "chunk", at)]
        assert (point.kind, point.kv_from, point.exact) == ("chunk", 0, True)
        assert snap.parts == paused.parts and (snap.payload == paused.payload).all(), at
    k, at = 8, POINTS[8]  # 288: a 300-token system prompt's point
    q = p[:at] + prompt(20 + 7 * k, seed=10 + k)  # the follower `reuse_runs` ran uncached
    got, _, _, cached = drive(w, "q-late", q, prefix=[late[at][1]])
    assert cached == at and same(got, runs["runs"][at][1])


def test_negative_controls_no_late_point_without_kept_states_or_after_they_aged_out(tiled) -> None:
    """Controls: with `trail_calls` 0 nothing is kept and a late ask parks nothing; with 2,
    two later prefill calls drop the first one's states (the memory they cost is bounded), and
    the ask parks nothing. And the kept state is not the request's state now: the pool's
    recurrent state (what a plain copy would take) differs from the late point's."""
    runs, w = tiled
    p = runs["prompt"]
    assert late_points(w, "off", p, (288,), trail_calls=0) == {}
    assert late_points(w, "aged", p, (288,), trail_calls=2, calls_between=2) == {}
    assert sorted(late_points(w, "kept", p, (288,), trail_calls=2, calls_between=1)) == [288]
    from raysched.messages import PrefillItem, StepPlan
    from tests.test_prefix_reuse import GREEDY

    w.step(StepPlan(prefill=(PrefillItem("now", tuple(p), len(p), GREEDY.to_dict()),), park_min_tokens=GRID,
                    prefill_chunk_tokens=CHUNK, trail_calls=1))
    now = w.engine.copy_state("now")
    w.step(StepPlan(drop=("now",)))
    late = runs["objects"][("p", "chunk", 288)]
    assert not torch.equal(now.part("ssm"), late.part("ssm"))


def test_late_points_of_a_gated_delta_net_equal_its_paused_points() -> None:
    """The delta rule's scan (`actors.gdn.gdn_chunked`, Qwen3.5's linear attention) keeps its
    chunk-start states the same way: each late point of `tiny-qwen35` is byte-equal to the
    point a prefill paused there parks. Control: the late point at 96 is not the one at 64."""
    from actors.worker import Worker
    from raysched.config import PoolConfig, ServeConfig

    w = Worker(ServeConfig(model="tiny-qwen35", device="cpu", pool=PoolConfig(kv_tokens=4096, state_slots=4)), 0)
    w.engine.record_logits = True
    assert w.engine.prefix_grid == GRID
    p = prompt(300, seed=8)
    points = (64, 96, 288)
    _, _, paused, _ = drive(w, "paused", p, park_at=points)
    late = late_points(w, "late", p, points)
    assert sorted(late) == list(points)
    for at in points:
        want = paused[("paused", "chunk", at)]
        assert (late[at][1].payload == want.payload).all(), at
    assert not torch.equal(late[96][1].part("gdn_state"), paused[("paused", "chunk", 64)].part("gdn_state"))
