"""Retract mid-decode, let others reuse the slots, restore elsewhere: bit-identical continuation.

The reference is the same requests run uninterrupted on a fresh engine. Logits are compared
with torch.equal (bit-exact), tokens with ==. Negative controls prove the comparison catches a
missing Mamba state, a missing KV cache and a flipped payload byte.
"""

import dataclasses

import pytest
import torch

from actors.config import ModelConfig
from actors.engine import Engine, Sequence, build_engine
from actors.snapshot import Snapshot, SnapshotError
from raysched.sampling import SamplingParams

PROMPTS = [[5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 19, 300, 77, 2, 45, 18, 91, 23, 400, 6],  # > chunk (16)
           [1, 2],  # shorter than d_conv
           [300, 200, 100, 50, 25, 12, 6, 3, 1, 0, 9],
           list(range(40, 77))]
GREEDY = SamplingParams(max_new_tokens=24)
SAMPLED = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=1234)


def engine(**kw) -> Engine:
    return build_engine(kw.pop("model", "tiny"), device="cpu", record_logits=True,
                        **{"kv_tokens": 512, "state_slots": 8, **kw})


def sequences(params: SamplingParams, prefix: str = "r") -> list[Sequence]:
    return [Sequence(f"{prefix}{i}", list(p), len(p), dataclasses.replace(params, seed=params.seed + i))
            for i, p in enumerate(PROMPTS)]


def run_to_end(eng: Engine) -> None:
    while eng.running:
        eng.decode(1)


def uninterrupted(params: SamplingParams, **kw) -> Engine:
    eng = engine(**kw)
    seqs = sequences(params)
    eng.prefill(seqs)
    run_to_end(eng)
    eng.outputs = {s.request_id: s.token_ids for s in seqs}
    return eng


def interrupted(params: SamplingParams, k: int, victim: str = "r0", tamper=None, **kw) -> Engine:
    """Snapshot `victim` after k decode steps, run a filler in its slots, restore into new slots."""
    eng = engine(**kw)
    seqs = sequences(params)
    eng.prefill(seqs)
    eng.decode(k)
    old_slots = eng.pool.kv.token_slots(victim).clone()
    old_mamba = eng.pool.mamba.slot(victim)
    snap = eng.snapshot(victim)
    eng.prefill([Sequence("filler", list(range(100, 100 + len(old_slots))), len(old_slots),
                          SamplingParams(max_new_tokens=40))])
    eng.decode(3)
    assert eng.restore(snap)
    seqs = [eng.running[victim] if s.request_id == victim else s for s in seqs]
    assert eng.pool.mamba.slot(victim) != old_mamba
    assert set(eng.pool.kv.token_slots(victim).tolist()).isdisjoint(old_slots.tolist())
    if tamper:
        tamper(eng, victim)
    run_to_end(eng)
    eng.outputs = {s.request_id: s.token_ids for s in seqs}
    return eng


def same_logits(a: Engine, b: Engine, rid: str) -> bool:
    la, lb = a.logits[rid], b.logits[rid]
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("k", [0, 1, 6, 15])
def test_resume_continues_bit_exactly(params, k):
    ref = uninterrupted(params)
    got = interrupted(params, k)
    for rid in ref.outputs:
        assert got.outputs[rid] == ref.outputs[rid], rid
        assert same_logits(got, ref, rid), rid
    assert got.pool.is_empty() and ref.pool.is_empty()


def test_resume_on_another_engine_with_another_pool_layout():
    ref = uninterrupted(SAMPLED)
    a = engine()
    seqs = sequences(SAMPLED)
    a.prefill(seqs)
    a.decode(5)
    snap = a.snapshot("r3")
    b = engine(kv_tokens=300, state_slots=3, page_size=4)
    b.prefill([Sequence("other", [9] * 50, 50, GREEDY)])
    assert b.restore(snap)
    resumed = b.running["r3"]
    run_to_end(b)
    assert resumed.token_ids == ref.outputs["r3"]
    continued = b.logits["r3"]
    assert len(continued) == len(ref.logits["r3"]) - 6  # prefill + 5 decode steps happened on `a`
    assert all(torch.equal(x, y) for x, y in zip(continued, ref.logits["r3"][6:]))


def _zero_mamba(eng: Engine, rid: str) -> None:
    slot = eng.pool.mamba.slot(rid)
    eng.pool.conv[:, slot].zero_()
    eng.pool.ssm[:, slot].zero_()


def _zero_kv(eng: Engine, rid: str) -> None:
    slots = eng.pool.kv.token_slots(rid)
    eng.pool.k[:, slots] = 0
    eng.pool.v[:, slots] = 0


@pytest.mark.parametrize("tamper", [_zero_mamba, _zero_kv], ids=["mamba-state-dropped", "kv-dropped"])
def test_negative_control_missing_state_changes_the_output(tamper):
    ref = uninterrupted(GREEDY)
    got = interrupted(GREEDY, 4, tamper=tamper)
    assert not same_logits(got, ref, "r0")
    assert got.outputs["r0"] != ref.outputs["r0"]
    assert got.outputs["r1"] == ref.outputs["r1"]  # the others are untouched


def _taken(k: int = 3) -> tuple[Engine, Snapshot]:
    eng = engine()
    eng.prefill(sequences(GREEDY))
    eng.decode(k)
    return eng, eng.snapshot("r0")


