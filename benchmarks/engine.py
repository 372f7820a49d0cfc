"""`raysched bench engine`: decode throughput of our engine against transformers' Bamba.

The `small` preset is saved as a Hugging Face checkpoint (`config.json` from
`ModelConfig.to_hf_dict`, `model.safetensors` of `init_state_dict`) and loaded by both sides:
our engine (`build_engine(checkpoint)`) and `BambaForCausalLM.from_pretrained` in fp32 on the
CPU, with the pure-torch paths only (the benchmark refuses to run when `mamba_ssm`,
`causal_conv1d`, `kernels` or `fla` could be imported, since transformers would switch to them).

At batch sizes 1, 8 and 32, the same greedy prompts (equal lengths, so no padding) and the same
max_new_tokens N, in one process, with the same torch thread count (1, like a Ray worker actor):
- ours: prefill (not timed), then N-1 decode steps timed directly;
- transformers: `generate(max_new_tokens=N)` minus `generate(max_new_tokens=1)` (prefill and the
  first token), which leaves the N-1 decode steps;
best of 2 runs each. "ours" is the engine as served (batch-invariant decode kernels, tile 8);
"ours, plain kernels" (`invariant_tile=None`) shows what batch invariance costs. Tokens of the
two implementations are compared. When the target is missed, a profile of our decode at the
largest batch says where the time goes (by file:function and by torch op).
"""

from __future__ import annotations

import cProfile
import importlib.util
import pstats
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import Column, load_average, machine, print_table, random_prompt, timed, write_json

FORBIDDEN_KERNELS = ("mamba_ssm", "causal_conv1d", "kernels", "fla")
TARGET_BATCH, TARGET_RATIO = 32, 2.0
THREADS = 1


@dataclass(frozen=True)
class Setup:
    model: str
    batches: tuple[int, ...]
    prompt_len: int
    max_new_tokens: int
    repeats: int


FULL = Setup("small", batches=(1, 8, 32), prompt_len=64, max_new_tokens=33, repeats=2)
QUICK = Setup("tiny", batches=(1, 8), prompt_len=32, max_new_tokens=9, repeats=1)


def main(out_dir: Path = Path("bench-out"), quick: bool = False) -> dict:
    load_start = load_average()
    setup = QUICK if quick else FULL
    present = [m for m in FORBIDDEN_KERNELS if importlib.util.find_spec(m) is not None]
    if present:
        raise RuntimeError(f"{present} importable: transformers would use those kernels; "
                           "run this benchmark in an environment without them")
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = save_preset_checkpoint(setup.model, Path(tmp))
            result = run(setup, ckpt, quick)
            result["load_avg_1m_start"] = load_start
    finally:
        torch.set_num_threads(threads)
    _print(result)
    write_json(out_dir, "engine", result)
    return result


def save_preset_checkpoint(model: str, root: Path) -> Path:
    """The preset (seed 0) as a Hugging Face Bamba checkpoint directory."""
    from actors.loader import save_checkpoint
    from actors.presets import PRESETS, init_state_dict

    config = PRESETS[model]
    return save_checkpoint(root / f"bamba-{model}", config, init_state_dict(config, seed=0))


def run(setup: Setup, ckpt: Path, quick: bool) -> dict:
    from actors.engine import build_engine
    from transformers import BambaForCausalLM

    size = max(setup.batches)
    kv = size * (setup.prompt_len + setup.max_new_tokens)
    ours = build_engine(str(ckpt), device="cpu", kv_tokens=kv, mamba_slots=size)
    plain = build_engine(str(ckpt), device="cpu", kv_tokens=kv, mamba_slots=size, invariant_tile=None)
    hf = BambaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    vocab = ours.config.vocab_size
    rows = []
    for batch in setup.batches:
        prompts = [random_prompt(setup.prompt_len, vocab, seed=1000 * batch + i) for i in range(batch)]
        ours_s, ours_tokens = _best(lambda: ours_decode(ours, prompts, setup.max_new_tokens), setup.repeats)
        plain_s, plain_tokens = _best(lambda: ours_decode(plain, prompts, setup.max_new_tokens), setup.repeats)
        hf_s, hf_tokens = _best(lambda: hf_decode(hf, prompts, setup.max_new_tokens), setup.repeats)
        decoded = batch * (setup.max_new_tokens - 1)
        rows.append({"batch": batch, "decode_tokens": decoded,
                     "ours_tokens_per_s": decoded / ours_s, "ours_plain_tokens_per_s": decoded / plain_s,
                     "hf_tokens_per_s": decoded / hf_s, "ratio": hf_s / ours_s, "ratio_plain": hf_s / plain_s,
                     "ours_ms_per_step": ours_s / (setup.max_new_tokens - 1) * 1e3,
                     "hf_ms_per_step": hf_s / (setup.max_new_tokens - 1) * 1e3,
                     "tokens_match_hf": sum(a == b for a, b in zip(ours_tokens, hf_tokens)),
                     "tokens_match_plain": sum(a == b for a, b in zip(ours_tokens, plain_tokens))})
    result = {"model": setup.model, "threads": THREADS, "prompt_len": setup.prompt_len,
              "max_new_tokens": setup.max_new_tokens, "repeats": setup.repeats, "machine": machine(),
              "kernels_present": [], "rows": rows}
    at_target = next((r for r in rows if r["batch"] == TARGET_BATCH), None)
    if at_target is not None:
        result["target"] = {"batch": TARGET_BATCH, "min_ratio": TARGET_RATIO,
                            "ratio": at_target["ratio"], "met": at_target["ratio"] >= TARGET_RATIO}
        if not result["target"]["met"] and not quick:
            prompts = [random_prompt(setup.prompt_len, vocab, seed=i) for i in range(TARGET_BATCH)]
            result["profile"] = profile_decode(ours, prompts, steps=8)
    return result


