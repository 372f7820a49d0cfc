"""`raysched` command line: generate (in-process reference), run (a workload on Ray), bench,
and one long-lived deployment: start / status / stop (a named scheduler), serve (OpenAI-compatible HTTP)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

BENCHES = ("snapshot", "resume", "e2e", "overhead", "engine", "sessions", "priority", "serve", "pd")


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raysched", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="run prompts through the engine in this process (no Ray, no retraction)")
    g.add_argument("--model", default="tiny", help="preset name (tiny, small, tiny-granite, tiny-nemotronh, "
                   "tiny-qwen35, tiny-qwen3next) or checkpoint directory")
    prompts = g.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt-ids", type=_ids, action="append", help="e.g. 5,17,42; repeatable")
    prompts.add_argument("--prompt", action="append", help="text, encoded with the model's tokenizer; repeatable")
    g.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    g.add_argument("--ignore-eos", action="store_true", help="text prompts: do not stop at the eos token")
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

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (Ray Serve) in front of the named scheduler")
    sv.add_argument("--config", required=True, help="serve config YAML")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $RAYSCHED_API_KEY)")
    _deployment_args(sv)

    st = sub.add_parser("start", help="start a named, detached scheduler on a running Ray cluster")
    st.add_argument("--config", required=True, help="serve config YAML")
    _deployment_args(st)
    for cmd, text in (("status", "workers, pools, queues and counters of the named scheduler"),
                      ("stop", "end the named scheduler and its workers")):
        _deployment_args(sub.add_parser(cmd, help=text))
    sub.choices["status"].add_argument("--json", action="store_true", help="print the stats as JSON")

    b = sub.add_parser("bench", help="benchmarks; each prints a table and writes JSON")
    b.add_argument("name", choices=BENCHES)
    b.add_argument("--json", action="store_true", help="print the JSON result to stdout")
    b.add_argument("--out", default="bench-out", help="directory for JSON and PNG files")
    b.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    return p


def _deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else auto)")
    p.add_argument("--name", default=None, help="scheduler name in namespace 'raysched' (default: raysched)")


def cmd_start(args: argparse.Namespace) -> int:
    import os

    import ray

    from raysched.config import load_serve_config
    from raysched.deployment import DEFAULT_NAME, start_scheduler

    config = load_serve_config(args.config)
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "auto", logging_level="WARNING")
    try:
        name = args.name or DEFAULT_NAME
        _, workers = start_scheduler(config, name, detached=True)
        _print_workers(workers)
        print(f"scheduler {name!r} started (namespace 'raysched'); `raysched stop` ends it")
    finally:
        if owns_ray:
            ray.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from raysched.config import load_serve_config
    from raysched.deployment import DEFAULT_NAME
    from raysched.serve import API_KEY_ENV, run_server

    config = load_serve_config(args.config)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    run_server(config, args.host, args.port, args.address, api_key, args.name or DEFAULT_NAME)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import raysched

    client = raysched.connect(args.address, args.name)
    try:
        stats = client.stats()
    finally:
        client.shutdown()  # a connected client only disconnects
    if args.json:
        print(json.dumps(stats, indent=1, default=str))
        return 0
    format_status(client.workers, stats)
    return 0


def format_status(workers: list[dict], stats: dict) -> None:
    """Workers (device, pool room), queues and counters, as `raysched status` prints them."""
    views = {v["worker"]: v for v in stats["workers"]}
    for w in workers:
        v = views.get(w["worker"], {})
        print(f"worker {w['worker']}: role {v.get('role', w.get('role', 'both'))}  node {w['node'][:12]} device {w['device']}  "
              f"kv free {v.get('free_tokens')}/{w['kv_tokens']}  "
              f"state slots free {v.get('free_slots')}/{w['state_slots']}  running {v.get('running')}")
    t = stats["tables"]
    print(f"queues: waiting {t['waiting']}  running {t['running']}  retracted {t['retracted']}  "
          f"snapshots held {t['snapshots_held']}")
    keys = ("submitted", "finished", "aborted", "failed", "tokens", "retractions", "resumes", "migrations",
            "snapshot_bytes", "worker_failures", "workers_replaced")
    print("counters: " + "  ".join(f"{k} {stats.get(k)}" for k in keys))
    if stats.get("handovers") or stats.get("prefill_tokens_by_role"):
        print(f"roles: prefill tokens {stats.get('prefill_tokens_by_role')}  hand-overs {stats.get('handovers')}  "
              f"hand-over bytes {stats.get('handover_bytes')}  hand-over latency p50 "
              f"{_ms(stats.get('handover_latency_p50_s'))}  p99 {_ms(stats.get('handover_latency_p99_s'))}")
    print(f"uptime {stats['uptime_s']:.0f} s, workers alive {stats['workers_alive']}")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


def cmd_stop(args: argparse.Namespace) -> int:
    import raysched

    client = raysched.connect(args.address, args.name)
    client.stop()
    print(f"scheduler {args.name or 'raysched'!r} stopped")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from actors.engine import build_engine
    from raysched.sampling import SamplingParams, validate_prompt
    from raysched.tokenizer import load_tokenizer, require_tokenizer, with_eos_stop

    tok = load_tokenizer(args.model)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "seed": args.seed, "stop": args.stop}
    if args.prompt is not None:
        prompt_ids = [require_tokenizer(args.model).encode(text) for text in args.prompt]
        params = params if args.ignore_eos else with_eos_stop(params, tok)
    else:
        prompt_ids = args.prompt_ids
    sampling = SamplingParams.from_dict(params)
    if sampling.stop and tok is None:
        require_tokenizer(args.model)  # raises: stop strings need the text
    need = sum(len(p) + args.max_new_tokens for p in prompt_ids)
    engine = build_engine(args.model, args.dtype, args.device, kv_tokens=args.kv_tokens or need,
                          mamba_slots=len(prompt_ids))
    for prompt in prompt_ids:
        validate_prompt(prompt, engine.config.vocab_size)
    sampling.validate(engine.config.vocab_size)
    outputs = engine.generate(prompt_ids, [sampling] * len(prompt_ids))
    rows = [_generate_row(p, o, tok, sampling.stop) for p, o in zip(prompt_ids, outputs)]
    if args.json:
        print(json.dumps({"outputs": rows}))
    else:
        for i, row in enumerate(rows):
            print(f"[{i}] prompt {row['prompt_ids']}\n    -> {row['token_ids']}")
            if "text" in row:
                print(f"    text {row['text']!r}")
    return 0


def _generate_row(prompt_ids: list[int], token_ids: list[int], tok, stop: tuple[str, ...]) -> dict:
    """One output: token ids (cut after the token that completes a stop string) and its text."""
    row: dict = {"prompt_ids": list(prompt_ids), "token_ids": list(token_ids)}
    if tok is not None:
        stream = tok.text_stream(stop)
        stream.add(token_ids)
        stream.finish()
        row["token_ids"], row["text"] = stream.token_ids, stream.text
    return row


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

        specs = build_requests(workload, client.vocab_size(), client.tokenizer)
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
              f"kv_tokens {w['kv_tokens']} state_slots {w['state_slots']}")


def cmd_bench(args: argparse.Namespace) -> int:
    module = _bench_module(args.name)
    result = module.main(out_dir=Path(args.out), quick=args.quick)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


def _bench_module(name: str) -> Any:
    """`benchmarks.<name>` from the source checkout this raysched runs from. The benchmarks are
    not installed (they need torch and the data plane, and a top-level `benchmarks` package
    would clash in site-packages); an installed raysched without the checkout says so."""
    import importlib

    root = Path(__file__).resolve().parents[1]
    if (root / "benchmarks" / f"{name}.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        return importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as err:
        if err.name not in ("benchmarks", f"benchmarks.{name}"):
            raise
        raise SystemExit(f"raysched bench runs from a source checkout (its benchmarks/ folder is not "
                         f"installed); none found next to {Path(__file__).parent}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from raysched.config import ConfigError
    from raysched.sampling import RequestError

    from raysched.deployment import SchedulerExistsError, SchedulerNotFoundError

    handlers = {"generate": cmd_generate, "run": cmd_run, "bench": cmd_bench, "start": cmd_start, "serve": cmd_serve,
                "status": cmd_status, "stop": cmd_stop}
    try:
        return handlers[args.command](args)
    except (ConfigError, RequestError, FileNotFoundError, SchedulerExistsError,
            SchedulerNotFoundError) as err:
        print(f"raysched {args.command}: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # CheckpointError, SnapshotError, ...
        print(f"raysched {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
