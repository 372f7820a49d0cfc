"""`raysched` command line: generate (in-process reference), run (a workload on Ray), bench,
and one long-lived deployment: start / status / stop (a named scheduler), serve (OpenAI-compatible HTTP)."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

from raysched import interrupts

BENCHES = ("snapshot", "resume", "e2e", "overhead", "engine", "sessions", "prefix", "priority", "serve",
           "scale", "pd", "migrate", "drain", "balance")


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}")


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def _unescape(text: str) -> str:
    """`--stop "\\n"` means a newline, as in the JSON of a request: \\n, \\t, \\r and \\\\ are
    unescaped; any other backslash stays as typed."""
    return re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m.group(1)], text)


_FLAG_KINDS: dict[str, dict[str, Any]] = {  # SamplingParams field type -> argparse options
    "int": {"type": int}, "float": {"type": float}, "bool": {"action": "store_true", "default": None},
    "tuple[int, ...]": {"type": _ids}, "tuple[str, ...]": {"action": "append", "type": _unescape}}


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per sampling key (`raysched.sampling.SamplingParams`, the keys the driver, traces
    and HTTP accept too): --max-new-tokens, --top-k, --min-tokens, --ignore-eos, --stop (repeatable),
    --stop-token-ids 2,3, ...; a flag left out takes the field's default."""
    import dataclasses

    from raysched.sampling import SamplingParams

    for f in dataclasses.fields(SamplingParams):
        more = "; repeatable; \\n, \\t, \\r and \\\\ are unescaped" if f.type == "tuple[str, ...]" else ""
        parser.add_argument(f"--{f.name.replace('_', '-')}", **_FLAG_KINDS[f.type],
                            help=f"{f.metadata['help']} (default {f.default!r}){more}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raysched", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="run prompts through the engine in this process (no Ray, no retraction)")
    g.add_argument("--model", default="tiny", help="preset name (tiny, small, tiny-granite, tiny-nemotronh, "
                   "tiny-qwen35, tiny-qwen3next) or checkpoint directory")
    prompts = g.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt-ids", type=_ids, action="append", help="e.g. 5,17,42; repeatable")
    prompts.add_argument("--prompt", action="append", help="text, encoded with the model's tokenizer; repeatable")
    _add_sampling_flags(g)
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
    _deployment_args(sv, address_help="Ray cluster address (default: $RAY_ADDRESS, else an embedded "
                                      "local instance that ends with the server)")

    st = sub.add_parser("start", help="start a named, detached scheduler on a running Ray cluster")
    st.add_argument("--config", required=True, help="serve config YAML")
    _deployment_args(st)
    for cmd, text in (("status", "workers, pools, queues and counters of the named scheduler"),
                      ("stop", "end the named scheduler and its workers")):
        _deployment_args(sub.add_parser(cmd, help=text))
    sub.choices["status"].add_argument("--json", action="store_true", help="print the stats as JSON")
    dr = sub.add_parser("drain", help="move every request off a worker (live where it can) and stop admitting to it")
    dr.add_argument("--worker", type=int, required=True, help="index of the worker to drain")
    dr.add_argument("--remove", action="store_true", help="end the worker's actor once it is drained")
    _deployment_args(dr)
    sc = sub.add_parser("scale", help="grow the worker set, or shrink it by draining and removing workers")
    sc.add_argument("--workers", type=_positive, required=True, help="live workers wanted")
    sc.add_argument("--timeout", type=float, default=0.0, metavar="S",
                    help="with no room in the cluster for the new workers, ask its autoscaler for it and wait "
                         "up to S seconds (default 0: fail at once, in one line)")
    _deployment_args(sc)

    b = sub.add_parser("bench", help="benchmarks; each prints a table and writes JSON")
    b.add_argument("name", choices=BENCHES)
    b.add_argument("--json", action="store_true", help="print the JSON result to stdout")
    b.add_argument("--out", default="bench-out", help="directory for JSON and PNG files")
    b.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _deployment_args(p: argparse.ArgumentParser,
                     address_help: str = "Ray cluster address (default: $RAY_ADDRESS, else auto: the newest "
                                         "cluster `ray start` began on this machine)") -> None:
    p.add_argument("--address", default=None, help=address_help)
    p.add_argument("--name", default=None, help="scheduler name in namespace 'raysched' (default: raysched)")


