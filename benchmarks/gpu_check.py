"""One GPU check, whole: every check runs, one line each, a non-zero exit if any failed.

`bash benchmarks/gpu_check.sh` (under 8 minutes on one GPU; `--skip speed,bench` leaves checks
out by name prefix, `--only ...` keeps those; `--quick` is the short variant; with
`GPU_CHECK_DEVICE=cpu` the same list runs on the CPU, which is what tests/test_gpu_check.py
does with `--quick`). Each line: `PASS|FAIL <name> (<s> s): <key number or the error>`.
When `$OUT` is set, each part's log goes there (gpu_check.log, ray-*.log, bench-*.log).

In this process (the engine on the device, each against an independent reference):
1. parity: prefill logits vs transformers' Bamba on the CPU (fp32, TF32 off), within 1e-4;
2. invariance <preset> <dtype>, for tiny, tiny-granite, tiny-nemotronh, tiny-qwen35,
   tiny-qwen3next and small in float32 and bfloat16: one request's logits (a 150-token prompt,
   chunked prefill of 64, then decode; seeded sampling) torch.equal alone vs in batches of 2, 7
   and 32, eager and graphed (fixed-shape decode; not for routed experts), against eager alone;
   and after a snapshot taken in a batch of 7 and restored in another engine; recompute <preset>
   <dtype>: its next logits after its history is prefilled again (retraction by recompute);
3. snapshot round trip (restore on the device and on the CPU), 4. chunked prefill (and a
   mid-prefill resume), 5. fixed-shape decode vs eager (tokens, logits), 6. speed vs
   transformers (`small`, decode batch 1/8/32, prefill 2k).
In child processes, each with its own time limit (the whole system through Ray, two workers
sharing the one card: `num_gpus=2`, `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`):
7. ray workers: two worker actors driven by plans: prefill, retraction through the object store
   and resume on the other worker, a live migration (pre-copy, stop-and-copy); every logit
   torch.equal to an in-process engine's uninterrupted run; control: the same with the resumed
   snapshots' SSM state zeroed must differ;
8. ray scheduler: `raysched.launch` with forced retraction, 20 greedy and seeded requests,
   tokens equal to the in-process engine's; control: `debug_drop_state` must differ;
9. bench overhead / migrate / e2e / prefix / pd (`--quick`), their configs moved to the device.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from raysched.sampling import SamplingParams

DEV = os.environ.get("GPU_CHECK_DEVICE", "cuda")  # "cpu": a dry run of the script itself
GREEDY = SamplingParams(max_new_tokens=16)


def _engine(model: str = "tiny", device: str | None = None, **kw):
    from actors.engine import build_engine

    return build_engine(model, device=device or DEV, record_logits=True,
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


ARCHITECTURES = ("tiny", "tiny-granite", "tiny-nemotronh", "tiny-qwen35", "tiny-qwen3next", "small")
DTYPES = ("float32", "bfloat16")
TARGET = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7)  # the request watched


def check_invariance(model: str, dtype: str, quick: bool = False) -> str:
    """One request's logits alone vs in batches, eager vs graphed, after snapshot and recompute;
    the reference is the eager engine running it alone. Raises naming every case that differs."""
    from actors.presets import PRESETS

    config = PRESETS[model]
    steps, sizes = (4, (2, 7)) if quick else (TARGET.max_new_tokens, (2, 7, 32))
    sampling = SamplingParams(max_new_tokens=steps, temperature=0.8, seed=7)
    target = _prompt(150, seed=99, vocab=config.vocab_size)  # three prefill chunks of 64
    others = [_prompt(5 + 9 * i, seed=1000 + i, vocab=config.vocab_size) for i in range(max(sizes) - 1)]
    kw = dict(dtype=dtype, kv_tokens=8192)  # room for a batch of 32 at once
    engines = {"eager": _engine(model, fixed_shape_decode=False, **kw)}
    if not config.has_experts:  # routed experts pick data-dependent shapes: no graphs
        engines["graphed"] = _engine(model, fixed_shape_decode=True, **kw)
    want = _watched(engines["eager"], target, [], sampling)
    differ = [f"{name} batch {n}" for name, eng in engines.items() for n in (1, *sizes)
              if (name, n) != ("eager", 1) and not _equal(_watched(eng, target, others[:n - 1], sampling), want)]
    differ += _after_snapshot(engines, target, others[:6], sampling, want)
    assert not differ, f"logits differ from eager alone: {', '.join(differ)}"
    kinds = "eager and graphed" if len(engines) > 1 else "eager (routed experts: no graphs)"
    return f"alone == batches {'/'.join(map(str, sizes))}, {kinds}, after snapshot/restore " \
           f"({steps} steps, torch.equal)"


def _watched(engine, target: list[int], others: list[list[int]], sampling: SamplingParams) -> list:
    """The target's logits (prefill chunked by 64, then decode) with `others` in its batches,
    the target in the middle; the others greedy, of mixed lengths."""
    prompts = list(others)
    at = len(prompts) // 2
    prompts.insert(at, target)
    params = [sampling if i == at else SamplingParams(max_new_tokens=3 + i % 9) for i in range(len(prompts))]
    engine.logits.clear()
    engine.generate(prompts, params, chunk_tokens=64)
    return engine.logits[f"gen-{at}"]


def _equal(have: list, want: list) -> bool:
    return len(have) == len(want) and all(torch.equal(a, b) for a, b in zip(have, want))


def _after_snapshot(engines: dict, target: list[int], others: list[list[int]], sampling: SamplingParams,
                 want: list) -> list[str]:
    """The target decoding in a batch of 7 on the eager engine, snapshotted after 2 steps and
    restored in the other engine (graphed where there is one) to finish."""
    from actors.engine import Sequence

    src, dst = engines["eager"], engines.get("graphed", engines["eager"])
    src.logits.clear()
    seqs = [Sequence(f"o{i}", list(p), len(p), SamplingParams(max_new_tokens=20)) for i, p in enumerate(others)]
    seqs.insert(3, Sequence("t", list(target), len(target), sampling))
    src.prefill(seqs, 64)
    while src.prefilling:
        src.prefill(list(src.prefilling), 64)
    src.decode(2)
    before = list(src.logits["t"])
    snap = src.snapshot("t")
    for s in seqs[:3] + seqs[4:]:
        src.release(s.request_id)
    dst.logits.clear()
    assert dst.restore(snap)
    while dst.running:
        dst.decode(1)
    differ = [] if _equal(before + dst.logits["t"], want) else ["after snapshot/restore"]
    return differ


def check_recompute(model: str, dtype: str, quick: bool = False) -> str:
    """The watched request's history (prompt + 3 generated tokens) prefilled again, chunked by
    64 (a retraction by recompute): its next logits torch.equal to the uninterrupted run's.
    (Known hard for Mamba2: the chunked scan is not the decode step's arithmetic; vLLM PR 54993.)"""
    from actors.engine import Sequence
    from actors.presets import PRESETS

    steps = 4 if quick else TARGET.max_new_tokens
    sampling = SamplingParams(max_new_tokens=steps, temperature=0.8, seed=7)
    target = _prompt(150, seed=99, vocab=PRESETS[model].vocab_size)
    engine = _engine(model, dtype=dtype, fixed_shape_decode=False)
    engine.logits.clear()
    history = target + engine.generate([target], [sampling], chunk_tokens=64)[0][:3]
    want = engine.logits["gen-0"]
    engine.logits.clear()
    engine.prefill([Sequence("t", list(history), len(target), sampling)], 64)
    while engine.prefilling:
        engine.prefill(["t"], 64)
    have = engine.logits["t"][0]
    diff = (have - want[3]).abs().max().item()
    assert torch.equal(have, want[3]), f"logits after recompute differ by up to {diff:.3g}"
    return "next logits after a recompute of 3 generated tokens torch.equal"


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
    fixed = graphed.fixed_decode
    captured = sum(b.graph is not None for b in fixed._buckets.values())
    assert fixed.created == len(fixed.ladder()), "a bucket was created after the engine started"
    return (f"{len(prompts)} requests: tokens and logits torch.equal to eager; {len(fixed.steps)} "
            f"buckets used of {fixed.created} made at start, {captured} captured as CUDA graphs")


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


# ---------------------------------------------------------------------- the whole system, through Ray
RAY_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",  # both workers see the one card
           "RAY_OVERRIDE_RESOURCES": json.dumps({"GPU": 2}) if DEV == "cuda" else "{}"}


