"""`planner.plan_step` as a pure function: no Ray, no torch, hand-built worker views."""

from __future__ import annotations

import random
from collections import deque

import pytest

from raysched.config import SchedulerConfig
from raysched.scheduler.planner import Decision, WorkerView, decode_need, plan_step
from raysched.request import Request
from raysched.sampling import SamplingParams


def request(rid: str, prompt_len: int, generated: int = 0, max_new: int = 64, arrival_s: float = 0.0,
            retractions: int = 0) -> Request:
    r = Request(rid, tuple(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new),
                arrival_s=arrival_s, retractions=retractions)
    r.output_ids = [7] * generated
    return r


def view(running: list[Request], total_tokens: int = 256, total_slots: int = 8, free_tokens: int | None = None,
         calls: int = 0, page_size: int = 1) -> WorkerView:
    """A worker whose running requests hold exactly their cached tokens."""
    held = sum(r.num_cached for r in running)
    v = WorkerView(0, total_tokens - held if free_tokens is None else free_tokens,
                   total_slots - len(running), total_tokens, total_slots, page_size)
    v.running = list(running)
    v.allocated = {r.request_id: r.num_cached for r in running}
    v.calls = calls
    return v


def plan(v: WorkerView, waiting=(), retracted=(), best_room_elsewhere: float = -1.0, reserve: bool = False,
         **cfg) -> Decision:
    return plan_step(v, deque(waiting), deque(retracted), SchedulerConfig(**cfg), best_room_elsewhere, reserve)


# ------------------------------------------------------------------------------ decode steps


def test_decode_steps_halve_before_anything_is_retracted() -> None:
    running = [request("a", 10, generated=6), request("b", 10, generated=6)]  # 1 token/step each
    assert plan(view(running, free_tokens=8)).decode_steps == 4  # 2 x 4 fits
    for free, steps in ((7, 2), (4, 2), (3, 1), (2, 1)):
        p = plan(view(running, free_tokens=free))
        assert (p.decode_steps, p.victims) == (steps, []), free


def test_steps_halve_from_the_configured_count() -> None:
    running = [request("a", 10, generated=6)]
    assert plan(view(running, free_tokens=5), decode_steps_per_call=8).decode_steps == 4
    assert plan(view(running, free_tokens=3), decode_steps_per_call=8).decode_steps == 2


def test_a_call_that_leaves_prompts_unfed_decodes_one_step() -> None:
    """Four prompts of 300 admitted with a 512-token budget: the call feeds the first whole and
    part of the next, so prompts wait for the next call: this one decodes a single step (the
    next chunks come sooner, and fewer steps run at a partial batch); the control, the same
    with no budget and no chunks, feeds them all and decodes the configured 4."""
    waiting = [request(f"w{i}", 300, max_new=16) for i in range(4)]
    p = plan(view([], total_tokens=4096), waiting, prefill_budget_tokens=512, prefill_chunk_tokens=512)
    assert len(p.admit) == 4 and p.decode_steps == 1
    control = plan(view([], total_tokens=4096), [request(f"w{i}", 300, max_new=16) for i in range(4)],
                   prefill_budget_tokens=0, prefill_chunk_tokens=0)
    assert len(control.admit) == 4 and control.decode_steps == 4


def test_a_prompt_longer_than_a_chunk_keeps_calls_short_until_it_is_fed() -> None:
    """One running request and one 1,200-token prompt still prefilling (no token yet): each call
    feeds it one chunk, so calls decode one step until its first token comes back."""
    decoding, long = request("a", 10, generated=6), request("b", 1200)
    v = view([decoding, long], total_tokens=4096)
    assert plan(v, prefill_chunk_tokens=512, prefill_budget_tokens=512).decode_steps == 1
    long.output_ids = [7]  # its prefill ended
    assert plan(v, prefill_chunk_tokens=512, prefill_budget_tokens=512).decode_steps == 4


def test_retracts_only_when_a_single_step_does_not_fit() -> None:
    running = [request("a", 10, generated=6), request("b", 12, generated=3)]
    v = view(running, free_tokens=1)
    assert decode_need(v, running, 1) == 2  # even one step of both does not fit
    p = plan(v)
    assert p.decode_steps == 1 and [r.request_id for r in p.victims] == ["b"]  # fewest generated


