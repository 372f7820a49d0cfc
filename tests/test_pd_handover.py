"""The prefill -> decode hand-over on engines, per architecture preset: bit-exact.

A prefill engine prefills each prompt in chunks and samples its first token; the request's
snapshot (what a hand-over moves through the object store) is restored into a decode engine with
another pool layout and other requests running, which decodes it to the end. The reference is
colocated serving: one engine prefills (same chunks) and decodes. Logits are compared with
`torch.equal`, tokens with ==. The negative control drops the recurrent state at the hand-over:
the tokens change.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from actors.engine import Engine, Sequence, build_engine
from actors.presets import PRESETS
from raysched.sampling import SamplingParams

ARCH_PRESETS = [name for name in PRESETS if name != "small"]  # "small" is tiny's architecture, larger
PROMPTS = [list(range(40, 110)), [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 19, 300, 77, 2, 45, 18, 91, 23, 400, 6],
           [1, 2]]  # > GDN chunk 64, > Mamba chunk 16, < d_conv
CHUNK = 24  # prefill chunk tokens (both sides prefill in the same chunks)
GREEDY = SamplingParams(max_new_tokens=12)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=91)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # two OpenMP threads crawl on 2 busy cores


def _engine(preset: str, **kw) -> Engine:
    return build_engine(preset, device="cpu", record_logits=True, **{"kv_tokens": 512, "state_slots": 6, **kw})


def _seqs(params: SamplingParams) -> list[Sequence]:
    return [Sequence(f"r{i}", list(p), len(p), dataclasses.replace(params, seed=params.seed + i))
            for i, p in enumerate(PROMPTS)]


def _prefill(eng: Engine, seqs: list[Sequence]) -> None:
    eng.prefill(seqs, CHUNK)
    while eng.prefilling:
        eng.prefill(list(eng.prefilling), CHUNK)


def _decode_all(eng: Engine) -> None:
    while eng.running:
        eng.decode(1)


def colocated(preset: str, params: SamplingParams) -> tuple[dict, dict]:
    """(tokens, logits) per request of prefill + decode on one engine."""
    eng = _engine(preset)
    seqs = _seqs(params)
    _prefill(eng, seqs)
    _decode_all(eng)
    return {s.request_id: s.token_ids for s in seqs}, eng.logits


def handed_over(preset: str, params: SamplingParams, tamper=None) -> tuple[dict, dict]:
    """(tokens, logits) per request prefilled on one engine, decoded on another."""
    prefill = _engine(preset)
    _prefill(prefill, _seqs(params))
    snaps = [prefill.snapshot(rid) for rid in sorted(prefill.running)]
    assert prefill.pool.is_empty()
    decode = _engine(preset, kv_tokens=400, state_slots=5, page_size=4)
    decode.prefill([Sequence("other", [9] * 30, 30, SamplingParams(max_new_tokens=30))])  # slots taken
    decode.decode(2)
    for snap in snaps:
        assert decode.restore(snap)
        if tamper:
            tamper(decode, snap.request_id)
    resumed = {rid: decode.running[rid] for rid in (s.request_id for s in snaps)}
    _decode_all(decode)
    logits = {rid: prefill.logits[rid] + decode.logits[rid] for rid in resumed}
    return {rid: s.token_ids for rid, s in resumed.items()}, logits


def _drop_recurrent_state(eng: Engine, rid: str) -> None:
    for t in eng.config.state_tensors:
        eng.pool.tensor(t.name)[:, eng.pool.mamba.slot(rid)] = 0


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("preset", ARCH_PRESETS)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_handover_continues_bit_exactly(preset, params):
    want_tokens, want_logits = colocated(preset, params)
    got_tokens, got_logits = handed_over(preset, params)
    for rid, tokens in want_tokens.items():
        assert got_tokens[rid] == tokens, rid
        assert _same(got_logits[rid], want_logits[rid]), rid


@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_negative_control_handover_without_recurrent_state_changes_the_tokens(preset):
    want_tokens, _ = colocated(preset, GREEDY)
    got_tokens, _ = handed_over(preset, GREEDY, tamper=_drop_recurrent_state)
    assert any(got_tokens[rid] != tokens for rid, tokens in want_tokens.items())