def cmd_start(args: argparse.Namespace) -> int:
    import os

    import ray

    from raysched.cluster import attach, shutdown_ray
    from raysched.config import load_serve_config
    from raysched.deployment import DEFAULT_NAME, start_scheduler

    config = load_serve_config(args.config)
    owns_ray = not ray.is_initialized()
    if owns_ray:
        with interrupts.holding():
            attach(args.address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)
    try:
        interrupts.raise_if_signalled()
        name = args.name or DEFAULT_NAME
        _, workers = start_scheduler(config, name, detached=True)
        _print_workers(workers)
        print(f"scheduler {name!r} started (namespace 'raysched'); `raysched stop` ends it")
    finally:
        if owns_ray:
            shutdown_ray()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from raysched.config import load_serve_config
    from raysched.deployment import DEFAULT_NAME
    from raysched.serve import API_KEY_ENV, served_model_name, start_server

    config = load_serve_config(args.config)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    name = args.name or DEFAULT_NAME
    # A signal before Serve starts ends the start-up at start_server's next checkpoint (one line,
    # 128 + signal); one held through Serve's own start-up, when the app may already answer, is a
    # normal stop: a clean shutdown, exit status 0.
    with interrupts.holding():
        server = start_server(config, args.host, args.port, args.address, api_key, name)
    try:
        stop = _stop_on_signals()
        print(f"raysched serve: {server.url}/v1 (model {served_model_name(config.model)!r}, "
              f"scheduler {name!r}, API key {'required' if api_key else 'off'})", flush=True)
        if not interrupts.signalled():
            stop.wait()  # until SIGTERM or Ctrl-C
    finally:
        print("raysched serve: shutting down", flush=True)
        server.stop()
    return 0


def _stop_on_signals() -> Any:
    """From now on SIGTERM and Ctrl-C set the returned `threading.Event` (a clean shutdown)."""
    import threading

    stop = threading.Event()
    for sig in interrupts.SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    return stop


def cmd_status(args: argparse.Namespace) -> int:
    client = _connect(args)
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
              f"state slots free {v.get('free_slots')}/{w['state_slots']}  running {v.get('running')}"
              + ("  (draining)" if w.get("draining") else ""))
    t = stats["tables"]
    print(f"queues: waiting {t['waiting']}  running {t['running']}  retracted {t['retracted']}  "
          f"snapshots held {t['snapshots_held']}")
    shown = {"tables", "workers", "uptime_s", "workers_alive"}
    for title, keys in STATUS_GROUPS:
        shown.update(keys)
        _print_counters(title, [k for k in keys if k in stats], stats)
    _print_counters("more", sorted(k for k, v in stats.items() if k not in shown and _is_counter(v)), stats)
    if stats.get("handovers") or stats.get("prefill_tokens_by_role"):
        print(f"roles: prefill tokens {stats.get('prefill_tokens_by_role')}  hand-overs {stats.get('handovers')}  "
              f"hand-over bytes {stats.get('handover_bytes')}  hand-over latency p50 "
              f"{_ms(stats.get('handover_latency_p50_s'))}  p99 {_ms(stats.get('handover_latency_p99_s'))}")
    print(f"uptime {stats['uptime_s']:.0f} s, workers alive {stats['workers_alive']}")


