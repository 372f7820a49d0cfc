"""`raysched bench serve`: the OpenAI HTTP layer against the driver API, on one scheduler.

One embedded Ray instance runs one named scheduler (1 worker actor) and `raysched serve`'s Ray
Serve app on the loopback. The same requests (token-id prompts, seeded sampling, `ignore_eos`, so
both sides generate exactly the same tokens) run alternately
- through HTTP: one streaming `openai.AsyncOpenAI` client per request, all at once; TTFT is the
  time from sending a request to the first chunk carrying a token, inter-token latency (ITL) the
  gap between chunks divided by the tokens the later one carries;
- through the driver API (`raysched.connect(...)` to the same scheduler): submit all, wait all.
Each side runs once to warm up and then `repeats` times; the best run of each counts. Throughput
is generated tokens over wall time from the first submit to the last token. Token ids of every
request must be equal on both sides. Target: HTTP >= 0.9x the driver API's tokens/s.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import Column, load_average, machine, percentile, print_table, report
from raysched.config import PoolConfig, ServeConfig
from raysched.workload import RequestSpec, WorkloadConfig, build_requests

TARGET_RATIO = 0.9
SCHEDULER_NAME = "bench-serve"


@dataclass(frozen=True)
class Setup:
    model: str
    kv_tokens: int
    state_slots: int
    workload: WorkloadConfig
    repeats: int


FULL = Setup("small", kv_tokens=8192, state_slots=32, repeats=2,
             workload=WorkloadConfig(requests=32, seed=9, prompt_len=(32, 128), max_new_tokens=(64, 128)))
QUICK = Setup("tiny", kv_tokens=2048, state_slots=16, repeats=1,
              workload=WorkloadConfig(requests=16, seed=9, prompt_len=(8, 32), max_new_tokens=(16, 32)))


def main(out_dir: Path = Path("bench-out"), quick: bool = False) -> dict:
    import ray

    import raysched
    from raysched.serve import start_server

    load_start = load_average()
    setup = QUICK if quick else FULL
    config = ServeConfig(model=setup.model, workers=1, device="cpu",
                         pool=PoolConfig(kv_tokens=setup.kv_tokens, state_slots=setup.state_slots))
    server = start_server(config, port=_free_port(), name=SCHEDULER_NAME, num_cpus=2)
    try:
        client = raysched.connect(name=SCHEDULER_NAME)
        specs = build_requests(setup.workload, client.vocab_size())
        runs = {"http": [], "driver": []}
        for k in range(setup.repeats + 1):  # run 0 warms both up and is not counted
            runs["http"].append(asyncio.run(run_http(server.url, setup.model, specs)))
            runs["driver"].append(run_driver(client, specs, k))
    finally:
        server.stop()
    assert not ray.is_initialized()
    result = _result(setup, specs, runs["http"][1:], runs["driver"][1:])
    result["load_avg_1m_start"] = load_start
    return report(out_dir, "serve", result, _print)


async def run_http(url: str, model: str, specs: list[RequestSpec]) -> dict:
    """All requests at once, each a streaming OpenAI client request; per-request TTFT and ITLs."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as api:
        t0 = time.perf_counter()
        per_request = await asyncio.gather(*[_one_stream(api, model, s) for s in specs])
        duration = time.perf_counter() - t0
    tokens = sum(len(r["token_ids"]) for r in per_request)
    return {"duration_s": duration, "tokens": tokens, "tokens_per_s": tokens / duration,
            "ttft_s": [r["ttft_s"] for r in per_request], "itl_s": [x for r in per_request for x in r["itl_s"]],
            "outputs": {s.request_id: r["token_ids"] for s, r in zip(specs, per_request)}}