def test_requests_near_their_budget_need_only_their_remaining_tokens() -> None:
    running = [request("a", 10, generated=63, max_new=64)]  # one token left
    p = plan(view(running, free_tokens=1))
    assert (p.decode_steps, p.victims) == (4, [])


# ------------------------------------------------------------------------------ victims

# a: prompt 10, 5 generated, oldest   | b: prompt 30, 2 generated, most KV
# c: prompt 4, 9 generated            | d: prompt 20, 2 generated, newest
EXPECTED_ORDER = {
    "fewest_generated": "bdac",  # (generated, -prompt length)
    "most_generated": "cabd",
    "newest": "dcba",
    "oldest": "abcd",
    "largest_memory": "bdac",  # by cached tokens: 31, 21, 14, 12
}


def four_running() -> list[Request]:
    return [request("a", 10, 5, arrival_s=1.0), request("b", 30, 2, arrival_s=2.0),
            request("c", 4, 9, arrival_s=3.0), request("d", 20, 2, arrival_s=4.0)]


@pytest.mark.parametrize("order", sorted(EXPECTED_ORDER))
def test_victims_follow_the_victim_order(order: str) -> None:
    """Forced retraction takes one victim per call, so protecting each victim in turn walks
    the whole order."""
    running = four_running()
    picked = []
    for _ in running:
        p = plan(view(running, calls=1), force_retract_every=1, victim_order=order, max_retractions=1)
        assert len(p.victims) == 1
        picked.append(p.victims[0].request_id)
        p.victims[0].retractions = 1  # protected from now on
    assert "".join(picked) == EXPECTED_ORDER[order]


def test_overflow_victims_come_in_victim_order_until_the_step_fits() -> None:
    running = [request(rid, 1, generated=1, arrival_s=t) for rid, t in zip("wxyz", (1.0, 2.0, 3.0, 4.0))]
    p = plan(view(running, free_tokens=0), victim_order="newest")  # each holds 1 token, needs 1 more
    assert [r.request_id for r in p.victims] == ["z", "y"]
    assert p.decode_steps == 1


def test_protected_requests_are_never_retracted() -> None:
    running = four_running()
    for r in running:
        r.retractions = 2 if r.request_id in "bd" else 0  # the two best victims are protected
    p = plan(view(running, free_tokens=0), max_retractions=2)
    assert [r.request_id for r in p.victims] == ["a"]
    p = plan(view(running, calls=4), force_retract_every=2, max_retractions=2)
    assert [r.request_id for r in p.victims] == ["a"]


def test_when_everyone_is_protected_the_worker_decodes_whom_it_can() -> None:
    running = [request("a", 10, 5, retractions=3), request("b", 10, 5, retractions=3)]
    p = plan(view(running, free_tokens=0), max_retractions=3)
    assert p.victims == [] and p.decode_steps == 1


def forced_at(calls_seen: list[int], every: int) -> list[int]:
    """The calls whose decision retracted, for decisions made at `calls_seen` on one worker (the
    dispatcher records each decision's forced round in the view, as `Dispatcher.decide` does)."""
    v = view(four_running())
    fired = []
    for c in calls_seen:
        v.calls = c
        d = plan(v, force_retract_every=every)
        if d.forced_round:
            v.forced_round = d.forced_round
        if d.victims:
            fired.append(c)
    return fired


def test_forced_retraction_fires_every_k_calls_only() -> None:
    assert forced_at(list(range(7)), every=3) == [3, 6]


def test_forced_retraction_fires_after_a_pipelined_call_skipped_its_multiple() -> None:
    """Pipelined calls take no decision: a multiple of k they skip fires at the next decision
    (before: `calls % k == 0` never held again at k=2 once the calls turned odd)."""
    assert forced_at([0, 1, 3, 5, 7], every=2) == [3, 5, 7]
    assert forced_at([0, 2, 4, 6], every=3) == [4, 6]


# ------------------------------------------------------------------------------ resume / admit


def test_retracted_requests_take_the_room_before_admissions() -> None:
    back = [request("r1", 20, 4, retractions=1)]  # needs 23 cached + 1 + 4 steps = 28 tokens
    new = [request("n1", 8)]  # needs 8 + 4 = 12 tokens
    assert [r.request_id for r in plan(view([], total_tokens=35), waiting=new).admit] == ["n1"]
    p = plan(view([], total_tokens=35), waiting=new, retracted=back)
    assert [r.request_id for r in p.resume] == ["r1"] and p.admit == []
    p = plan(view([], total_tokens=40), waiting=new, retracted=back)  # room for both: both go
    assert [r.request_id for r in p.resume] == ["r1"] and [r.request_id for r in p.admit] == ["n1"]


