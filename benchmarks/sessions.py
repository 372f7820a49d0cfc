"""`raysched bench sessions`: multi-turn conversations with the turn cache on and off.

8 conversations run at once on 2 workers (`small` preset), 6 turns each. A conversation starts
with a long first prompt (a document, 1.8k-2.6k tokens); every later turn resends the whole
history (previous prompt + the answer + 64-256 new user tokens), as chat clients do, so the
histories reach 2-4k tokens. Answers are greedy, 64-128 tokens. A conversation's next turn is
submitted when its previous one finishes; the conversations run concurrently.

- `cache_on`:  the turn cache parks every finished turn's state (and each prompt's end), and
               the next turn restores it on any worker and prefills only the new user tokens.
- `cache_off`: every turn prefills its whole history.

Both modes must produce the same tokens for every turn (the restore + suffix prefill is within
1e-4 of a full prefill in fp32, `tests/test_turn_cache.py`; greedy tokens must agree here too).
Reported per mode: throughput (generated tokens / wall time), TTFT p50/p99 of turns >= 2, the
workers' CPU seconds (from /proc) and busy seconds (inside step calls), and the cache's
counters. Targets: throughput >= 2x, turn >= 2 TTFT p50 >= 5x lower.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (Column, load_average, local_ray, machine, measured_client, percentile, plain_setup,
                               print_table, print_targets, ratio, report, warm_up)
from raysched.config import PoolConfig, ServeConfig, StateCacheConfig

MODES = ("cache_on", "cache_off")
STORE_BYTES = 1 << 30


@dataclass(frozen=True)
class Setup:
    model: str
    conversations: int
    turns: int
    first_prompt: tuple[int, int]  # tokens of the first turn's prompt
    user_tokens: tuple[int, int]  # new user tokens per later turn
    output_tokens: tuple[int, int]  # max_new_tokens per turn (greedy, no stop token)
    kv_tokens: int  # per worker
    state_slots: int
    min_tokens: int  # turn cache: smallest state parked
    vocab: int


FULL = Setup("small", conversations=8, turns=6, first_prompt=(1800, 2600), user_tokens=(64, 256),
             output_tokens=(64, 128), kv_tokens=16384, state_slots=8, min_tokens=64, vocab=8192)
QUICK = Setup("tiny", conversations=4, turns=3, first_prompt=(100, 150), user_tokens=(16, 32),
              output_tokens=(8, 16), kv_tokens=2048, state_slots=4, min_tokens=16, vocab=512)


def serve_config(setup: Setup, mode: str) -> ServeConfig:
    return ServeConfig(model=setup.model, workers=2, device="cpu",
                       pool=PoolConfig(kv_tokens=setup.kv_tokens, state_slots=setup.state_slots),
                       state_cache=StateCacheConfig(enabled=mode == "cache_on", min_tokens=setup.min_tokens))


def main(out_dir: Path = Path("bench-out"), quick: bool = False) -> dict:
    load_start = load_average()
    setup = QUICK if quick else FULL
    runs = {}
    with local_ray(num_cpus=2, object_store_bytes=STORE_BYTES):
        for mode in MODES:
            runs[mode] = run_mode(setup, mode)
    result = _result(setup, runs)
    result["load_avg_1m_start"] = load_start
    return report(out_dir, "sessions", result, _print, _figure)


# ---------------------------------------------------------------------------- driving
class Conversation:
    """One chat: its history, the turn in flight, and every turn's record."""

    def __init__(self, index: int, setup: Setup) -> None:
        self.index = index
        self.rng = random.Random(1000 + index)
        self.setup = setup
        self.history = self._tokens(self.rng.randint(*setup.first_prompt))
        self.records: list[dict] = []

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.setup.vocab) for _ in range(n)]

    def next_prompt(self) -> tuple[list[int], dict]:
        """The prompt of the next turn (the whole history) and its sampling."""
        if self.records:
            self.history = self.history + self.records[-1]["token_ids"] + self._tokens(
                self.rng.randint(*self.setup.user_tokens))
        return list(self.history), {"max_new_tokens": self.rng.randint(*self.setup.output_tokens)}

    @property
    def done(self) -> bool:
        return len(self.records) == self.setup.turns


def run_mode(setup: Setup, mode: str) -> dict:
    """All conversations concurrently; a conversation's next turn goes in when its last ends."""
    import ray

    with measured_client(serve_config(setup, mode)) as (client, costs):
        warm_up(client)
        convs = [Conversation(i, setup) for i in range(setup.conversations)]
        pending = {}
        start = time.monotonic()
        for c in convs:
            pending[_submit(client, c)] = c
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            c = pending.pop(done[0])
            c.records.append(ray.get(done[0]))
            if not c.done:
                pending[_submit(client, c)] = c
        duration = time.monotonic() - start
        cost = costs()
        stats = client.stats()
    turns = [{"conversation": c.index, "turn": t, "prompt_len": len(r["prompt_ids"]),
              "cached_tokens": r["cached_tokens"], "cache_kind": r["cache_kind"],
              "ttft_s": r["ttft_s"], "latency_s": r["latency_s"], "token_ids": r["token_ids"]}
             for c in convs for t, r in enumerate(c.records, start=1)]
    print(f"{mode:>10}: {sum(len(t['token_ids']) for t in turns) / duration:.1f} tokens/s in {duration:.1f} s, "
          f"worker CPU {cost['worker_cpu_s'] or 0:.1f} s, hits {stats['state_cache_hits']}", flush=True)
    return {"duration_s": duration, "turns": turns, "stats": stats, **cost}