STATUS_GROUPS = (  # `raysched status` prints every counter: these by topic, the rest on a "more:" line
    ("requests", ("submitted", "finished", "aborted", "readers_lost", "failed", "tokens", "resubmitted", "resubmitted_tokens")),
    ("retractions", ("retractions", "retractions_snapshot", "retractions_recompute", "preemptions", "resumes",
                     "resumes_snapshot", "resumes_recompute", "snapshot_bytes", "snapshot_bytes_held",
                     "snapshot_bytes_held_peak", "store_pressure_fallbacks", "snapshots_refused", "snapshots_lost",
                     "resume_bytes_moved")),
    ("moves", ("migrations", "cross_node_migrations", "live_migrations", "snapshot_migrations",
               "migrations_abandoned", "rebalance_moves", "migration_downtime_s", "migration_precopy_bytes",
               "migration_final_bytes")),
    ("workers", ("worker_failures", "workers_replaced", "recovered", "autoscale_grows", "autoscale_shrinks")),
    ("prefix reuse", ("state_cache_hits", "state_cache_hits_chunk", "state_cache_hits_prompt",
                      "state_cache_hits_finished", "state_cache_hits_same_worker", "state_cache_hits_same_node",
                      "state_cache_hits_other_node", "state_cache_misses", "state_cache_tokens_reused",
                      "state_cache_fallbacks", "state_cache_bytes", "state_cache_points", "state_cache_entries",
                      "state_cache_chunks", "state_cache_evictions", "state_cache_turn_pauses",
                      "state_cache_turn_points_dropped", "state_cache_turns_paused")),
    ("calls", ("calls", "pipelined_calls", "folded_calls", "interrupted_calls", "joins", "joins_refused",
               "joins_late", "finish_notices")),
)


def _is_counter(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, dict) and all(
        isinstance(v, (int, float)) for v in value.values()))


def _print_counters(title: str, keys: list[str], stats: dict) -> None:
    """One line `title: key value  key value ...` (a dict value as `key p50 0.1 p99 0.2`)."""
    if keys:
        print(f"{title}: " + "  ".join(f"{k} {_counter_text(stats[k])}" for k in keys))


def _counter_text(value: Any) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k} {_counter_text(v)}" for k, v in value.items()) or "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


def cmd_drain(args: argparse.Namespace) -> int:
    client = _connect(args)
    try:
        out = (client.remove_worker if args.remove else client.drain)(args.worker)
    finally:
        client.shutdown()
    print(f"worker {args.worker} drained{' and removed' if args.remove else ''}: {drain_text(out)}")
    return 0


def drain_text(out: dict) -> str:
    """Where a drain's requests went (`Migrator.drain`'s answer), in words."""
    return (f"moved {out['moved']} request(s) in {out['seconds']:.2f} s ({out.get('live', '?')} live, "
            f"{out.get('snapshot', '?')} by snapshot, {out.get('requeued', '?')} requeued to prefill again); "
            f"{out.get('ended', 0)} ended meanwhile; {out.get('queued', '?')} waiting in the queue (on no worker) "
            f"go to the other workers")


def cmd_scale(args: argparse.Namespace) -> int:
    """Add workers up to `--workers`, or drain and remove the newest ones down to it."""
    client = _connect(args)
    try:
        alive = [w["worker"] for w in client.workers]
        if args.workers > len(alive):
            _wait_for_room(client.config, len(alive), args.workers - len(alive), args.timeout)
        for _ in range(args.workers - len(alive)):
            line = _add_worker(client)
            print(f"worker {line['worker']} added on node {line['node'][:12]}")
        for index in sorted(alive, reverse=True)[:max(0, len(alive) - args.workers)]:
            out = client.remove_worker(index)
            print(f"worker {index} drained and removed: {drain_text(out)}")
    finally:
        client.shutdown()
    print(f"{args.workers} worker(s)")
    return 0


def _add_worker(client: Any) -> dict:
    """`client.add_worker()`; a worker that did not start (its room was taken meanwhile, or it
    failed) is a ClusterError in one line, not Ray's traceback."""
    import ray

    from raysched.cluster import ClusterError

    try:
        return client.add_worker()
    except ray.exceptions.RayTaskError as err:
        raise ClusterError((str(err.cause).strip() or type(err.cause).__name__).splitlines()[0]) from None


def _wait_for_room(config: Any, alive: int, more: int, timeout_s: float) -> None:
    """Return once the cluster has free resources for `more` workers besides the `alive` ones;
    with none now: a ClusterError at once (timeout 0), or ask the cluster's autoscaler for the
    whole set and wait up to `timeout_s`, with a progress line every ROOM_PROGRESS_S."""
    import time

    from raysched.cluster import ClusterError
    from raysched.ray_compat import request_resources
    from raysched.workers import room_shortfall, worker_bundle

    short = room_shortfall(config, more)
    if short is not None and timeout_s > 0:
        request_resources([worker_bundle(config)] * (alive + more))
        deadline, last = time.monotonic() + timeout_s, 0.0
        while short is not None and time.monotonic() < deadline:
            if time.monotonic() - last >= ROOM_PROGRESS_S:
                last = time.monotonic()
                left = deadline - last
                print(f"raysched scale: waiting for room for {more} more worker(s): {short} ({left:.0f} s left)",
                      file=sys.stderr, flush=True)
            time.sleep(ROOM_POLL_S)  # polls the cluster's free resources
            short = room_shortfall(config, more)
    if short is not None:
        waited = f"after {timeout_s:g} s" if timeout_s > 0 else "(--timeout S waits for an autoscaler to add a node)"
        raise ClusterError(f"no room for {more} more worker(s): {short} {waited}")