def _with_ray(fn: Callable[[], str]) -> str:
    """Run `fn` with a local Ray instance whose two GPUs are the one card (on CUDA)."""
    import ray

    if DEV == "cpu":  # as in Ray's workers (one thread): the CPU's kernels are chosen per thread count
        torch.set_num_threads(1)
    os.environ.update(RAY_ENV)
    ray.init(address="local", num_cpus=4, num_gpus=2 if DEV == "cuda" else 0,
             include_dashboard=False, logging_level="WARNING")
    try:
        return fn()
    finally:
        ray.shutdown()


def _logging_worker():
    """The data-plane Worker, recording its logits, with `logits()` to read them."""
    from actors.worker import Worker

    class LoggingWorker(Worker):
        def __init__(self, config, index: int) -> None:
            super().__init__(config, index)
            self.engine.record_logits = True

        def logits(self) -> dict:
            return dict(self.engine.logits)

    return LoggingWorker


def _ray_requests(vocab: int, n: int, prefix: str, max_new: int) -> tuple[list[list[int]], list[SamplingParams], list[str]]:
    prompts = [_prompt(8 + 11 * i, seed=500 + i, vocab=vocab) for i in range(n)]
    sampling = [SamplingParams(max_new_tokens=max_new, temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(n)]
    return prompts, sampling, [f"{prefix}{i}" for i in range(n)]


def check_ray_workers() -> str:
    return _with_ray(_ray_workers)


def _ray_workers() -> str:
    import ray

    from raysched.config import PoolConfig, ServeConfig

    config = ServeConfig(model="tiny", device=DEV, pool=PoolConfig(kv_tokens=4096, state_slots=16))
    actor = ray.remote(num_cpus=1, num_gpus=1 if DEV == "cuda" else 0)(_logging_worker())
    w0, w1 = actor.remote(config, 0), actor.remote(config, 1)
    ref = _engine("tiny", kv_tokens=4096, state_slots=16)
    prompts, sampling, _ = _ray_requests(ref.config.vocab_size, 8, "", 12)
    want = dict(zip((f"r{i}" for i in range(8)), _generate_logits(ref, prompts, sampling)))
    same = _drive(ray, w0, w1, prompts, sampling, "r", drop_state=False)
    got = _merged(ray, w0, w1, "r")
    bad = [f"{rid} ({len(got.get(rid, []))} vs {len(want[rid])} steps)" for rid in want
           if not _equal(got.get(rid, []), want[rid])]
    assert same and not bad, f"logits differ from the in-process run: {', '.join(bad)}"
    _drive(ray, w0, w1, prompts, sampling, "c", drop_state=True)
    got = _merged(ray, w0, w1, "c")
    moved = [f"r{i}" for i in range(4)]
    differ = sum(not _equal(got.get("c" + rid[1:], []), want[rid]) for rid in moved)
    assert differ, "negative control: zeroing the resumed SSM state changed no logits"
    return f"8 requests, 4 retracted + resumed on the other worker, 1 migrated live: logits torch.equal; " \
           f"control (state dropped) differs in {differ}/4"


def _generate_logits(engine, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[list]:
    engine.logits.clear()
    engine.generate(prompts, sampling)
    return [engine.logits[f"gen-{i}"] for i in range(len(prompts))]


def _drive(ray, w0, w1, prompts, sampling, prefix: str, drop_state: bool) -> bool:
    """Prefill all on w0, 3 steps; retract 4 to w1 (through the object store: `[ref]`); migrate
    one live (pre-copy, one more step on w0, stop-and-copy); then both decode to the end."""
    from raysched.messages import PrefillItem, StepPlan

    items = tuple(PrefillItem(f"{prefix}{i}", tuple(p), len(p), sp.to_dict())
                  for i, (p, sp) in enumerate(zip(prompts, sampling)))
    ray.get(w0.step.remote(StepPlan(prefill=items, decode_steps=3)))
    moved = [f"{prefix}{i}" for i in range(4)]
    snaps = [w0.retract_pending.options(num_returns=2).remote(rid)[0] for rid in moved]
    args = [[s] for s in snaps] if not drop_state else [_zero_ssm(ray.get(s)) for s in snaps]
    live = f"{prefix}4"
    blocks, info = w0.migrate_out.options(num_returns=2).remote(live, 0, 16, False)
    _, end, cached = ray.get(info)
    assert ray.get(w1.reserve.remote(live, cached + 16))
    assert ray.get(w1.migrate_in.remote(live, [blocks]))
    ray.get([w1.step.remote(StepPlan(resume=tuple(moved), decode_steps=1), *args),
             w0.step.remote(StepPlan(decode_steps=1))])
    final, _ = w0.migrate_out.options(num_returns=2).remote(live, end, 16, True)
    assert ray.get(w1.commit.remote([final]))
    while not all(ray.get([w0.is_idle.remote(), w1.is_idle.remote()])):
        ray.get([w0.step.remote(StepPlan(decode_steps=8)), w1.step.remote(StepPlan(decode_steps=8))])
    return True


def _zero_ssm(snap):
    """The negative control: the snapshot with its SSM state zeroed (and a matching checksum)."""
    import dataclasses

    from actors.snapshot import checksum

    payload = snap.payload.copy()
    spec = next(p for p in snap.parts if p.name == "ssm")
    payload[spec.offset: spec.offset + spec.nbytes] = 0
    return dataclasses.replace(snap, payload=payload, checksum=checksum(payload))


def _merged(ray, w0, w1, prefix: str) -> dict:
    """Each request's logits: w0's steps, then w1's (every move went from w0 to w1)."""
    first, second = ray.get([w0.logits.remote(), w1.logits.remote()])
    rids = {r for r in (*first, *second) if r.startswith(prefix)}
    return {"r" + r[len(prefix):]: first.get(r, []) + second.get(r, []) for r in rids}


def check_ray_scheduler() -> str:
    return _with_ray(_ray_scheduler)


def _ray_scheduler() -> str:
    import raysched
    from raysched.config import PoolConfig, SchedulerConfig, ServeConfig

    ref = _engine("tiny", kv_tokens=8192, state_slots=20)
    prompts, sampling, _ = _ray_requests(ref.config.vocab_size, 20, "", 24)
    want = ref.generate(prompts, sampling)
    outcome = {}
    for drop in (False, True):
        config = ServeConfig(model="tiny", workers=2, device=DEV, pool=PoolConfig(kv_tokens=512, state_slots=4),
                             scheduler=SchedulerConfig(force_retract_every=2, debug_drop_state=drop))
        client = raysched.launch(config)
        try:
            handles = [client.submit(p, sp) for p, sp in zip(prompts, sampling)]
            records = [h.result(timeout=120) for h in handles]
        finally:
            client.shutdown()
        got = [list(r["token_ids"]) for r in records]
        outcome[drop] = (sum(g != w for g, w in zip(got, want)), sum(r.get("retractions", 0) for r in records))
    (bad, retracted), (control, _) = outcome[False], outcome[True]
    assert retracted, "no request was retracted: the check did not test resume"
    assert not bad, f"{bad}/20 requests' tokens differ from the in-process engine's"
    assert control, "negative control: debug_drop_state changed no request's tokens"
    return f"20 requests, {retracted} retractions: tokens equal; control (state dropped) differs in {control}/20"


BENCHES = ("overhead", "migrate", "e2e", "prefix", "pd")


def run_bench(name: str, out_dir: Path, quick: bool = True) -> dict:
    """`raysched bench <name>` with its configs and in-process engines moved to `DEV` (the
    benches name device "cpu"), Ray giving two GPUs that are the one card."""
    os.environ.update(RAY_ENV)
    module = importlib.import_module(f"benchmarks.{name}")
    for attr in ("ServeConfig", "build_engine"):
        if hasattr(module, attr):
            setattr(module, attr, _on_device(getattr(module, attr)))
    return module.main(out_dir=out_dir, quick=quick)


def _mismatches(result, path: str = "", under: bool = False) -> list[str]:
    """Paths of the bench result's entries under a "mismatch..." key that are not zero or empty."""
    if isinstance(result, dict):
        return [hit for k, v in result.items()
                for hit in _mismatches(v, f"{path}{k}.", under or "mismatch" in str(k))]
    if isinstance(result, list) and not (under and result and not isinstance(result[0], (dict, list))):
        return [hit for i, v in enumerate(result) for hit in _mismatches(v, f"{path}{i}.", under)]
    return [f"{path.rstrip('.')}={result}"] if under and result else []


def _on_device(fn: Callable) -> Callable:
    def call(*args, **kwargs):
        if kwargs.get("device") == "cpu":
            kwargs["device"] = DEV
        return fn(*args, **kwargs)
    return call


# ---------------------------------------------------------------------- the list, and running it
def engine_checks(quick: bool) -> list[tuple[str, Callable[[], str]]]:
    """The checks run in this process, in order."""
    archs, dtypes = (("tiny",), ("float32",)) if quick else (ARCHITECTURES, DTYPES)
    checks = [("parity", check_parity)]
    checks += [(f"invariance {m} {d}", lambda m=m, d=d: check_invariance(m, d, quick)) for m in archs for d in dtypes]
    checks += [(f"recompute {m} {d}", lambda m=m, d=d: check_recompute(m, d, quick)) for m in archs for d in dtypes]
    checks += [("snapshot round trip", check_snapshot_round_trip), ("chunked prefill", check_chunked),
               ("fixed-shape decode", check_fixed_shape)]
    return checks + ([] if quick else [("speed", check_speed)])


def child_checks(quick: bool) -> list[tuple[str, list[str], int]]:
    """(name, command, time limit s) of the checks run as child processes."""
    me = [sys.executable, "-m", "benchmarks.gpu_check"]
    parts = [("ray workers", [*me, "--child", "ray-workers"], 100),
             ("ray scheduler", [*me, "--child", "ray-scheduler"], 120)]
    if not quick:
        parts += [(f"bench {b}", [*me, "--child", f"bench-{b}"], 60) for b in BENCHES]
    return parts


def _selected(name: str, only: set[str], skip: set[str]) -> bool:
    first = name.split()[0]
    return (not only or first in only or name in only) and first not in skip and name not in skip


def _report(line: str, log) -> None:
    print(line, flush=True)
    if log is not None:
        log.write(line + "\n")
        log.flush()


def run_engine_checks(checks, only: set[str], skip: set[str], deadline: float, log) -> int:
    failed = 0
    for name, fn in checks:
        if not _selected(name, only, skip):
            continue
        t0 = time.perf_counter()
        if time.monotonic() > deadline:
            _report(f"FAIL {name} (0.0 s): not run, the time budget is spent", log)
            failed += 1
            continue
        try:
            detail, ok = fn(), True
        except Exception as err:  # every check runs; this one's line says why it failed
            detail, ok = f"{type(err).__name__}: {err}", False
        failed += not ok
        _report(f"{'PASS' if ok else 'FAIL'} {name} ({time.perf_counter() - t0:.1f} s): {detail}", log)
    return failed


def run_child_checks(parts, only: set[str], skip: set[str], deadline: float, out: Path | None, log) -> int:
    failed = 0
    for name, cmd, limit in parts:
        if not _selected(name, only, skip):
            continue
        limit = min(limit, deadline - time.monotonic())
        t0 = time.perf_counter()
        ok, detail = _child(cmd, limit, out / f"{name.replace(' ', '-')}.log" if out else None)
        failed += not ok
        _report(f"{'PASS' if ok else 'FAIL'} {name} ({time.perf_counter() - t0:.1f} s): {detail}", log)
    return failed


def _child(cmd: list[str], limit: float, log_path: Path | None) -> tuple[bool, str]:
    """Run one child check; (passed, its last line or why it did not finish)."""
    if limit < 5:
        return False, "not run, the time budget is spent"
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env={**os.environ, **RAY_ENV})
        text, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        text, rc = f"{err.stdout or ''}{err.stderr or ''}", None
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    if log_path is not None:
        log_path.write_text(text)
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if rc is None:
        return False, f"timed out after {limit:.0f} s"
    if rc != 0 or not lines:
        tail = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["(no output)"]
        return False, f"exit {rc}: {tail[0][:300]}"
    return True, lines[-1][len("RESULT "):]


def child_main(part: str, out: Path | None) -> int:
    """One child check: prints `RESULT <detail>` and exits 0, or raises (exit 1)."""
    if part == "ray-workers":
        detail = check_ray_workers()
    elif part == "ray-scheduler":
        detail = check_ray_scheduler()
    elif part.startswith("bench-"):
        name = part[len("bench-"):]
        target = (out or Path(tempfile.mkdtemp())) / f"bench-{name}"
        result = run_bench(name, target)
        bad = _mismatches(result)
        assert not bad, f"bench {name} reports mismatches: {', '.join(bad[:5])}"
        detail = f"bench {name} on {DEV}: no mismatch reported; JSON under {target}"
    else:
        raise SystemExit(f"gpu_check: unknown child check {part!r}")
    print(f"RESULT {detail}", flush=True)
    return 0


def _names(argv: list[str], flag: str) -> set[str]:
    return set(argv[argv.index(flag) + 1].split(",")) if flag in argv else set()


def main(argv: list[str]) -> int:
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if "--child" in argv:
        return child_main(argv[argv.index("--child") + 1], out)
    quick, budget = "--quick" in argv, float(os.environ.get("GPU_CHECK_BUDGET_S", "470"))
    if DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; nothing checked")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    deadline = time.monotonic() + budget
    log = open(out / "gpu_check.log", "a") if out else None
    where = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    _report(f"gpu_check on {where} (torch {torch.__version__}){' quick' if quick else ''}", log)
    only, skip = _names(argv, "--only"), _names(argv, "--skip")
    children = child_checks(quick)
    reserve = sum(limit for name, _, limit in children if _selected(name, only, skip))
    failed = run_engine_checks(engine_checks(quick), only, skip, deadline - min(reserve, budget / 2), log)
    failed += run_child_checks(children, only, skip, deadline, out, log)
    _report(f"gpu_check: {'all passed' if not failed else f'{failed} failed'}", log)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