def test_retracted_requests_resume_oldest_retraction_first() -> None:
    back = [request("r1", 20, 4, retractions=1), request("r2", 10, 2, retractions=1)]
    assert [r.request_id for r in plan(view([]), retracted=back).resume] == ["r1", "r2"]


def test_a_retracted_request_that_does_not_fit_still_blocks_admissions() -> None:
    back = [request("big", 200, 10, retractions=1)]
    p = plan(view([], total_tokens=128), waiting=[request("n1", 8)], retracted=back)
    assert p.resume == [] and p.admit == [] and p.is_empty()


def test_resumes_stop_at_the_free_state_slots() -> None:
    back = [request(f"r{i}", 4, 1, retractions=1) for i in range(3)]
    p = plan(view([request("a", 4, 1)], total_slots=3), retracted=back)
    assert [r.request_id for r in p.resume] == ["r0", "r1"]


def test_admissions_go_to_the_worker_with_the_most_room() -> None:
    running = [request("a", 64, 1)]  # this worker: 65/128 tokens free, room ~0.5
    waiting = [request("n1", 8), request("n2", 8)]
    v = view(running, total_tokens=128)
    assert plan(v, waiting=waiting, best_room_elsewhere=0.9).admit == []
    assert [r.request_id for r in plan(v, waiting=waiting, best_room_elsewhere=0.3).admit] == ["n1", "n2"]
    assert len(plan(v, waiting=waiting, best_room_elsewhere=v.room()).admit) == 2  # a tie admits


def test_admissions_are_first_come_first_served_and_stop_at_the_first_misfit() -> None:
    waiting = [request("n1", 40), request("big", 100), request("n3", 4)]
    p = plan(view([], total_tokens=128), waiting=waiting)
    assert [r.request_id for r in p.admit] == ["n1"]  # n3 would fit, but does not jump the queue


def test_max_batch_size_caps_resumes_and_admissions() -> None:
    p = plan(view([request("a", 4, 1)]), waiting=[request(f"n{i}", 4) for i in range(5)], max_batch_size=3)
    assert len(p.admit) == 2


# ------------------------------------------------------------------------------ reserve mode


def simulate(reserve: bool, seed: int, total_tokens: int = 160, slots: int = 4) -> dict:
    """Run a random workload through plan_step on one idealised worker; returns what happened.

    The fake worker does what the real one does with a plan: victims free their KV, resumes
    and admissions take `num_cached` tokens (+1 for the prefill's sampled token), each decode
    step adds one token per running request, finished requests free everything."""
    rng = random.Random(seed)
    waiting = deque(request(f"q{i}", rng.randint(8, 48), max_new=rng.randint(16, 48), arrival_s=float(i))
                    for i in range(16))
    retracted: deque[Request] = deque()
    running: list[Request] = []
    worst_reserved, victims, overflows = 0, 0, 0
    for calls in range(10_000):
        if not (waiting or retracted or running):
            break
        v = view(running, total_tokens, slots, calls=calls)
        p = plan_step(v, waiting, retracted, SchedulerConfig(), -1.0, reserve)
        victims += len(p.victims)
        running = [r for r in running if r not in p.victims]
        retracted.extend(p.victims)
        for r in p.resume + p.admit:
            r.output_ids.append(7)  # the prefill samples one token
            running.append(r)
        for _ in range(p.decode_steps):
            running = [r for r in running if r.remaining > 0]
            for r in running:
                r.output_ids.append(7)
        running = [r for r in running if r.remaining > 0]
        overflows += sum(r.num_cached for r in running) > total_tokens
        worst_reserved = max(worst_reserved, sum(len(r.prompt_ids) + r.sampling.max_new_tokens for r in running))
    else:
        raise AssertionError("the simulation did not finish")
    return {"victims": victims, "overflows": overflows, "worst_reserved": worst_reserved}


@pytest.mark.parametrize("seed", range(5))
def test_reserve_mode_never_overcommits(seed: int) -> None:
    out = simulate(reserve=True, seed=seed)
    assert out["victims"] == 0 and out["overflows"] == 0
    assert out["worst_reserved"] <= 160  # every running request's whole budget fits at once