def _best(fn, repeats: int) -> tuple[float, list]:
    runs = [fn() for _ in range(repeats)]
    return min(r[0] for r in runs), runs[0][1]


def ours_decode(engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds of the N-1 decode steps, generated tokens per prompt)."""
    from actors.engine import Sequence
    from raysched.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens)
    seqs = [Sequence(f"b{i}", list(p), len(p), params) for i, p in enumerate(prompts)]
    engine.prefill(seqs)
    seconds, _ = timed(lambda: engine.decode(max_new_tokens - 1))
    assert not engine.running, "every request should have finished"
    return seconds, [s.token_ids[s.prompt_len:] for s in seqs]


@torch.no_grad()
def hf_decode(hf, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds of generate(N) minus generate(1), generated tokens per prompt)."""
    ids = torch.tensor(prompts)  # (B, L): equal lengths, no padding
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}
    first_s, _ = timed(lambda: hf.generate(input_ids=ids, max_new_tokens=1, **kwargs))
    all_s, out = timed(lambda: hf.generate(input_ids=ids, max_new_tokens=max_new_tokens, **kwargs))
    return all_s - first_s, out[:, ids.shape[1]:].tolist()


def profile_decode(engine, prompts: list[list[int]], steps: int) -> dict:
    """Where our decode time goes: Python functions (cProfile) and torch ops (torch.profiler)."""
    from actors.engine import Sequence
    from raysched.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=2 * steps + 2)
    seqs = [Sequence(f"p{i}", list(p), len(p), params) for i, p in enumerate(prompts)]
    engine.prefill(seqs)
    prof = cProfile.Profile()
    prof.enable()
    engine.decode(steps)
    prof.disable()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        engine.decode(steps)
    for s in seqs:
        engine.release(s.request_id)
    stats = pstats.Stats(prof)
    total = stats.total_tt
    funcs = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)  # by cumulative
    ours = [{"function": f"{_short(file)}:{name}", "calls": nc, "cum_s": ct, "cum_share": ct / total,
             "self_s": tt}
            for (file, _line, name), (_cc, nc, tt, ct, _callers) in funcs
            if "/actors/" in file][:15]
    ops = sorted(tp.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    op_total = sum(e.self_cpu_time_total for e in tp.key_averages())
    return {"batch": len(prompts), "steps": steps, "profiled_s": total, "functions": ours,
            "torch_ops": [{"op": e.key, "calls": e.count, "self_share": e.self_cpu_time_total / op_total}
                          for e in ops]}


def _short(path: str) -> str:
    i = path.find("/actors/")
    return path[i + 1:] if i >= 0 else path


def _print(result: dict) -> None:
    cols = [Column("batch", "batch"), Column("ours tok/s", "ours_tokens_per_s", ".1f"),
            Column("ours plain tok/s", "ours_plain_tokens_per_s", ".1f"),
            Column("HF tok/s", "hf_tokens_per_s", ".1f"), Column("ours/HF", "ratio", ".2f"),
            Column("plain/HF", "ratio_plain", ".2f"), Column("ours ms/step", "ours_ms_per_step", ".1f"),
            Column("HF ms/step", "hf_ms_per_step", ".1f"), Column("same tokens", "match")]
    rows = [{**r, "match": f"{r['tokens_match_hf']}/{r['batch']}"} for r in result["rows"]]
    print_table(f"decode throughput, model {result['model']}, {result['threads']} torch thread(s), "
                f"prompt {result['prompt_len']}, {result['max_new_tokens'] - 1} decode steps", cols, rows)
    t = result.get("target")
    if t:
        print(f"target: ours >= {t['min_ratio']}x transformers at batch {t['batch']}: {t['ratio']:.2f}x "
              f"({'met' if t['met'] else 'MISSED'})")
    prof = result.get("profile")
    if prof:
        print(f"profile of our decode, batch {prof['batch']}, {prof['steps']} steps "
              f"({prof['profiled_s']:.2f} s under cProfile):")
        for f in prof["functions"][:10]:
            print(f"  {f['cum_share']:6.1%} cumulative  {f['calls']:>7} calls  {f['function']}")
        for op in prof["torch_ops"][:8]:
            print(f"  {op['self_share']:6.1%} self  {op['calls']:>7} calls  {op['op']}")


if __name__ == "__main__":
    main()