ROOM_POLL_S = 1.0  # how often `scale --timeout` looks at the cluster's free resources
ROOM_PROGRESS_S = 10.0  # ... and prints a progress line


def cmd_stop(args: argparse.Namespace) -> int:
    client = _connect(args)
    client.stop()
    print(f"scheduler {args.name or 'raysched'!r} stopped")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from raysched.sampling import SAMPLING_KEYS, SamplingParams, validate_prompt
    from raysched.tokenizer import load_tokenizer, require_tokenizer, with_eos_stop

    tok = load_tokenizer(args.model)
    params = {key: getattr(args, key) for key in SAMPLING_KEYS if getattr(args, key) is not None}
    if args.prompt is not None:
        prompt_ids = [require_tokenizer(args.model).encode(text) for text in args.prompt]
        params = with_eos_stop(params, tok)
    else:
        prompt_ids = args.prompt_ids
    sampling = SamplingParams.from_dict(params)
    if sampling.stop and tok is None:
        require_tokenizer(args.model)  # raises: stop strings need the text
    _check_kv_tokens(args.kv_tokens, prompt_ids, sampling.max_new_tokens)
    from actors.engine import build_engine  # torch: only once the arguments are known to be good

    need = sum(len(p) + sampling.max_new_tokens for p in prompt_ids)
    engine = build_engine(args.model, args.dtype, args.device, kv_tokens=args.kv_tokens or need,
                          state_slots=len(prompt_ids))
    for prompt in prompt_ids:
        validate_prompt(prompt, engine.config.vocab_size)
    sampling.validate(engine.config.vocab_size)
    outputs = engine.generate(prompt_ids, [sampling] * len(prompt_ids))
    rows = [_generate_row(p, o, tok, sampling) for p, o in zip(prompt_ids, outputs)]
    if args.json:
        print(json.dumps({"outputs": rows}))
    else:
        for i, row in enumerate(rows):
            print(f"[{i}] prompt {row['prompt_ids']}\n    -> {row['token_ids']}")
            if "text" in row:
                print(f"    text {row['text']!r}")
    return 0