def test_overcommit_mode_does_overcommit_on_the_same_workloads() -> None:
    """The control for the test above: without reserve the same workloads need retractions."""
    outs = [simulate(reserve=False, seed=seed) for seed in range(5)]
    assert all(o["overflows"] == 0 for o in outs)  # retraction keeps the pool itself in bounds
    assert sum(o["victims"] for o in outs) > 0
    assert max(o["worst_reserved"] for o in outs) > 160


# ------------------------------------------------------------------------------ cost model


def test_cost_model_charges_a_cross_node_transfer_only_when_the_cluster_has_several_nodes() -> None:
    from raysched.scheduler.policy import choose_retract_mode, snapshot_cost_s

    copy_bps, tokens_per_s = 1e9, 1000.0
    assert snapshot_cost_s(3_000_000, copy_bps, cross_node=False) == pytest.approx(0.009)
    assert snapshot_cost_s(3_000_000, copy_bps, cross_node=True) == pytest.approx(0.012)
    # 10 tokens re-prefill in 10 ms: 3 copies of 3 MB (9 ms) win, 4 copies (12 ms) lose
    assert choose_retract_mode(10, 3_000_000, copy_bps, tokens_per_s, cross_node=False) == "snapshot"
    assert choose_retract_mode(10, 3_000_000, copy_bps, tokens_per_s, cross_node=True) == "recompute"


# ------------------------------------------------------------------------------ priorities


def urgent(rid: str, prompt_len: int, priority: int = -1, **kw) -> Request:
    r = request(rid, prompt_len, **kw)
    r.priority = priority
    return r


def full_view(priorities: list[int], retractions: int = 0) -> WorkerView:
    """A worker with 100 of 256 tokens free: four running requests of 39 tokens each."""
    running = []
    for i, p in enumerate(priorities):
        r = request(f"run-{i}", 30, generated=10, retractions=retractions, arrival_s=i)
        r.priority = p
        running.append(r)
    return view(running, total_tokens=256)


def test_an_urgent_request_with_no_room_anywhere_preempts_the_least_urgent_running_ones() -> None:
    v = full_view([0, 5, 1, 5])
    head = urgent("urgent", 150)
    other = full_view([0, 0, 0, 0])
    p = plan_step(v, deque([head]), deque(), SchedulerConfig(), -1.0, False, (other,))
    assert p.admit == [head] and p.preempted == len(p.victims)
    assert {r.priority for r in p.victims} == {5}  # the two least urgent, nobody else
    assert len(p.victims) == 2


def test_preemption_takes_the_next_priority_only_when_the_least_urgent_do_not_make_room() -> None:
    v = full_view([0, 5, 1, 5])
    head = urgent("urgent", 200)  # 100 free + 2 x 39 is not enough: the priority-1 one goes too
    p = plan_step(v, deque([head]), deque(), SchedulerConfig(), -1.0, False, ())
    assert [r.priority for r in p.victims] == [5, 5, 1] and p.admit == [head]


def test_no_preemption_when_another_worker_has_room() -> None:
    v = full_view([5, 5, 5, 5])
    roomy = view([], total_tokens=256)
    head = urgent("urgent", 150)
    p = plan_step(v, deque([head]), deque(), SchedulerConfig(), 1.0, False, (roomy,))
    assert p.victims == [] and p.admit == [] and p.preempted == 0


def test_no_preemption_among_equal_priorities_or_when_switched_off() -> None:
    head = urgent("urgent", 150, priority=0)
    assert plan_step(full_view([0, 0, 0, 0]), deque([head]), deque(), SchedulerConfig(), -1.0).victims == []
    head = urgent("urgent", 150)
    p = plan_step(full_view([5, 5, 5, 5]), deque([head]), deque(), SchedulerConfig(preemption=False), -1.0)
    assert p.victims == [] and p.admit == []


def test_protected_requests_are_not_preempted() -> None:
    head = urgent("urgent", 150)
    p = plan_step(full_view([5, 5, 5, 5], retractions=2), deque([head]), deque(),
                  SchedulerConfig(max_retractions=2), -1.0)
    assert p.victims == [] and p.admit == []  # starvation protection holds for the preempted


