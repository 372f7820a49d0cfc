"""`raysched bench resume`: bring a retracted request back on another node, by snapshot or by
recompute, for contexts of 512 to 16k tokens on the `small` preset, side by side in one run.

Two worker actors (`actors.worker.Worker`, 1 CPU each) on the two nodes of a local
`ray.cluster_utils.Cluster`: A on the head node (where the driver, like the scheduler, lives),
B on the second node. Per context length n, a request is prefilled and decoded on A, then:

- by snapshot, the path the scheduler takes: `A.retract_pending` (gather the state into a
  Snapshot, the call's return value, owned by the driver as the scheduler owns it, lying in A's
  object store; the driver waits for its size only) -> `B.step` resumes from the ref (B reads the
  object straight from A's node: one transfer, restore) and decodes one token. Repeated as a ping-pong A->B->A->B,
  each round crossing nodes once; the best round counts.
- by recompute: `B.step` re-prefills the whole history (prompt + generated tokens), which
  yields the same next token.

Both end with the request holding state for n tokens and its next token sampled, and the two
tokens must agree. Times are taken at the driver, actor-call overheads included on both sides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from benchmarks.common import (Column, label_axes, load_average, machine, pinned, print_table, random_prompt, report,
                               timed, two_node_cluster)
from raysched.config import PoolConfig, ServeConfig
from raysched.messages import PrefillItem, StepPlan, StepResult
from raysched.sampling import SamplingParams

FULL_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (256, 1024)
GENERATED = 8  # tokens the request generated on A before the first retraction
TARGET_LENGTH, TARGET_SPEEDUP = 8192, 50.0


def main(out_dir: Path = Path("bench-out"), quick: bool = False) -> dict:
    load_start = load_average()
    model, lengths = ("tiny", QUICK_LENGTHS) if quick else ("small", FULL_LENGTHS)
    rounds = 2 if quick else 3
    config = ServeConfig(model=model, workers=2, device="cpu",
                         pool=PoolConfig(kv_tokens=max(lengths) + 64, state_slots=4))
    with two_node_cluster(cpus_per_node=1) as (head, other):
        a = _start_worker(config, 0, head)
        b = _start_worker(config, 1, other)
        threads = ray.get([w.__ray_call__.remote(_torch_threads) for w in (a, b)])
        _measure(a, b, 64, rounds, vocab=512)  # warm-up: first calls pay lazy initialisation
        vocab = ray.get(a.info.remote()).vocab_size
        rows = [_measure(a, b, n, rounds, vocab) for n in lengths]
    result = _result(model, threads, rounds, rows)
    result["load_avg_1m_start"] = load_start
    return report(out_dir, "resume", result, _print, _figure)


def _start_worker(config: ServeConfig, index: int, node: str) -> Any:
    from actors.worker import Worker

    return ray.remote(Worker).options(num_cpus=1, scheduling_strategy=pinned(node),
                                      max_restarts=0).remote(config, index)


def _torch_threads(_worker: Any) -> int:
    import torch

    return torch.get_num_threads()


def _step(worker: Any, plan: StepPlan, *snapshot_refs: Any) -> StepResult:
    result = ray.get(worker.step.remote(plan, *snapshot_refs))
    if result.not_admitted or result.resume_failed:
        raise RuntimeError(f"step {plan} was refused: {result.not_admitted} {result.resume_failed}")
    return result


def _measure(a: Any, b: Any, n: int, rounds: int, vocab: int) -> dict:
    """One context length: `rounds` snapshot resumes (alternating direction), one recompute.

    The prompt is sized so that the last snapshot resume and the recompute both start from a
    history of exactly n tokens.
    """
    rid = f"resume-{n}"
    sampling = SamplingParams(max_new_tokens=GENERATED + rounds + 8).to_dict()
    prompt = random_prompt(n - GENERATED - rounds + 1, vocab, seed=n)
    first = _step(a, StepPlan(prefill=(PrefillItem(rid, tuple(prompt), len(prompt), sampling),),
                              decode_steps=GENERATED - 1))
    history = prompt + first.new_tokens[rid]
    snapshot_rounds, src, dst = [], a, b
    for _ in range(rounds):
        resumed_from = tuple(history)  # what this round's resume continues (and the recompute)
        snapshot_rounds.append(_snapshot_round(src, dst, rid))
        history.append(snapshot_rounds[-1]["token"])
        src, dst = dst, src
    last = snapshot_rounds[-1]
    _step(src, StepPlan(drop=(rid,)))  # src now holds the request (the last destination)
    recompute_s, result = timed(lambda: _step(b, StepPlan(prefill=(
        PrefillItem(rid, resumed_from, len(prompt), sampling),))))
    _step(b, StepPlan(drop=(rid,)))
    best = min(snapshot_rounds, key=lambda r: r["total_s"])
    recompute_token = result.new_tokens[rid][0]
    return {"tokens": len(resumed_from), "snapshot_bytes": best["bytes"],
            "snapshot_s": best["total_s"], "retract_s": best["retract_s"],
            "restore_decode_s": best["restore_decode_s"], "restore_busy_s": best["restore_busy_s"],
            "snapshot_rounds_s": [r["total_s"] for r in snapshot_rounds],
            "recompute_s": recompute_s, "recompute_busy_s": result.busy_s,
            "speedup": recompute_s / best["total_s"],
            "same_next_token": recompute_token == last["token"]}


def _snapshot_round(src: Any, dst: Any, rid: str) -> dict:
    """Retract on src (the driver waits for the size only), resume on dst from the ref (dst
    reads the bytes from src's node) and decode one token."""
    snap_ref, size_ref = src.retract_pending.options(num_returns=2).remote(rid)
    retract_s, nbytes = timed(lambda: ray.get(size_ref))
    restore_s, result = timed(lambda: _step(dst, StepPlan(resume=(rid,), decode_steps=1), [snap_ref]))
    token = result.new_tokens[rid][0]
    return {"bytes": nbytes, "retract_s": retract_s, "restore_decode_s": restore_s,
            "restore_busy_s": result.busy_s, "total_s": retract_s + restore_s, "token": token}


def _result(model: str, threads: list[int], rounds: int, rows: list[dict]) -> dict:
    cheaper = [r["tokens"] for r in rows if r["recompute_s"] < r["snapshot_s"]]
    at_target = next((r for r in rows if r["tokens"] == TARGET_LENGTH), None)
    target = None
    if at_target is not None:
        target = {"tokens": TARGET_LENGTH, "min_speedup": TARGET_SPEEDUP,
                  "speedup": at_target["speedup"], "met": at_target["speedup"] >= TARGET_SPEEDUP}
    return {"model": model, "worker_threads": threads, "snapshot_rounds": rounds,
            "machine": machine(), "rows": rows,
            "recompute_cheaper_at": cheaper, "crossover_tokens": max(cheaper) if cheaper else None,
            "all_same_next_token": all(r["same_next_token"] for r in rows), "target": target}


def _print(result: dict) -> None:
    cols = [Column("tokens", "tokens"), Column("MB", "snapshot_bytes", ".1f", 1e-6),
            Column("retract ms", "retract_s", ".1f", 1e3),
            Column("restore+1 ms", "restore_decode_s", ".1f", 1e3),
            Column("snapshot ms", "snapshot_s", ".1f", 1e3),
            Column("recompute ms", "recompute_s", ".0f", 1e3), Column("speedup", "speedup", ".1f"),
            Column("same token", "same_next_token")]
    print_table(f"resume on another node, model {result['model']}, worker threads "
                f"{result['worker_threads']}, best of {result['snapshot_rounds']} snapshot rounds",
                cols, result["rows"])
    crossover = result["crossover_tokens"]
    print("recompute is never cheaper than snapshot" if crossover is None
          else f"recompute is cheaper at {result['recompute_cheaper_at']} tokens")
    if result["target"]:
        t = result["target"]
        print(f"target: snapshot >= {t['min_speedup']:.0f}x faster at {t['tokens']} tokens: "
              f"{t['speedup']:.1f}x ({'met' if t['met'] else 'MISSED'})")


def _figure(result: dict, plt: Any) -> Any:
    """The figure of `result` (see `common.plot`)."""
    rows = result["rows"]
    xs = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.loglog(xs, [r["snapshot_s"] * 1e3 for r in rows], "o-", label="snapshot (retract + move + restore + 1 decode)")
    ax.loglog(xs, [r["recompute_s"] * 1e3 for r in rows], "s-", label="recompute (re-prefill history)")
    if result["crossover_tokens"] is not None:
        ax.axvline(result["crossover_tokens"], color="grey", ls="--", label="recompute cheaper up to here")
    for r in rows:
        ax.annotate(f"{r['speedup']:.0f}x", (r["tokens"], r["snapshot_s"] * 1e3),
                    textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    label_axes(ax, "context length (tokens)", "time to resume on another node (ms)",
               f"resume by snapshot vs recompute ({result['model']} preset)", which="both")
    return fig


if __name__ == "__main__":
    main()
