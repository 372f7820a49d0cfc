"""`raysched bench snapshot`: snapshot+restore bandwidth against a plain copy, and resume by
snapshot against resume by recompute, on the `small` preset, measured side by side in one run.

- Bandwidth, for requests of 1k..32k tokens: the time to take a snapshot (gather + checksum +
  free) and to restore it (verify + allocate + scatter) against a plain copy of the same number
  of bytes into a fresh buffer (what `ndarray.copy()` does), CPU caches flushed before each timed
  operation. A snapshot + restore moves the bytes twice (out of the pool, back in), so its
  bandwidth counts 2 x bytes; the strict round-trip ratio (1 x bytes) is printed beside it.
  State contents do not change copy speed, so the pool is filled with random values instead of a
  32k-token prefill.
- Resume, at 1k, 4k, 8k tokens: snapshot + restore against re-prefilling prompt + generated
  tokens (what recompute costs), both on a request with real state from a real prefill.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from actors.engine import Engine, Sequence, build_engine
from raysched.sampling import SamplingParams

BANDWIDTH_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768)
RESUME_TOKENS = (1024, 4096, 8192)


def _best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _fake_request(engine: Engine, rid: str, num_tokens: int) -> None:
    """A running request of `num_tokens` tokens whose pool state is random bytes."""
    pool = engine.pool
    assert pool.admit(rid, num_tokens - 1)
    slots = pool.kv.token_slots(rid)
    pool.k[:, slots] = torch.randn_like(pool.k[:, slots])
    pool.v[:, slots] = torch.randn_like(pool.v[:, slots])
    m = pool.mamba.slot(rid)
    pool.conv[:, m] = torch.randn_like(pool.conv[:, m])
    pool.ssm[:, m] = torch.randn_like(pool.ssm[:, m])
    engine.running[rid] = Sequence(rid, list(range(num_tokens)), num_tokens - 8,
                                   SamplingParams(max_new_tokens=64))


_SCRATCH = None


def _flush_caches() -> None:
    """Touch 64 MiB so that neither side starts with its data in the CPU caches."""
    global _SCRATCH
    if _SCRATCH is None:
        _SCRATCH = np.zeros(64 << 20, dtype=np.uint8)
    _SCRATCH += 1


def _timed(fn) -> float:
    _flush_caches()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bandwidth_row(engine: Engine, num_tokens: int, repeats: int) -> dict:
    """Best-of-`repeats` times, caches flushed before each timed operation."""
    snap_t, restore_t, copy_t, nbytes = [], [], [], 0
    for i in range(repeats):
        rid = f"bw-{num_tokens}-{i}"
        _fake_request(engine, rid, num_tokens)
        box = {}
        snap_t.append(_timed(lambda: box.setdefault("snap", engine.snapshot(rid))))
        snap = box["snap"]
        restore_t.append(_timed(lambda: engine.restore(snap, rid)))
        assert rid in engine.running
        engine.release(rid)
        nbytes = snap.nbytes
        src = np.random.randint(0, 255, nbytes, dtype=np.uint8)
        copy_t.append(_timed(lambda: src.copy()))  # a plain copy into a fresh buffer
    snap_s, restore_s, copy_s = min(snap_t), min(restore_t), min(copy_t)
    copy_bps = nbytes / copy_s
    moved_bps = 2 * nbytes / (snap_s + restore_s)  # out of the pool and back in: 2x the bytes
    return {"tokens": num_tokens, "bytes": nbytes, "snapshot_s": snap_s, "restore_s": restore_s,
            "copy_s": copy_s, "snapshot_GBps": nbytes / snap_s / 1e9, "restore_GBps": nbytes / restore_s / 1e9,
            "snapshot_restore_GBps": moved_bps / 1e9, "copy_GBps": copy_bps / 1e9,
            "ratio_to_copy": moved_bps / copy_bps,
            "round_trip_ratio_strict": (nbytes / (snap_s + restore_s)) / copy_bps}


def resume_row(engine: Engine, num_tokens: int) -> dict:
    vocab = engine.config.vocab_size
    g = torch.Generator().manual_seed(num_tokens)
    prompt = torch.randint(0, vocab, (num_tokens,), generator=g).tolist()
    rid = f"resume-{num_tokens}"
    params = SamplingParams(max_new_tokens=4)
    engine.prefill([Sequence(rid, list(prompt), num_tokens, params)])  # real state
    t0 = time.perf_counter()
    snap = engine.snapshot(rid)
    assert engine.restore(snap, rid)
    snapshot_s = time.perf_counter() - t0
    history = list(engine.running[rid].token_ids)
    engine.release(rid)
    t0 = time.perf_counter()
    engine.prefill([Sequence(rid, history, num_tokens, params)])  # recompute: re-prefill everything
    recompute_s = time.perf_counter() - t0
    engine.release(rid)
    return {"tokens": num_tokens, "bytes": snap.nbytes, "resume_snapshot_s": snapshot_s,
            "resume_recompute_s": recompute_s, "speedup": recompute_s / snapshot_s}


def main(out_dir: Path = Path("bench-out"), quick: bool = False) -> dict:
    bw_tokens = BANDWIDTH_TOKENS[:3] if quick else BANDWIDTH_TOKENS
    resume_tokens = (256, 1024) if quick else RESUME_TOKENS
    model = "tiny" if quick else "small"
    engine = build_engine(model, kv_tokens=2 * max(bw_tokens + resume_tokens) + 64, state_slots=4)
    rows = [bandwidth_row(engine, n, 3 if quick else 5) for n in bw_tokens]
    resumes = [resume_row(engine, n) for n in resume_tokens]
    result = {"model": model, "threads": torch.get_num_threads(), "bandwidth": rows, "resume": resumes}
    _print(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "snapshot.json").write_text(json.dumps(result, indent=1))
    return result


def _print(result: dict) -> None:
    print(f"snapshot benchmark, model {result['model']}, {result['threads']} threads")
    print("snap+rest GB/s = 2 x bytes / (snapshot + restore time): bytes moved out and back in;")
    print("ratio = that / plain-copy GB/s (target >= 0.5); strict = bytes / (snapshot + restore) / copy")
    print(f"{'tokens':>7} {'MB':>8} {'snap ms':>8} {'rest ms':>8} {'copy ms':>8} "
          f"{'snap+rest GB/s':>15} {'copy GB/s':>10} {'ratio':>6} {'strict':>6}")
    for r in result["bandwidth"]:
        print(f"{r['tokens']:>7} {r['bytes'] / 1e6:>8.1f} {r['snapshot_s'] * 1e3:>8.2f} {r['restore_s'] * 1e3:>8.2f} "
              f"{r['copy_s'] * 1e3:>8.2f} {r['snapshot_restore_GBps']:>15.2f} {r['copy_GBps']:>10.2f} "
              f"{r['ratio_to_copy']:>6.2f} {r['round_trip_ratio_strict']:>6.2f}")
    print(f"{'tokens':>7} {'MB':>8} {'resume by snapshot ms':>22} {'by recompute ms':>16} {'speedup':>8}")
    for r in result["resume"]:
        print(f"{r['tokens']:>7} {r['bytes'] / 1e6:>8.1f} {r['resume_snapshot_s'] * 1e3:>22.2f} "
              f"{r['resume_recompute_s'] * 1e3:>16.1f} {r['speedup']:>8.1f}x")


if __name__ == "__main__":
    main()