def test_no_preemption_when_every_eligible_victim_would_not_make_room() -> None:
    head = urgent("urgent", 250, priority=0)  # only the priority-5 one may go: not enough
    p = plan_step(full_view([0, 0, 0, 5]), deque([head]), deque(), SchedulerConfig(), -1.0)
    assert p.victims == [] and p.admit == []


def test_an_urgent_waiting_request_goes_before_less_urgent_retracted_ones() -> None:
    v = view([], total_tokens=256)
    back = urgent("back", 20, priority=3, generated=5, retractions=1)
    head = urgent("urgent", 20, priority=0)
    p = plan(v, waiting=[head], retracted=[back])
    assert p.admit == [head] and p.resume == []
    same = urgent("same", 20, priority=3)  # equally urgent: the retracted one goes first
    p = plan(v, waiting=[same], retracted=[back])
    assert p.resume == [back] and p.admit == [same]  # resumed first, then admitted


def test_enqueue_keeps_priority_order_and_fcfs_within_a_priority() -> None:
    from raysched.request import enqueue

    q: deque[Request] = deque()
    for rid, prio in [("a", 0), ("b", 2), ("c", 0), ("d", -1), ("e", 2)]:
        enqueue(q, urgent(rid, 4, priority=prio))
    assert [r.request_id for r in q] == ["d", "a", "c", "b", "e"]
    enqueue(q, urgent("f", 4, priority=0), front=True)
    assert [r.request_id for r in q] == ["d", "f", "a", "c", "b", "e"]


def test_enqueue_equals_a_sorted_insert_for_random_priorities_and_ends() -> None:
    """`enqueue` appends at either end without scanning when it can; the order it keeps must be
    the stable sort's: priority, then first come (a `front` insert before its equals). The
    reference is an independent stable sort of (priority, rank) over every insert so far."""
    import random

    from raysched.request import enqueue

    rng = random.Random(3)
    q: deque[Request] = deque()
    ranked: list[tuple[int, float, str]] = []
    back, front = 0.0, 0.0
    for i in range(400):
        prio, at_front = rng.choice([-1, 0, 0, 0, 2, 5]), rng.random() < 0.3
        if at_front:
            front -= 1.0
            rank = front
        else:
            back += 1.0
            rank = back
        enqueue(q, urgent(f"r{i}", 4, priority=prio), front=at_front)
        ranked.append((prio, rank, f"r{i}"))
    assert [r.request_id for r in q] == [rid for _, _, rid in sorted(ranked)]


def test_overflow_victims_are_the_least_urgent_first() -> None:
    a, b, c = (request(x, 30, generated=10, arrival_s=i) for i, x in enumerate("abc"))
    a.priority, b.priority, c.priority = 0, 7, 3
    v = view([a, b, c], total_tokens=256, free_tokens=0)
    p = plan(v, decode_steps_per_call=1)
    assert p.victims[0] is b


# ------------------------------------------------------------------------------ victims with nothing computed


class FeedReference:
    """An independent model of one worker's pools and prefill order, written from `Engine.prefill`'s
    contract (not from the planner): an admitted prompt takes KV for all its tokens at once; a call
    feeds its new prompts first, then those still prefilling in the order they arrived, each by a
    whole chunk (up to the next multiple of `chunk` from token 0) until `budget` tokens are fed, the
    first always; a prompt fed to its end samples a token and decodes from the next call on. A
    snapshot keeps the tokens fed so far (`computed`) and is refused when there are none."""

    def __init__(self, kv: int, slots: int, chunk: int, budget: int) -> None:
        self.kv, self.slots, self.chunk, self.budget = kv, slots, chunk, budget
        self.held: dict[str, int] = {}  # id -> KV tokens held
        self.computed: dict[str, int] = {}  # id -> tokens fed, while prefilling (insertion order)
        self.nothing_computed: list[str] = []  # victims that had nothing to snapshot

    def snapshot(self, r: Request) -> int | None:
        """Take `r` off the worker: its computed tokens (None: decoding, all of them)."""
        self.held.pop(r.request_id)
        fed = self.computed.pop(r.request_id, None)
        if fed == 0:
            self.nothing_computed.append(r.request_id)
        return fed

    def call(self, resumed: list[tuple[Request, int | None]], new: list[Request], decode_steps: int) -> None:
        for r, fed in resumed:  # a restored mid-prefill snapshot joins the prefilling ones
            self.held[r.request_id] = r.num_tokens if fed is not None else r.num_cached
            if fed is not None:
                self.computed[r.request_id] = fed
        waiting = list(self.computed)
        for r in new:
            self.held[r.request_id] = r.num_tokens
            self.computed[r.request_id] = 0
        spent, by_id = 0, {r.request_id: r for r in new}
        for rid in [r.request_id for r in new] + waiting:
            if self.budget and spent and spent >= self.budget:
                break
            r = by_id.get(rid) or self.requests[rid]
            n = min(self.chunk - self.computed[rid] % self.chunk, r.num_tokens - self.computed[rid])
            self.computed[rid] += n
            spent += n
            if self.computed[rid] == r.num_tokens:
                del self.computed[rid]
                r.output_ids.append(7)  # the prefill samples a token
        for _ in range(decode_steps):
            for rid in list(self.held):
                r = self.requests[rid]
                if rid not in self.computed and r.remaining > 0:
                    self.held[rid] += 1
                    r.output_ids.append(7)

    def sync(self, v: WorkerView, running: list[Request]) -> None:
        """The view after a call (ground truth, as `Dispatcher.apply` sets it); finished ones leave."""
        for r in [r for r in running if r.remaining <= 0 and r.request_id not in self.computed]:
            running.remove(r)
            del self.held[r.request_id]
        v.running = list(running)
        v.free_tokens = self.kv - sum(self.held.values())
        v.free_slots = self.slots - len(self.held)
        v.allocated = dict(self.held)


