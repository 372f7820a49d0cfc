"""The turn cache: parked states, prefix matching, and exactness of restore + suffix prefill.

- The index alone (pure): `tests/test_prefix_index.py`.
- Through the worker (no Ray): a finished turn's state and a prompt's end state, parked by
  `Worker.step` and restored for the next turn, give first-token logits within 1e-4 (fp32) of a
  full prefill of the whole history and the same greedy tokens; negative control: another
  conversation's state under this conversation's tokens changes the tokens.
- On a multi-node cluster (see `TestOnCluster`): turn 2 restores turn 1's state on the other node;
  the worker that parked it is killed and the next turns still get the right tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raysched.config import PoolConfig, SchedulerConfig, ServeConfig, StateCacheConfig
from raysched.messages import PrefillItem, StepPlan
from raysched.sampling import SamplingParams

TOL = 1e-4
GREEDY = SamplingParams(max_new_tokens=12)


# ---------------------------------------------------------------------------- through the worker


def make_worker(kv_tokens: int = 2048):
    from actors.worker import Worker

    cfg = ServeConfig(model="tiny", device="cpu", pool=PoolConfig(kv_tokens=kv_tokens, state_slots=4))
    w = Worker(cfg, 0)
    w.engine.record_logits = True
    return w


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(w, rid: str, tokens: list[int], snap=None, park: int = 0) -> tuple[list[int], torch.Tensor, dict]:
    """Prefill (on top of `snap` when given) and decode to the end; (tokens, first-token logits,
    {kind: parked snapshot})."""
    item = PrefillItem(rid, tuple(tokens), len(tokens), GREEDY.to_dict())
    plan = StepPlan(prefill=(item,), decode_steps=GREEDY.max_new_tokens, prefix=(rid,) if snap else (),
                    park_min_tokens=park)
    result = w.step(plan, *([snap] if snap else []))
    assert result.finished.get(rid) == "length" and not result.prefix_failed, result
    assert result.cached.get(rid, 0) == (snap.num_cached_tokens if snap else 0)
    keys = [p.key for p in result.parked]
    snaps = w.take_parked(keys) if keys else ()
    snaps = (snaps,) if len(keys) == 1 else snaps
    return result.new_tokens[rid], w.engine.logits[rid][0], {k[1]: s for k, s in zip(keys, snaps)}


@pytest.fixture(scope="module")
def turn1():
    """Conversation A's first turn on a worker that parks: (worker, prompt, output, parked)."""
    w = make_worker()
    p1 = prompt(80, seed=1)
    out, _, parked = run(w, "a1", p1, park=16)
    assert set(parked) == {"prompt", "finished"}
    assert parked["finished"].num_cached_tokens == len(p1) + len(out) - 1
    assert parked["prompt"].num_cached_tokens == len(p1)
    assert w.is_idle()
    return w, p1, out, parked


def test_a_prompt_prefilled_in_chunks_parks_its_end_state_in_the_call_that_finishes_it(turn1) -> None:
    """A prompt longer than a chunk finishes its prefill in a later call than the one that
    admitted it: its prompt-end state is parked then, the same state as an unchunked prefill's
    (within the chunking tolerance), with the K/V after its last whole chunk (the chunks before
    are parked as blocks at the chunk boundaries, one point each); a recompute (a history with
    outputs) parks no prompt end."""
    _, p1, _, parked = turn1
    w = make_worker()
    item = PrefillItem("long", tuple(p1), len(p1), GREEDY.to_dict())
    plan, calls = StepPlan(prefill=(item,), park_min_tokens=16, prefill_chunk_tokens=32), []
    while not calls or not calls[-1].new_tokens:
        calls.append(w.step(plan))
        plan = StepPlan(park_min_tokens=16, prefill_chunk_tokens=32)
    assert len(calls) == 3  # 80 tokens: 32 + 32 + 16
    assert [[(p.kind, p.num_tokens, p.kv_from, p.blocks) for p in c.parked] for c in calls] == [
        [("chunk", 32, 32, ((0, 32 * 256),))], [("chunk", 64, 64, ((1, 32 * 256),))], [("prompt", 80, 64, ())]]
    chunked = w.take_parked([("long", "prompt", len(p1))])
    assert chunked.num_cached_tokens == len(p1) and chunked.token_ids[:len(p1)] == tuple(p1)
    assert chunked.part("kv").shape[2] == 16 and not chunked.exact
    assert (chunked.part("kv") - parked["prompt"].part("kv")[:, :, 64:]).abs().max().item() <= TOL
    w.step(StepPlan(drop=("long",)))
    w.discard_parked([p.key for c in calls[:2] for p in c.parked] + [("long", "block", i) for i in (0, 1)])
    assert not w._parked
    redo = PrefillItem("redo", tuple(p1) + (5, 6), len(p1), GREEDY.to_dict())  # prompt + 2 outputs
    assert w.step(StepPlan(prefill=(redo,), park_min_tokens=16)).parked == []