async def _one_stream(api, model: str, spec: RequestSpec) -> dict:
    sp = spec.sampling
    sent = time.perf_counter()
    stream = await api.completions.create(
        model=model, prompt=list(spec.prompt_ids), max_tokens=sp.max_new_tokens, temperature=sp.temperature,
        top_p=sp.top_p, seed=sp.seed, stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    token_ids, ttft, itl, last = [], None, [], sent
    async for chunk in stream:
        ids = chunk.choices[0].token_ids if chunk.choices else None
        if not ids:
            continue
        now = time.perf_counter()
        if ttft is None:
            ttft = now - sent
        else:
            itl.extend([(now - last) / len(ids)] * len(ids))
        last = now
        token_ids.extend(ids)
    return {"ttft_s": ttft, "itl_s": itl, "token_ids": token_ids}


def run_driver(client, specs: list[RequestSpec], run: int) -> dict:
    """The same requests through `Client.submit` / `result` on the same scheduler."""
    t0 = time.perf_counter()
    handles = [client.submit(list(s.prompt_ids), s.sampling, f"{s.request_id}-driver{run}") for s in specs]
    records = [h.result() for h in handles]
    duration = time.perf_counter() - t0
    tokens = sum(len(r["token_ids"]) for r in records)
    return {"duration_s": duration, "tokens": tokens, "tokens_per_s": tokens / duration,
            "ttft_s": [r["ttft_s"] for r in records],
            "outputs": {s.request_id: r["token_ids"] for s, r in zip(specs, records)}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _latencies(values: list[float]) -> dict:
    return {f"p{q}_ms": round(1000 * percentile(values, q), 2) if values else None for q in (50, 90, 99)}


def _result(setup: Setup, specs: list[RequestSpec], http_runs: list[dict], driver_runs: list[dict]) -> dict:
    http = max(http_runs, key=lambda r: r["tokens_per_s"])
    driver = max(driver_runs, key=lambda r: r["tokens_per_s"])
    mismatched = sorted(rid for rid, toks in driver["outputs"].items() if http["outputs"].get(rid) != toks)
    ratio = http["tokens_per_s"] / driver["tokens_per_s"]
    row = lambda side, r: {"side": side, "tokens": r["tokens"], "duration_s": r["duration_s"],  # noqa: E731
                           "tokens_per_s": r["tokens_per_s"]}
    return {
        "model": setup.model, "requests": len(specs), "concurrency": len(specs), "workers": 1,
        "prompt_tokens": sum(len(s.prompt_ids) for s in specs), "machine": machine(),
        "rows": [row("HTTP (OpenAI streaming clients)", http), row("driver API (Client.submit)", driver)],
        "ttft": _latencies(http["ttft_s"]), "itl": _latencies(http["itl_s"]),
        "driver_ttft": _latencies([t for t in driver["ttft_s"] if t is not None]),
        "http_runs": [row("http", r) for r in http_runs], "driver_runs": [row("driver", r) for r in driver_runs],
        "ratio": ratio, "target": {"min_ratio": TARGET_RATIO, "met": ratio >= TARGET_RATIO},
        "mismatched_requests": mismatched,
    }


def _print(result: dict) -> None:
    cols = [Column("side", "side"), Column("tokens", "tokens"), Column("time s", "duration_s", ".2f"),
            Column("tokens/s", "tokens_per_s", ".1f")]
    print_table(f"serve: model {result['model']}, {result['requests']} concurrent streams, 1 worker",
                cols, result["rows"])
    t, ttft, itl = result["target"], result["ttft"], result["itl"]
    print(f"HTTP TTFT p50/p90/p99 {ttft['p50_ms']}/{ttft['p90_ms']}/{ttft['p99_ms']} ms; "
          f"ITL p50/p90/p99 {itl['p50_ms']}/{itl['p90_ms']}/{itl['p99_ms']} ms")
    print(f"HTTP / driver throughput: {result['ratio']:.3f} (target >= {t['min_ratio']}: "
          f"{'met' if t['met'] else 'MISSED'}); mismatched outputs: {len(result['mismatched_requests'])}")


if __name__ == "__main__":
    main()
