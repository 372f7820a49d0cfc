"""Pool accounting: exhaustion is an answer, misuse is an error, and nothing leaks."""

import random

import pytest
import torch

from actors.config import ModelConfig
from actors.pools import HybridPool, PoolError

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  attn_layer_indices=(1,), num_attention_heads=4, num_key_value_heads=2,
                  mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8)


def make_pool(kv_tokens=64, slots=4, page_size=1) -> HybridPool:
    return HybridPool(CFG, kv_tokens, slots, torch.float32, "cpu", page_size)


def test_pool_tensor_shapes_follow_the_layout():
    pool = make_pool(kv_tokens=10, slots=3, page_size=4)
    assert pool.k.shape == (1, 12, 2, 8)  # 10 tokens rounded up to 3 pages of 4
    assert pool.conv.shape == (2, 3, CFG.conv_dim, 3)
    assert pool.ssm.shape == (2, 3, 4, 16, 8) and pool.ssm.dtype == torch.float32


def test_admit_takes_both_pools_or_neither():
    pool = make_pool(kv_tokens=10, slots=2)
    assert pool.admit("a", 8)
    assert not pool.admit("b", 3)  # KV exhausted: reported, nothing taken
    assert pool.usage().state_free_slots == 1
    assert pool.admit("b", 2)
    assert not pool.admit("c", 0)  # Mamba slots exhausted
    assert pool.usage().kv_free_tokens == 0


def test_extend_reports_exhaustion_without_taking_anything():
    pool = make_pool(kv_tokens=8, slots=2)
    pool.admit("a", 4)
    pool.admit("b", 3)
    assert not pool.extend("a", 6)
    assert pool.kv.num_request_tokens("a") == 4 and pool.kv.num_free_tokens == 1
    assert pool.extend("a", 5)


def test_double_free_and_foreign_free_raise_clear_errors():
    pool = make_pool()
    pool.admit("a", 4)
    pool.release("a")
    with pytest.raises(PoolError, match="'a'.*double free"):
        pool.release("a")
    with pytest.raises(PoolError, match="'ghost'"):
        pool.release("ghost")
    assert pool.admit("b", 1)
    with pytest.raises(PoolError, match="already holds"):
        pool.mamba.allocate("b")


def test_token_slots_follow_pages_in_order():
    pool = make_pool(kv_tokens=16, slots=2, page_size=4)
    pool.admit("a", 3)
    pool.admit("b", 4)
    pool.extend("a", 6)
    assert pool.kv.token_slots("a").tolist() == [0, 1, 2, 3, 8, 9]
    assert pool.kv.token_slots("b").tolist() == [4, 5, 6, 7]


def test_new_mamba_slot_starts_from_zero_state():
    pool = make_pool(slots=1)
    pool.admit("a", 1)
    pool.conv[:, pool.mamba.slot("a")] = 1.0
    pool.ssm[:, pool.mamba.slot("a")] = 1.0
    pool.release("a")
    pool.admit("b", 1)
    assert pool.conv[:, pool.mamba.slot("b")].abs().sum() == 0
    assert pool.ssm[:, pool.mamba.slot("b")].abs().sum() == 0


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(5))
def test_random_operation_sequences_return_every_slot(seed, page_size):
    rng = random.Random(seed)
    pool = make_pool(kv_tokens=48, slots=5, page_size=page_size)
    live: dict[str, int] = {}
    for step in range(300):
        op = rng.choice(["admit", "extend", "release"])
        if op == "admit":
            n = rng.randint(1, 20)
            if pool.admit(f"r{step}", n):
                live[f"r{step}"] = n
        elif op == "extend" and live:
            rid = rng.choice(sorted(live))
            before = pool.kv.token_slots(rid).tolist()
            if pool.extend(rid, live[rid] + rng.randint(1, 6)):
                live[rid] = pool.kv.num_request_tokens(rid)
            assert pool.kv.token_slots(rid).tolist()[: len(before)] == before  # grown in place
        elif live:
            rid = rng.choice(sorted(live))
            pool.release(rid)
            del live[rid]
        slots = [pool.kv.token_slots(rid).tolist() for rid in live]
        assert [len(s) for s in slots] == list(live.values())
        flat = [t for s in slots for t in s]
        assert len(set(flat)) == len(flat) and all(0 <= t < pool.kv.num_tokens for t in flat)
        held = sum(-(-n // page_size) * page_size for n in live.values())
        assert pool.kv.num_free_tokens == pool.kv.num_tokens - held
        assert pool.mamba.num_free_slots == 5 - len(live)
    for rid in list(live):
        pool.release(rid)
    assert pool.is_empty()


def test_capacity_from_a_byte_budget():
    per_token = CFG.kv_bytes_per_token(4)
    per_slot = CFG.state_bytes_per_slot(4)
    pool = HybridPool.from_budget(CFG, 4 * per_slot + 100 * per_token, 4, torch.float32)
    assert pool.kv.num_tokens == 100 and pool.mamba.num_slots == 4
    with pytest.raises(ValueError, match="cannot hold"):
        HybridPool.from_budget(CFG, 3 * per_slot, 4, torch.float32)