def test_a_finished_turn_restored_matches_a_full_prefill_of_the_history(turn1) -> None:
    w, p1, out1, parked = turn1
    p2 = p1 + out1 + prompt(40, seed=2)
    cached_toks, cached_logits, _ = run(w, "a2-cached", p2, parked["finished"])
    full_toks, full_logits, _ = run(make_worker(), "a2-full", p2)
    diff = (cached_logits - full_logits).abs().max().item()
    print(f"\nfinished-turn hit: {len(p1) + len(out1) - 1} of {len(p2)} tokens restored, "
          f"first-token logits max |diff| {diff:.2e}")
    assert diff <= TOL
    assert cached_toks == full_toks


def test_a_prompt_end_state_serves_a_history_whose_answer_was_re_rendered(turn1) -> None:
    w, p1, out1, parked = turn1
    p2 = p1 + [7, 8, 9] + out1[3:] + prompt(30, seed=3)  # the answer came back re-tokenized
    cached_toks, cached_logits, _ = run(w, "a2b-cached", p2, parked["prompt"])
    full_toks, full_logits, _ = run(make_worker(), "a2b-full", p2)
    diff = (cached_logits - full_logits).abs().max().item()
    print(f"\nprompt-end hit: {len(p1)} of {len(p2)} tokens restored, max |diff| {diff:.2e}")
    assert diff <= TOL and cached_toks == full_toks


def test_negative_control_another_conversations_state_changes_the_tokens(turn1) -> None:
    w, p1, out1, parked = turn1
    other = make_worker()
    _, _, parked_b = run(other, "b1", prompt(80, seed=9), park=16)
    forged = dataclasses.replace(parked_b["prompt"], token_ids=parked["prompt"].token_ids)  # B's state, A's tokens
    p2 = p1 + out1 + prompt(40, seed=2)
    wrong_toks, wrong_logits, _ = run(w, "a2-wrong", p2, forged)
    full_toks, full_logits, _ = run(other, "a2-ref", p2)
    assert (wrong_logits - full_logits).abs().max().item() > 100 * TOL
    assert wrong_toks != full_toks


def test_a_state_that_does_not_match_is_refused_and_prefilled_in_full(turn1) -> None:
    w, p1, out1, parked = turn1
    p2 = [p1[0] + 1] + p1[1:] + out1 + [1, 2, 3]  # first token differs from the parked prefix
    item = PrefillItem("mismatch", tuple(p2), len(p2), GREEDY.to_dict())
    result = w.step(StepPlan(prefill=(item,), decode_steps=GREEDY.max_new_tokens, prefix=("mismatch",)),
                    parked["finished"])
    assert "mismatch" in result.prefix_failed and "mismatch" not in result.cached
    full_toks, _, _ = run(make_worker(), "mismatch-ref", p2)
    assert result.new_tokens["mismatch"] == full_toks


# ---------------------------------------------------------------------------- on a cluster


def _worker_handle(client, index: int):
    import ray

    return ray.get(client.scheduler.__ray_call__.remote(lambda s: s.workers[index].handle))


def wait_for_the_handover(client) -> None:
    """Wait until the scheduler holds a finished turn and every parked object it holds exists: the
    worker hands them over in a call of its own after the turn's reply, so a kill before that
    call ran loses them (a miss and a full prefill, exact but not what the test is about)."""
    import ray

    from tests.conftest import wait_until

    wait_until(lambda: client.stats()["state_cache_bytes_finished"] > 0, 60, "the finished turn to be parked")
    refs = ray.get(client.scheduler.__ray_call__.remote(  # every parked point's ref and its blocks'
        lambda s: [ref for p in s.prefix_cache.index._points.values()
                   for ref in [p.ref] + [n.block.ref for n in p.node.chain()]]))
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=60, fetch_local=False)
    assert len(ready) == len(refs), "the parked objects were not handed over in 60 s"


