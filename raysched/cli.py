"""`raysched` command line: generate (in-process reference), run (a workload on Ray), bench."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCHES = ("snapshot", "resume", "e2e", "overhead", "engine")


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raysched", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="run prompts through the engine in this process (no Ray, no retraction)")
    g.add_argument("--model", default="tiny", help="preset name (tiny, small, tiny-granite, tiny-nemotronh, tiny-qwen35, tiny-qwen3next) or checkpoint directory")
    g.add_argument("--prompt-ids", type=_ids, action="append", required=True, help="e.g. 5,17,42; repeatable")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--kv-tokens", type=int, default=None, help="KV pool size (default: fits every prompt)")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")

    r = sub.add_parser("run", help="serve a workload on a Ray cluster (embedded local one by default)")
    r.add_argument("--config", required=True, help="serve config YAML")
    r.add_argument("--workload", required=True, help="workload YAML")
    r.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS or embedded)")
    r.add_argument("--report", default=None, help="write the JSON report here")
    r.add_argument("--quiet", action="store_true", help="no progress line")

    b = sub.add_parser("bench", help="benchmarks; each prints a table and writes JSON")
    b.add_argument("name", choices=BENCHES)
    b.add_argument("--json", action="store_true", help="print the JSON result to stdout")
    b.add_argument("--out", default="bench-out", help="directory for JSON and PNG files")
    b.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    return p


def cmd_generate(args: argparse.Namespace) -> int:
    from actors.engine import build_engine
    from raysched.sampling import SamplingParams, validate_prompt

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    need = sum(len(p) + args.max_new_tokens for p in args.prompt_ids)
    engine = build_engine(args.model, args.dtype, args.device, kv_tokens=args.kv_tokens or need,
                          mamba_slots=len(args.prompt_ids))
    for prompt in args.prompt_ids:
        validate_prompt(prompt, engine.config.vocab_size)
    params.validate(engine.config.vocab_size)
    outputs = engine.generate(args.prompt_ids, [params] * len(args.prompt_ids))
    rows = [{"prompt_ids": p, "token_ids": o} for p, o in zip(args.prompt_ids, outputs)]
    if args.json:
        print(json.dumps({"outputs": rows}))
    else:
        for i, row in enumerate(rows):
            print(f"[{i}] prompt {row['prompt_ids']}\n    -> {row['token_ids']}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import raysched
    from raysched.config import load_serve_config
    from raysched.runner import format_summary, run_workload
    from raysched.workload import load_workload_config

    config = load_serve_config(args.config)
    workload = load_workload_config(args.workload)  # validate before starting anything
    client = raysched.launch(config, address=args.address)
    try:
        _print_workers(client.workers)
        from raysched.workload import build_requests

        specs = build_requests(workload, client.vocab_size())
        report = run_workload(client, specs, progress=not args.quiet)
    finally:
        client.shutdown()
    print(file=sys.stderr)
    format_summary(report["summary"])
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))
        print(f"report written to {args.report}")
    return 0 if report["summary"]["failed"] == 0 else 1


def _print_workers(workers: list[dict]) -> None:
    for w in workers:
        print(f"worker {w['worker']}: node {w['node'][:12]} device {w['device']} "
              f"kv_tokens {w['kv_tokens']} mamba_slots {w['mamba_slots']}")


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"benchmarks.{args.name}")
    result = module.main(out_dir=Path(args.out), quick=args.quick)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from raysched.config import ConfigError
    from raysched.sampling import RequestError

    handlers = {"generate": cmd_generate, "run": cmd_run, "bench": cmd_bench}
    try:
        return handlers[args.command](args)
    except (ConfigError, RequestError, FileNotFoundError) as err:
        print(f"raysched {args.command}: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # CheckpointError, SnapshotError, ...
        print(f"raysched {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