def test_checksum_catches_a_flipped_byte_and_nothing_changes():
    eng, snap = _taken()
    payload = snap.payload.copy()
    payload[len(payload) // 3] ^= 0x10
    before = eng.usage()
    with pytest.raises(SnapshotError, match="checksum"):
        eng.restore(dataclasses.replace(snap, payload=payload))
    assert eng.usage() == before and "r0" not in eng.running
    assert eng.restore(snap)  # the intact one still restores


def test_snapshot_of_another_model_is_refused():
    _, snap = _taken()
    other = build_engine("tiny", device="cpu", seed=1)
    with pytest.raises(SnapshotError, match="taken on model"):
        other.restore(snap)
    bf16 = build_engine("tiny", dtype="bfloat16", device="cpu")
    with pytest.raises(SnapshotError, match="taken on model"):
        bf16.restore(snap)


def test_snapshot_with_wrong_shape_is_refused():
    eng, snap = _taken()
    bad_parts = tuple(dataclasses.replace(p, shape=p.shape[:-1] + (p.shape[-1] + 1,)) if p.name == "ssm" else p
                      for p in snap.parts)
    with pytest.raises(SnapshotError, match="parts"):
        eng.restore(dataclasses.replace(snap, parts=bad_parts))
    with pytest.raises(SnapshotError, match="Snapshot"):
        eng.restore({"not": "a snapshot"})
    assert eng.pool.usage().state_free_slots == 8 - 3


def test_snapshot_holds_everything_and_keeps_bf16_raw():
    eng = build_engine("tiny", dtype="bfloat16", device="cpu")
    eng.prefill([Sequence("a", list(PROMPTS[0]), len(PROMPTS[0]), GREEDY)])
    eng.decode(2)
    slots = eng.pool.kv.token_slots("a")[:22]
    k_before = eng.pool.k[:, slots].clone()
    ssm_before = eng.pool.ssm[:, eng.pool.mamba.slot("a")].clone()
    snap = eng.snapshot("a")
    assert snap.num_cached_tokens == len(PROMPTS[0]) + 2 == 22  # last token not fed yet
    assert snap.payload.dtype.name == "uint8" and snap.payload.flags["C_CONTIGUOUS"]
    assert {p.name: p.dtype for p in snap.parts} == {"kv": "bfloat16", "conv": "bfloat16", "ssm": "float32"}
    assert torch.equal(snap.part("kv")[0], k_before)
    assert torch.equal(snap.part("ssm"), ssm_before)
    assert eng.pool.is_empty()  # snapshot and free are one step


def test_restore_reports_a_full_pool_instead_of_raising():
    eng, snap = _taken()
    eng.prefill([Sequence(f"f{i}", [1] * 8, 8, GREEDY) for i in range(8)])
    assert eng.usage().state_free_slots == 0
    assert eng.restore(snap) is False
    assert "r0" not in eng.running


DEGENERATE = {
    "no-mamba": dict(num_hidden_layers=3, attn_layer_indices=(0, 1, 2)),
    "no-attention": dict(num_hidden_layers=3, attn_layer_indices=()),
}


@pytest.mark.parametrize("name", DEGENERATE)
def test_degenerate_hybrids_round_trip(name):
    cfg = dataclasses.replace(build_engine("tiny", device="cpu").config, **DEGENERATE[name], name=name)
    ref = uninterrupted(GREEDY, model=cfg)
    got = interrupted(GREEDY, 5, model=cfg)
    assert got.outputs == ref.outputs
    assert same_logits(got, ref, "r0")
    part = {"no-mamba": "ssm", "no-attention": "kv"}[name]
    assert any(p.name == part and 0 in p.shape for p in got_snapshot(cfg).parts)


def got_snapshot(cfg: ModelConfig) -> Snapshot:
    eng = engine(model=cfg)
    eng.prefill(sequences(GREEDY)[:1])
    return eng.snapshot("r0")


def _suppressing_params() -> SamplingParams:
    """Sampled with top_k, and min_tokens holding back stop tokens this run would draw early:
    tokens that the uninterrupted run without min_tokens emits at draws 1 to 6 of request r0."""
    free = uninterrupted(dataclasses.replace(SAMPLED, top_k=6))
    stops = tuple(sorted(set(free.outputs["r0"][len(PROMPTS[0]) + 1:len(PROMPTS[0]) + 7])))
    return dataclasses.replace(SAMPLED, top_k=6, min_tokens=12, stop_token_ids=stops)


def test_top_k_and_min_tokens_survive_a_snapshot(k=5):
    """A snapshot inside the min_tokens window carries top_k and min_tokens: the continuation is
    bit-exact. Negative control: restoring the same snapshot without them changes the output."""
    params = _suppressing_params()
    ref = uninterrupted(params)
    got = interrupted(params, k)
    for rid in ref.outputs:
        assert got.outputs[rid] == ref.outputs[rid], rid
        assert same_logits(got, ref, rid), rid
    generated = ref.outputs["r0"][len(PROMPTS[0]):]
    assert not set(generated[:12]) & set(params.stop_token_ids)  # min_tokens held them back
    stripped = engine()
    stripped.prefill(sequences(params))
    stripped.decode(k)
    snap = stripped.snapshot("r0")
    plain = {**snap.sampling, "top_k": 0, "min_tokens": 0}
    assert stripped.restore(dataclasses.replace(snap, sampling=plain))
    resumed = stripped.running["r0"]
    run_to_end(stripped)
    assert resumed.token_ids != ref.outputs["r0"]