def _submit(client, c: Conversation):
    prompt, sampling = c.next_prompt()
    handle = client.submit(prompt, sampling)
    return client.scheduler.wait.remote(handle.request_id)


# ---------------------------------------------------------------------------- analysis
CACHE_STATS = ("state_cache_hits", "state_cache_hits_finished", "state_cache_hits_prompt",
               "state_cache_misses", "state_cache_tokens_reused", "state_cache_bytes",
               "state_cache_entries", "state_cache_evictions", "state_cache_fallbacks")


def _row(mode: str, run: dict) -> dict:
    turns = run["turns"]
    later = [t["ttft_s"] for t in turns if t["turn"] >= 2]
    tokens = sum(len(t["token_ids"]) for t in turns)
    prompt_tokens = sum(t["prompt_len"] for t in turns)
    cached = sum(t["cached_tokens"] for t in turns)
    return {"mode": mode, "duration_s": run["duration_s"], "tokens": tokens,
            "tokens_per_s": tokens / run["duration_s"],
            "ttft_turn2plus_p50_s": percentile(later, 50), "ttft_turn2plus_p99_s": percentile(later, 99),
            "ttft_turn1_p50_s": percentile([t["ttft_s"] for t in turns if t["turn"] == 1], 50),
            "prompt_tokens": prompt_tokens, "prefilled_tokens": prompt_tokens - cached,
            "worker_cpu_s": run["worker_cpu_s"], "worker_busy_s": run["worker_busy_s"],
            "scheduler_cpu_s": run["scheduler_cpu_s"],
            "tokens_per_worker_cpu_s": tokens / run["worker_cpu_s"] if run["worker_cpu_s"] else None,
            **{k: run["stats"][k] for k in CACHE_STATS}}


def _mismatches(runs: dict) -> list[dict]:
    key = lambda t: (t["conversation"], t["turn"])  # noqa: E731
    off = {key(t): t["token_ids"] for t in runs["cache_off"]["turns"]}
    return [{"conversation": t["conversation"], "turn": t["turn"]}
            for t in runs["cache_on"]["turns"] if off.get(key(t)) != t["token_ids"]]


def _targets(rows: dict, mismatches: list) -> dict:
    on, off = rows["cache_on"], rows["cache_off"]
    tput = ratio(on["tokens_per_s"], off["tokens_per_s"])
    ttft = ratio(off["ttft_turn2plus_p50_s"], on["ttft_turn2plus_p50_s"])
    return {
        "throughput_on_vs_off": {"value": tput, "target": ">= 2", "met": bool(tput and tput >= 2)},
        "turn2plus_ttft_p50_off_over_on": {"value": ttft, "target": ">= 5", "met": bool(ttft and ttft >= 5)},
        "worker_cpu_off_over_on": {"value": ratio(off["worker_cpu_s"], on["worker_cpu_s"]),
                                   "target": "(informational)", "met": None},
        "same_tokens": {"value": len(mismatches), "target": "0 mismatched turns", "met": not mismatches},
    }


def _result(setup: Setup, runs: dict) -> dict:
    rows = {m: _row(m, runs[m]) for m in MODES}
    mismatches = _mismatches(runs)
    return {"model": setup.model, "workers": 2, "conversations": setup.conversations, "turns": setup.turns,
            "setup": plain_setup(setup),
            "machine": machine(), "modes": list(rows.values()), "targets": _targets(rows, mismatches),
            "mismatched_turns": mismatches,
            "per_turn": {m: [{k: v for k, v in t.items() if k != "token_ids"} for t in runs[m]["turns"]]
                         for m in MODES}}


# ---------------------------------------------------------------------------- output
def _print(result: dict) -> None:
    s = result["setup"]
    print(f"sessions: model {result['model']}, 2 workers, {result['conversations']} conversations x "
          f"{result['turns']} turns, first prompt {s['first_prompt']}, +{s['user_tokens']} user tokens "
          f"and {s['output_tokens']} output tokens per turn")
    cols = [Column("mode", "mode"), Column("tokens/s", "tokens_per_s", ".1f"), Column("time s", "duration_s", ".1f"),
            Column("TTFT t1 p50 s", "ttft_turn1_p50_s", ".2f"), Column("TTFT t>=2 p50 s", "ttft_turn2plus_p50_s", ".3f"),
            Column("TTFT t>=2 p99 s", "ttft_turn2plus_p99_s", ".3f"), Column("prefilled", "prefilled_tokens", "d"),
            Column("worker busy s", "worker_busy_s", ".1f"), Column("worker CPU s", "worker_cpu_s", ".1f"),
            Column("hits", "state_cache_hits", "d"), Column("(finished/prompt)", "split"),
            Column("parked MB", "parked_mb", ".1f")]
    rows = [{**r, "split": f"{r['state_cache_hits_finished']}/{r['state_cache_hits_prompt']}",
             "parked_mb": r["state_cache_bytes"] / 1e6} for r in result["modes"]]
    print_table("", cols, rows)
    print_targets(result["targets"])


def _figure(result: dict, plt: Any) -> Any:
    """The figure of `result` (see `common.plot`)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, turns in result["per_turn"].items():
        by_turn = {}
        for t in turns:
            by_turn.setdefault(t["turn"], []).append(t["ttft_s"])
        xs = sorted(by_turn)
        ax.plot(xs, [percentile(by_turn[x], 50) for x in xs], marker="o", label=f"{mode} (p50)")
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"multi-turn sessions ({result['model']} preset, 2 workers, "
                 f"{result['conversations']} conversations)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
