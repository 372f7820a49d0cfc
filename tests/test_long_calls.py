"""Long calls on real workers: a call that folds up to `scheduler.fold_calls` calls' decode steps,
and the interrupt that ends it when something needs a decision (see `Dispatcher.fold_factor`,
`Dispatcher.interrupt_for_waiting`, `Worker.interrupt`).

The reference is an uninterrupted in-process run of the same requests (`tests.exactness`).
"""

from __future__ import annotations

import time

import pytest
import ray

from raysched.sampling import SamplingParams
from raysched.workload import RequestSpec
from tests.exactness import assert_idle, reference, serving


def spec(rid: str, prompt: list[int], max_new: int, temperature: float = 0.0) -> RequestSpec:
    return RequestSpec(rid, tuple(prompt), SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=7))


FIRST = [spec("a", [5, 9, 13, 2, 7], 160), spec("b", [3, 1, 4, 1, 5, 9, 2, 6], 150, temperature=0.8)]
LATER = [spec("c", [8, 6, 7, 5, 3, 0, 9], 24), spec("d", [2, 7, 1, 8], 20, temperature=0.8)]


def test_a_request_that_joins_a_long_call_gets_the_logits_of_an_uninterrupted_run():
    """`Worker.join` on the real engine (in process): a long call that takes joins prefills the
    joined request between two of its decode steps, and it decodes in the call's batch from then
    on. Every logit of both requests, across that call and the next, is `torch.equal` to an
    uninterrupted run of the two (its own engine, the reference).
    Control: the same check on a join whose prompt differs in its last token fails."""
    import torch

    from actors.engine import Sequence, build_engine
    from actors.worker import Worker
    from raysched.config import load_serve_config
    from raysched.messages import PrefillItem, StepPlan

    specs = [FIRST[0], LATER[1]]  # greedy; sampled (the counter-based sampler)
    for s in specs:
        assert s.sampling.max_new_tokens <= 160
    items = [PrefillItem(s.request_id, s.prompt_ids, len(s.prompt_ids), s.sampling.to_dict()) for s in specs]

    def joined_run(late: PrefillItem) -> Worker:
        w = Worker(load_serve_config({"model": "tiny", "workers": 1, "pool": {"kv_tokens": 1024, "state_slots": 4},
                                      "state_cache": {"enabled": False}}), 0)
        w.engine.record_logits = True
        stream = w.step_stream(StepPlan(prefill=(items[0],), decode_steps=12, call_id=1, joins=True))
        next(stream), next(stream), next(stream)  # the prefill's token, decode steps 0 and 1
        w.join(1, [late])
        *_, result = stream
        assert result.joined == [late.request_id] and len(result.new_tokens[late.request_id]) == 11
        while w.engine.running:
            w.step(StepPlan(decode_steps=40, call_id=2))
        return w

    ref = build_engine("tiny", device="cpu", record_logits=True, kv_tokens=1024, state_slots=4)
    ref.prefill([Sequence(s.request_id, list(s.prompt_ids), len(s.prompt_ids), s.sampling) for s in specs])
    while ref.running:
        ref.decode(1)
    got = joined_run(items[1]).engine
    for s in specs:
        rid = s.request_id
        assert len(got.logits[rid]) == len(ref.logits[rid]) == s.sampling.max_new_tokens
        assert all(torch.equal(x, y) for x, y in zip(got.logits[rid], ref.logits[rid])), rid
    other = PrefillItem("d", items[1].token_ids[:-1] + (items[1].token_ids[-1] + 1,), items[1].prompt_len,
                        items[1].sampling)
    changed = joined_run(other).engine.logits["d"]
    assert not all(torch.equal(x, y) for x, y in zip(changed, ref.logits["d"]))


def test_a_joined_prompt_longer_than_a_chunk_is_fed_a_chunk_a_step_and_decodes_inside_the_call():
    """A prompt that joins a long call and is longer than the plan's prefill chunk and budget:
    the call feeds it a chunk between each two decode steps until its prompt is in, and it
    decodes in the call's batch from then on (before, the rest of its prompt waited for the
    call's end, holding a slot and decoding nothing: a long call with finish notices may go on
    for hundreds of steps). Its logits, and the other request's, across that call and the next
    are `torch.equal` to an uncached run that prefills it in the same chunks (the reference).
    Control: a call that ends before the last chunk leaves it prefilling, which the check sees."""
    import torch

    from actors.engine import Sequence, build_engine
    from actors.worker import Worker
    from raysched.config import load_serve_config
    from raysched.messages import PrefillItem, StepPlan

    chunk, steps = 32, 12
    late = spec("long-prompt", [(7 * i + 3) % 97 for i in range(2 * chunk + 9)], 16, temperature=0.8)
    specs = [FIRST[0], late]
    items = [PrefillItem(s.request_id, s.prompt_ids, len(s.prompt_ids), s.sampling.to_dict()) for s in specs]
    config = load_serve_config({"model": "tiny", "workers": 1, "pool": {"kv_tokens": 1024, "state_slots": 4},
                                "state_cache": {"enabled": False}})

    def joined_call(decode_steps: int) -> tuple[Worker, object]:
        w = Worker(config, 0)
        w.engine.record_logits = True
        stream = w.step_stream(StepPlan(prefill=(items[0],), decode_steps=decode_steps, call_id=1, joins=True,
                                        prefill_chunk_tokens=chunk, prefill_budget_tokens=chunk))
        next(stream), next(stream)  # the prefill's token, decode step 0
        w.join(1, [items[1]])
        *_, result = stream
        return w, result

    w, result = joined_call(steps)
    # taken after step 0: a chunk after steps 0, 1 and 2 (the last one samples its first token),
    # then it decodes in steps 3 to 11
    assert result.joined == [late.request_id] and late.request_id not in w.engine.prefilling
    assert len(result.new_tokens[late.request_id]) == 1 + (steps - 3)
    while w.engine.running:
        w.step(StepPlan(decode_steps=40, call_id=2))

    ref = build_engine("tiny", device="cpu", record_logits=True, kv_tokens=1024, state_slots=4)
    ref.prefill([Sequence(s.request_id, list(s.prompt_ids), len(s.prompt_ids), s.sampling) for s in specs], chunk)
    while ref.prefilling:
        ref.prefill(list(ref.prefilling), chunk)
    while ref.running:
        ref.decode(1)
    for s in specs:
        rid = s.request_id
        assert len(w.engine.logits[rid]) == len(ref.logits[rid]) == s.sampling.max_new_tokens
        assert all(torch.equal(x, y) for x, y in zip(w.engine.logits[rid], ref.logits[rid])), rid
    cut, cut_result = joined_call(2)  # ends after step 1: two chunks fed, the third not
    assert late.request_id in cut.engine.prefilling and late.request_id not in cut_result.new_tokens