@pytest.mark.usefixtures("multinode_cluster")
class TestOnCluster:
    def test_next_turn_restores_on_the_other_node_after_the_parking_worker_is_killed(self) -> None:
        """Turn 1 runs (and parks) on one worker; that worker is killed; turns 2 and 3 run on the
        other node, restore the parked states from the dead worker's node store (the scheduler
        owns them) and get exactly the tokens of a full prefill of their whole history."""
        import ray

        import raysched
        from raysched.workload import RequestSpec
        from tests.exactness import reference

        cfg = ServeConfig(workers=2, pool=PoolConfig(kv_tokens=1024, state_slots=4),
                          scheduler=SchedulerConfig(replace_failed_workers=False),
                          state_cache=StateCacheConfig(min_tokens=16))
        client = raysched.launch(cfg)
        try:
            p1 = prompt(70, seed=11)
            r1 = client.submit(p1, GREEDY).result(timeout=120)
            producer = r1["workers"][-1]
            wait_for_the_handover(client)
            ray.kill(_worker_handle(client, producer), no_restart=True)
            p2 = p1 + r1["token_ids"] + prompt(30, seed=12)
            r2 = client.submit(p2, GREEDY).result(timeout=120)
            p3 = p2 + r2["token_ids"] + prompt(20, seed=13)
            r3 = client.submit(p3, GREEDY).result(timeout=120)
            stats = client.stats()
            nodes = {w["worker"]: w["node"] for w in client.workers}
        finally:
            client.shutdown()
        specs = [RequestSpec(f"t{i}", tuple(p), GREEDY) for i, p in enumerate((p1, p2, p3))]
        want = reference(specs)
        assert [r1["token_ids"], r2["token_ids"], r3["token_ids"]] == [want["t0"], want["t1"], want["t2"]]
        assert r1["cached_tokens"] == 0
        assert r2["cached_tokens"] == len(p1) + len(r1["token_ids"]) - 1 and r2["cache_kind"] == "finished"
        assert r3["cached_tokens"] == len(p2) + len(r2["token_ids"]) - 1
        assert nodes[r2["workers"][-1]] != nodes[producer]  # restored on the other node
        assert r2["cache_source"] == "other_node" and stats["state_cache_hits_other_node"] >= 1, stats
        assert stats["state_cache_hits"] == 2 and stats["state_cache_hits_finished"] == 2, stats
        assert stats["state_cache_tokens_reused"] == r2["cached_tokens"] + r3["cached_tokens"]
        assert stats["state_cache_misses"] >= 1 and stats["worker_failures"] == 1, stats
        print(f"\nturns 2, 3 restored {r2['cached_tokens']}, {r3['cached_tokens']} tokens after the kill; "
              f"{stats['state_cache_entries']} parked, {stats['state_cache_bytes']} B")

    def test_two_forks_of_one_turn_both_hit_and_the_cache_off_never_hits(self) -> None:
        import raysched
        from raysched.workload import RequestSpec
        from tests.exactness import reference

        records = {}
        for enabled in (True, False):
            cfg = ServeConfig(workers=2, pool=PoolConfig(kv_tokens=1024, state_slots=4),
                              state_cache=StateCacheConfig(enabled=enabled, min_tokens=16))
            client = raysched.launch(cfg)
            try:
                p1 = prompt(60, seed=21)
                r1 = client.submit(p1, GREEDY).result(timeout=120)
                forks = [p1 + r1["token_ids"] + prompt(10 + i, seed=30 + i) for i in range(2)]
                handles = [client.submit(p, GREEDY) for p in forks]
                records[enabled] = [h.result(timeout=120) for h in handles]
                stats = client.stats()
            finally:
                client.shutdown()
            assert stats["state_cache_hits"] == (2 if enabled else 0), stats
        want = reference([RequestSpec(f"f{i}", tuple(p), GREEDY) for i, p in enumerate(forks)])
        for enabled, recs in records.items():
            assert [r["token_ids"] for r in recs] == [want["f0"], want["f1"]], enabled
            assert all((r["cached_tokens"] > 0) == enabled for r in recs)
