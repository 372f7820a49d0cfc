"""One-shot CUDA check: parity, batch invariance, snapshot round trips, chunked prefill, speed.

Run on a machine with a GPU (`bash benchmarks/gpu_check.sh`, meant to take under 8 minutes on
one GPU; `--skip speed,parity` leaves checks out (a check's first word), `GPU_CHECK_DEVICE=cpu` dry-runs the script);
it exits non-zero at the first failed check and prints one line per check. Every check runs the
engine with `device="cuda"` and compares against an independent reference:
1. parity: prefill logits of our model on CUDA vs transformers' Bamba on the CPU (fp32, TF32
   off), within 1e-4, and greedy tokens identical;
2. batch invariance: a request decoded alone and inside batches of 7 and 32, torch.equal logits;
3. snapshot round trip: snapshot after k steps, restore in another CUDA engine (and in a CPU
   engine: the payload is device-independent), continue; tokens and logits equal to the
   uninterrupted CUDA run;
4. chunked prefill vs one-shot on CUDA (first-token logits within 1e-4, greedy tokens equal),
   and a request snapshotted mid-prefill resumed in another engine (logits torch.equal);
5. fixed-shape decode: the engine decoding at bucket shapes under CUDA graphs (the CUDA
   default) against the eager step: tokens and every logit torch.equal, requests of mixed
   lengths finishing at different steps (so several buckets are captured and replayed);
6. speed: decode ms/step at batch 1/8/32 (graphs, and eager) and a 2k prefill of the `small`
   preset, ours vs transformers on the same GPU (tokens compared).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from raysched.sampling import SamplingParams

DEV = os.environ.get("GPU_CHECK_DEVICE", "cuda")  # "cpu": a dry run of the script itself
GREEDY = SamplingParams(max_new_tokens=16)


def _engine(model: str = "tiny", device: str = DEV, **kw):
    from actors.engine import build_engine

    return build_engine(model, device=device, record_logits=True,
                        **{"kv_tokens": 4096, "state_slots": 32, **kw})


def _prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_parity() -> str:
    from actors.loader import load_checkpoint
    from tests.hf_reference import hf_prefill_logits, load_hf, make_hf_bamba, prefill_batch

    with tempfile.TemporaryDirectory() as tmp:
        path = make_hf_bamba(Path(tmp), [1, 3], 5, seed=7, mamba_proj_bias=True, attention_bias=True)
        hf = load_hf(path)
        model, config = load_checkpoint(path, torch.float32, DEV)
        prompt = _prompt(33, seed=11, vocab=config.vocab_size)
        from tests.hf_reference import make_pool

        pool = make_pool(config, 64, 2)
        pool = type(pool)({name: t.to(DEV) for name, t in pool.tensors.items()})
        batch = prefill_batch([prompt], [torch.arange(1, 40)], [1])
        batch = _batch_to(batch, DEV)
        ours = model.forward_all_logits(batch, pool).cpu()
        ref = hf_prefill_logits(hf, prompt)
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-4, f"prefill logits differ from transformers by {diff:.3g}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), "greedy tokens differ from transformers"
    return f"max |logit diff| vs transformers {diff:.3g}"


def _batch_to(b, dev):
    from actors.batch import ForwardBatch

    kv = [t.to(dev) for t in b.kv_slots] if b.kv_slots is not None else None
    return ForwardBatch(b.is_prefill, b.input_ids.to(dev), b.positions.to(dev), b.seq_lens,
                        b.out_slots.to(dev), b.mamba_slots.to(dev), kv)


def check_invariance() -> str:
    target = _prompt(29, seed=99)
    logits = {}
    for size in (1, 7, 32):
        eng = _engine()
        prompts = [_prompt(5 + i, seed=size * 100 + i) for i in range(size - 1)]
        prompts.insert(size // 2, target)
        eng.generate(prompts, [GREEDY] * size)
        logits[size] = torch.stack(eng.logits[f"gen-{size // 2}"])
    for size in (7, 32):
        assert torch.equal(logits[size], logits[1]), f"logits differ alone vs in a batch of {size}"
    return "alone == batch 7 == batch 32 (torch.equal, 16 steps)"


def check_snapshot_round_trip() -> str:
    from actors.engine import Sequence

    prompts = [_prompt(40, seed=1), _prompt(3, seed=2), _prompt(17, seed=3)]
    ref = _engine()
    ref_seqs = [Sequence(f"r{i}", list(p), len(p), GREEDY) for i, p in enumerate(prompts)]
    ref.prefill(ref_seqs)
    while ref.running:
        ref.decode(1)
    for target in (DEV, "cpu"):
        src = _engine()
        seqs = [Sequence(f"r{i}", list(p), len(p), GREEDY) for i, p in enumerate(prompts)]
        src.prefill(seqs)
        src.decode(5)
        snap = src.snapshot("r0")
        dst = _engine(device=target)
        assert dst.restore(snap)
        while dst.running:
            dst.decode(1)
        resumed = snap.token_ids + tuple(_new_tokens(dst, "r0"))
        if target == DEV:
            want, have = ref.logits["r0"][6:], dst.logits["r0"]  # prefill + 5 steps before
            assert len(have) == len(want) and all(torch.equal(a, b) for a, b in zip(have, want)), \
                "logits differ after resume"
            assert list(resumed) == ref_seqs[0].token_ids, "tokens differ after resume"
    return f"snapshot -> restore on {DEV}: logits torch.equal; restore on cpu ran"


def _new_tokens(engine, rid: str) -> list[int]:
    """Tokens a restored request produced: one per recorded logits row, greedy."""
    return [int(row.argmax()) for row in engine.logits[rid]]


def check_chunked() -> str:
    prompts = [_prompt(300, seed=5), _prompt(45, seed=6)]
    one = _engine()
    want = one.generate(prompts, [GREEDY] * 2)
    chunked = _engine()
    got = chunked.generate(prompts, [GREEDY] * 2, chunk_tokens=64)
    assert got == want, "chunked prefill changed greedy tokens"
    diff = max((chunked.logits[f"gen-{i}"][0] - one.logits[f"gen-{i}"][0]).abs().max().item()
               for i in range(2))
    assert diff <= 1e-4, f"chunked prefill first-token logits differ by {diff:.3g}"
    return f"chunk 64 vs one-shot: tokens equal, max |logit diff| {diff:.3g}" + "; " + _mid_prefill_round_trip()


def _mid_prefill_round_trip() -> str:
    """Snapshot after 2 chunks of 64, restore in another engine, go on: logits torch.equal to
    the uninterrupted chunked run (the same chunk boundaries)."""
    from actors.engine import Sequence

    prompt = _prompt(300, seed=5)
    ref = _engine()
    ref.generate([prompt], [GREEDY], chunk_tokens=64)
    src = _engine()
    src.prefill([Sequence("gen-0", list(prompt), len(prompt), GREEDY)], 64)
    src.prefill(["gen-0"], 64)
    snap = src.snapshot("gen-0")
    dst = _engine()
    assert snap.mid_prefill and dst.restore(snap)
    while "gen-0" in dst.prefilling:
        dst.prefill(["gen-0"], 64)
    while dst.running:
        dst.decode(1)
    have, want = dst.logits["gen-0"], ref.logits["gen-0"]
    assert len(have) == len(want) and all(torch.equal(a, b) for a, b in zip(have, want)), \
        "logits differ after a mid-prefill resume"
    return "mid-prefill snapshot at 128 of 300 tokens resumed: logits torch.equal"


def check_fixed_shape() -> str:
    prompts = [_prompt(n, seed=20 + n) for n in (5, 40, 70, 3, 33, 90, 12)]
    sampling = [SamplingParams(max_new_tokens=24 - 2 * i, temperature=0.7 if i % 2 else 0.0, seed=i)
                for i in range(len(prompts))]
    eager, graphed = _engine(fixed_shape_decode=False), _engine(fixed_shape_decode=True)
    want, got = eager.generate(prompts, sampling), graphed.generate(prompts, sampling)
    assert got == want, "fixed-shape decode changed tokens"
    for rid, steps in eager.logits.items():
        have = graphed.logits[rid]
        assert len(have) == len(steps) and all(torch.equal(a, b) for a, b in zip(have, steps)), \
            f"fixed-shape decode changed {rid}'s logits"
    buckets = graphed.fixed_decode._buckets.values()
    captured = sum(b.graph is not None for b in buckets)
    return (f"{len(prompts)} requests: tokens and logits torch.equal to eager; "
            f"{len(buckets)} buckets, {captured} captured as CUDA graphs")


def check_speed() -> str:
    from benchmarks.engine import hf_decode, ours_decode, ours_prefill, hf_prefill, save_preset_checkpoint
    from transformers import BambaForCausalLM

    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_preset_checkpoint("small", Path(tmp))
        from actors.engine import build_engine

        ours = build_engine(str(ckpt), device=DEV, kv_tokens=32 * 100 + 2100, state_slots=32)
        eager = build_engine(str(ckpt), device=DEV, kv_tokens=32 * 100 + 2100, state_slots=32,
                             fixed_shape_decode=False)
        hf = BambaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval().to(DEV)
        for batch in (1, 8, 32):
            prompts = [_prompt(64, seed=1000 * batch + i, vocab=8192) for i in range(batch)]
            for side in (ours, eager):
                ours_decode(side, prompts, 5)  # warm-up (and capture)
            hf_decode(hf, prompts, 5)
            o_s, o_t = min((ours_decode(ours, prompts, 17) for _ in range(3)), key=lambda r: r[0])
            e_s, e_t = min((ours_decode(eager, prompts, 17) for _ in range(3)), key=lambda r: r[0])
            h_s, h_t = min((hf_decode(hf, prompts, 17) for _ in range(3)), key=lambda r: r[0])
            assert e_t == o_t, "graphs and eager decoded different tokens"
            same = sum(a == b for a, b in zip(o_t, h_t))
            lines.append(f"decode batch {batch}: ours {o_s / 16 * 1e3:.2f} ms/step (eager "
                         f"{e_s / 16 * 1e3:.2f}), transformers {h_s / 16 * 1e3:.2f} ms/step "
                         f"({h_s / o_s:.2f}x), same tokens {same}/{batch}")
        prompt = _prompt(2048, seed=7, vocab=8192)
        ours_prefill(ours, prompt), hf_prefill(hf, prompt)
        o_s, o_tok = min(ours_prefill(ours, prompt) for _ in range(3))
        h_s, h_tok = min(hf_prefill(hf, prompt) for _ in range(3))
        lines.append(f"prefill 2k: ours {o_s * 1e3:.1f} ms, transformers {h_s * 1e3:.1f} ms "
                     f"({h_s / o_s:.2f}x), same token {o_tok == h_tok}")
    return "\n    ".join(lines)


CHECKS = [("parity", check_parity), ("batch invariance", check_invariance),
          ("snapshot round trip", check_snapshot_round_trip), ("chunked prefill", check_chunked),
          ("fixed-shape decode", check_fixed_shape), ("speed", check_speed)]


def main(argv: list[str]) -> int:
    skip = set(argv[argv.index("--skip") + 1].split(",")) if "--skip" in argv else set()
    if DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; nothing checked")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    where = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"gpu_check on {where} (torch {torch.__version__})")
    for name, fn in CHECKS:
        if name.split()[0] in skip:
            continue
        t0 = time.perf_counter()
        try:
            detail = fn()
        except Exception as err:  # report which check failed, then stop
            print(f"FAIL {name}: {err!r}")
            return 1
        print(f"ok   {name} ({time.perf_counter() - t0:.1f} s): {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