def test_a_long_call_with_notices_decodes_on_past_a_finish_with_exact_tokens():
    """`StepPlan.notices` on the real worker (in process): the long call decodes on after the
    step in which a request finished, and the scheduler's handle gets one `call_finished`
    with that request's tokens of the call; every token is the reference's (an uninterrupted
    run of the two). Control: without `notices` the call ends at that step."""
    import dataclasses

    from actors.worker import Worker
    from raysched.config import load_serve_config
    from raysched.messages import PrefillItem, StepPlan
    from tests.test_sim import NoticeBox

    specs = [spec("short", [5, 9, 13, 2, 7], 6), spec("long", [3, 1, 4, 1, 5, 9, 2, 6], 30, temperature=0.8)]
    want = reference(specs)
    items = tuple(PrefillItem(s.request_id, s.prompt_ids, len(s.prompt_ids), s.sampling.to_dict()) for s in specs)
    config = load_serve_config({"model": "tiny", "workers": 1, "pool": {"kv_tokens": 1024, "state_slots": 4},
                                "state_cache": {"enabled": False}})
    box = NoticeBox()
    plan = StepPlan(prefill=items, decode_steps=20, call_id=1, joins=True, end_at_finish=True, notices=box, notice_id=4)
    *_, result = Worker(config, 0).step_stream(plan)
    assert box.got == [(0, 4, {"short": ("length", want["short"])})]
    assert result.new_tokens["long"] == want["long"][:21] and result.finished == {"short": "length"}
    *_, ended = Worker(config, 0).step_stream(dataclasses.replace(plan, notices=None))
    assert len(ended.new_tokens["long"]) == 6


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=120 << 20)
    yield
    ray.shutdown()


@pytest.mark.parametrize("fold_calls, join", [(8, False), (8, True), (2, False)],
                         ids=["long-calls", "joins", "control-one-successor"])
def test_requests_arriving_during_a_long_call_interrupt_it_and_every_token_stays_exact(local_ray, fold_calls, join):
    """Two long requests decode on one worker in long calls (32 steps: nothing waits); two more
    arrive mid-call, the worker has free slots, so the call is interrupted and they start at
    once; with `join_long_calls`, they start inside the call instead (`Worker.join`), which runs
    on. Every request ends with the reference's tokens, and the pools end empty. Control:
    `fold_calls: 2` folds one successor (8 steps), never a long call: nothing is interrupted or
    joined, the same tokens."""
    raw = {"model": "tiny", "workers": 1, "pool": {"kv_tokens": 1024, "state_slots": 4},
           "scheduler": {"decode_steps_per_call": 4, "fold_calls": fold_calls, "interrupt_after_ms": 0,
                         "join_long_calls": join, "join_after_ms": 0},
           "state_cache": {"enabled": False}}
    with serving(raw) as client:
        handles = {s.request_id: client.submit(list(s.prompt_ids), s.sampling, s.request_id) for s in FIRST}
        deadline = time.monotonic() + 120
        while client.stats()["tokens"] < 40 and time.monotonic() < deadline:  # past the admission call
            time.sleep(0.02)
        handles.update({s.request_id: client.submit(list(s.prompt_ids), s.sampling, s.request_id) for s in LATER})
        records = {rid: h.result(timeout=300) for rid, h in handles.items()}
        stats = client.stats()
        idle = client.check_idle()
    want = reference(FIRST + LATER)
    assert {rid: r["token_ids"] for rid, r in records.items()} == want
    assert_idle(idle)
    if join:
        assert stats["joins"] >= 1 and stats["interrupted_calls"] == 0 and stats["folded_calls"] >= 1
    elif fold_calls == 8:
        assert stats["interrupted_calls"] >= 1 and stats["joins"] == 0 and stats["folded_calls"] >= 1
    else:
        assert stats["interrupted_calls"] == 0 and stats["joins"] == 0 and stats["folded_calls"] >= 1
