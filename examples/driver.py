"""End-to-end driver: start (or attach to) Ray, serve a few requests, stream one, print stats.

    python examples/driver.py                         # embedded local Ray, stopped at the end
    python examples/driver.py --address HEAD:6379     # or RAY_ADDRESS=HEAD:6379, or --address auto
"""

from __future__ import annotations

import argparse
from pathlib import Path

import raysched
from raysched.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
PROMPTS = [[5, 17, 42, 7, 99, 3], [300, 200, 100, 50, 25, 12, 6, 3, 1], list(range(40, 72)), [1, 2, 3]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(HERE / "serve.yaml"), help="serve config YAML")
    parser.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS or embedded)")
    args = parser.parse_args()

    client = raysched.launch(args.config, address=args.address)
    try:
        for w in client.workers:
            print(f"worker {w['worker']}: node {w['node'][:12]}  device {w['device']}  "
                  f"kv_tokens {w['kv_tokens']}  state_slots {w['state_slots']}")
        greedy = SamplingParams(max_new_tokens=24)
        handles = [client.submit(p, greedy) for p in PROMPTS[:3]]
        streamed = client.submit(PROMPTS[3], SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7))

        print(f"stream {streamed.request_id}:", end="", flush=True)
        for token in streamed.stream():
            print(f" {token}", end="", flush=True)
        print()
        for h in [*handles, streamed]:
            r = h.result(timeout=120)
            print(f"{r['request_id']}: {r['state']} on workers {r['workers']} "
                  f"(retractions {r['retractions']}, latency {r['latency_s'] * 1000:.0f} ms) -> {r['token_ids']}")

        stats = client.stats()
        print("stats:", {k: stats[k] for k in ("finished", "tokens", "retractions", "migrations",
                                               "cross_node_migrations", "snapshot_bytes")})
        print("idle:", client.check_idle())
    finally:
        client.shutdown()


if __name__ == "__main__":
    main()