def _check_kv_tokens(kv_tokens: int | None, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
    """`--kv-tokens` must hold each request's whole budget (the reference never retracts)."""
    from raysched.sampling import RequestError

    if kv_tokens is None:
        return
    if kv_tokens <= 0:
        raise RequestError(f"--kv-tokens must be a positive integer, got {kv_tokens}")
    for i, prompt in enumerate(prompt_ids):
        need = len(prompt) + max_new_tokens - 1  # the last token's K/V is never written
        if need > kv_tokens:
            raise RequestError(f"--kv-tokens {kv_tokens} is too small: prompt {i} ({len(prompt)} tokens) + "
                               f"--max-new-tokens ({max_new_tokens}) needs {need} KV tokens")


def _generate_row(prompt_ids: list[int], token_ids: list[int], tok, sampling) -> dict:
    """One output: token ids (cut after the token that completes a stop string) and its text."""
    row: dict = {"prompt_ids": list(prompt_ids), "token_ids": list(token_ids)}
    if tok is not None:
        stream = tok.text_stream(sampling.stop, sampling.min_tokens)
        stream.add(token_ids)
        stream.finish()
        row["token_ids"], row["text"] = stream.token_ids, stream.text
    return row


def cmd_run(args: argparse.Namespace) -> int:
    """Serve the workload; the summary and `--report` are written whenever the run ends, also
    after an interrupt at any moment (before the workload runs, e.g. in the cluster's start-up:
    a report with no request finished, every one `unfinished`; while the input is still being
    checked, their number unknown)."""
    import time

    from raysched.config import load_serve_config
    from raysched.runner import interrupted_report
    from raysched.tokenizer import load_tokenizer
    from raysched.workload import build_requests, load_workload_config

    t0, out, planned = time.monotonic(), {}, None
    try:
        config = load_serve_config(args.config)
        workload = load_workload_config(args.workload)  # validate everything before starting anything:
        planned = build_requests(workload, PRECHECK_VOCAB, load_tokenizer(config.model))  # the trace too (but the vocabulary)
        _launch_and_run(args, config, workload, out)
    except KeyboardInterrupt:  # before the run, or in the shut-down after it (its report stands)
        pass
    report = out.get("report") or interrupted_report(None if planned is None else len(planned), time.monotonic() - t0)
    _write_summary(report, args.report)
    if report["summary"].get("interrupted") or interrupts.signalled():  # also one held back while Ray stopped
        raise interrupts.Interrupted(interrupts.signalled() or signal.SIGINT)
    return 0 if report["summary"]["failed"] == 0 else 1


def _launch_and_run(args: argparse.Namespace, config: Any, workload: Any, out: dict) -> None:
    """Start the scheduler (and an embedded cluster without --address), run the workload, shut
    down; the run's report goes to out["report"] (before the shut-down: an interrupt there, or
    before the workload runs, raises KeyboardInterrupt)."""
    import raysched
    from raysched.runner import run_workload
    from raysched.workload import build_requests

    with interrupts.holding():
        client = raysched.launch(config, address=args.address)
    try:
        interrupts.raise_if_signalled()
        _print_workers(client.workers)
        specs = build_requests(workload, client.vocab_size(), client.tokenizer)
        out["report"] = run_workload(client, specs, progress=not args.quiet)
    finally:  # after an interrupt, no long wait for a scheduler whose node may be going down
        client.shutdown(timeout_s=INTERRUPTED_STOP_TIMEOUT_S if interrupts.signalled() else STOP_TIMEOUT_S)


def _write_summary(report: dict, path: str | None) -> None:
    from raysched.runner import format_summary

    print(file=sys.stderr)  # ends the progress line
    format_summary(report["summary"])
    if path:
        Path(path).write_text(json.dumps(report, indent=1))
        print(f"report written to {path}")


PRECHECK_VOCAB = 1 << 62  # trace lines are checked before Ray starts; their ids against the model after


STOP_TIMEOUT_S = 30.0  # how long `raysched run` lets its scheduler shut down before killing it
INTERRUPTED_STOP_TIMEOUT_S = 5.0  # the same after an interrupt


def _connect(args: argparse.Namespace) -> Any:
    """The named scheduler of the running cluster at `--address` (a signal while connecting:
    `Interrupted`, after disconnecting)."""
    import raysched

    with interrupts.holding():
        client = raysched.connect(args.address, args.name, log_to_driver=False)
    try:
        interrupts.raise_if_signalled()
    except interrupts.Interrupted:
        client.shutdown()
        raise
    return client


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
    """Run one command; a user's mistake (bad config, input, address, a taken port) is one line on
    stderr and exit status 2; an interrupt (Ctrl-C, SIGTERM) exits 128 + the signal's number."""
    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "run": cmd_run, "bench": cmd_bench, "start": cmd_start, "serve": cmd_serve,
                "status": cmd_status, "stop": cmd_stop, "drain": cmd_drain, "scale": cmd_scale}
    interrupts.install()
    try:
        return handlers[args.command](args)
    except _user_errors() as err:  # ValueError: CheckpointError, SnapshotError, ...
        print(f"raysched {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        signum = interrupts.signalled() or signal.SIGINT
        print(f"raysched {args.command}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum


def _user_errors() -> tuple[type[BaseException], ...]:
    from raysched.cluster import ClusterError, PortInUseError
    from raysched.config import ConfigError
    from raysched.deployment import SchedulerExistsError, SchedulerNotFoundError
    from raysched.sampling import RequestError

    return (ConfigError, RequestError, FileNotFoundError, SchedulerExistsError, SchedulerNotFoundError,
            ClusterError, PortInUseError, ValueError)


if __name__ == "__main__":
    sys.exit(main())