def run_with_reference(seed: int, **cfg) -> tuple[FeedReference, int, int]:
    """Long prompts prefilled in chunks, one forced retraction per call, on one worker; returns the
    reference, the victims taken mid-prefill with something computed, and the requests finished."""
    rng = random.Random(seed)
    config = SchedulerConfig(force_retract_every=1, decode_steps_per_call=2, prefill_chunk_tokens=16,
                             prefill_budget_tokens=32, max_retractions=3, **cfg)
    ref = FeedReference(kv=600, slots=6, chunk=16, budget=32)
    reqs = [request(f"q{i}", rng.randint(10, 90), max_new=rng.randint(2, 12), arrival_s=float(i)) for i in range(24)]
    ref.requests = {r.request_id: r for r in reqs}
    waiting, retracted, running = deque(reqs), deque(), []
    snapshots: dict[str, int | None] = {}
    v = WorkerView(0, 600, 6, 600, 6, 1)
    mid_prefill = 0
    for calls in range(2000):
        if not (waiting or retracted or running):
            break
        v.calls = calls
        p = plan_step(v, waiting, retracted, config, -1.0)
        v.forced_round = p.forced_round or v.forced_round
        for r in p.victims:
            running.remove(r)
            r.retractions += 1
            fed = ref.snapshot(r)
            mid_prefill += bool(fed)
            r.recompute = fed == 0  # nothing to snapshot: it prefills again
            snapshots[r.request_id] = fed
            retracted.append(r)
        resumed = [(r, snapshots.pop(r.request_id)) for r in p.resume if not r.recompute]
        running += p.resume + p.admit
        ref.call(resumed, [r for r in p.resume if r.recompute] + p.admit, p.decode_steps)
        ref.sync(v, running)
    else:
        raise AssertionError("the simulation did not finish")
    return ref, mid_prefill, sum(r.remaining <= 0 for r in reqs)


@pytest.mark.parametrize("seed", range(4))
def test_a_victim_always_has_something_computed(seed: int) -> None:
    """Every victim the planner picks has fed at least one chunk (or decodes), by the reference's
    account of the worker; prefilling requests that were fed are still picked (the planner does
    not simply spare every prefilling request), and everything finishes."""
    ref, mid_prefill, finished = run_with_reference(seed)
    assert ref.nothing_computed == [] and finished == 24
    assert mid_prefill > 0


def test_control_without_the_unfed_set_victims_with_nothing_computed_are_picked(monkeypatch) -> None:
    """The control: the same runs with `order_victims` blind to the unfed set pick requests whose
    prefill had not started (the workload does reach the case the test above controls)."""
    from raysched.scheduler import planner, policy

    monkeypatch.setattr(planner, "order_victims",
                        lambda running, order, max_retractions, unfed=(): policy.order_victims(running, order,
                                                                                                max_retractions))
    assert sum(len(run_with_reference(seed)[0].nothing_computed) for seed in range(4)) > 0
