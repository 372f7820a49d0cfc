"""Which Ray mechanism carries a step's tokens from a worker to a reader (issue 33)?

A producer actor makes `STEPS` steps, one every `STEP_MS`, and sends each step's token to a
reader in this process by one of:

- `sink`: a fire-and-forget `.remote` call on a small async actor the reader owns
  (`raysched.sink.TokenSink`; the reader long-polls it): what raysched uses;
- `queue`: `ray.util.queue.Queue` (`put_nowait` from the producer, a blocking `get` in the reader:
  also an actor underneath, with its own asyncio queue);
- `generator`: a Ray streaming generator (`num_returns="streaming"`) the reader consumes: the
  step call's own stream, which only its caller (the scheduler) can read, so a reader needs a
  relay through the scheduler (today's path before issue 33; one hop here, so a lower bound).

Reported: the producer's CPU per send (thread time), and the latency from send to the reader
(both clocks on this machine), p50/p99.

Then how one reader reads many streams: the producer pushes one piece per step for each of
`STREAMS` streams (one push per step, as a worker does), and the reader reads each stream in a
thread of its own, either with a `TokenSink.next` call per stream (each stream's own long-poll)
or through `raysched.sink.SinkReader` (one long-poll for all of them, what a `Client` does).
Reported per mode, alternating, twice each: the reading CPU per token (this process's CPU plus
the sink actor's), the sink's reads per step, and the latency p50/p99.
Run: `python -m benchmarks.token_path`.
"""

from __future__ import annotations

import time

import ray

from benchmarks.common import load_average, percentile

STEPS = 400
STEP_MS = 5.0
STREAMS = 16


@ray.remote(num_cpus=0)
class Producer:
    def to_sink(self, sink, steps: int, step_ms: float) -> float:
        cpu = 0.0
        for i in range(steps):
            time.sleep(step_ms / 1000)
            t0 = time.thread_time()
            sink.push.remote({"r": (i, [time.time()], "length" if i == steps - 1 else None)})
            cpu += time.thread_time() - t0
        return cpu / steps

    def to_queue(self, queue, steps: int, step_ms: float) -> float:
        cpu = 0.0
        for i in range(steps):
            time.sleep(step_ms / 1000)
            t0 = time.thread_time()
            queue.actor.put_nowait.remote(time.time())
            cpu += time.thread_time() - t0
        return cpu / steps

    def to_streams(self, sink, ids: list[str], steps: int, step_ms: float) -> None:
        for i in range(steps):
            time.sleep(step_ms / 1000)
            last = "length" if i == steps - 1 else None
            sink.push.remote({rid: (i, [time.time()], last) for rid in ids})

    def generate(self, steps: int, step_ms: float):
        for _ in range(steps):
            time.sleep(step_ms / 1000)
            yield time.time()


def _age(sent: float) -> float:
    """Seconds since `sent` (time.time() in the producer), read once the value is here."""
    return time.time() - sent


def _sink_latencies(steps: int, step_ms: float) -> tuple[list[float], float]:
    from raysched.sink import new_sink

    sink, producer = new_sink(), Producer.remote()
    cpu = producer.to_sink.remote(sink, steps, step_ms)
    lat, cursor, done = [], 0, False
    while not done:
        tokens, done, _ = ray.get(sink.next.remote("r", cursor, 2.0))
        now = time.time()
        lat += [now - t for t in tokens]
        cursor += len(tokens)
    return lat, ray.get(cpu)


def _queue_latencies(steps: int, step_ms: float) -> tuple[list[float], float]:
    from ray.util.queue import Queue

    queue, producer = Queue(), Producer.remote()
    cpu = producer.to_queue.remote(queue, steps, step_ms)
    lat = [_age(queue.get()) for _ in range(steps)]
    return lat, ray.get(cpu)


def _generator_latencies(steps: int, step_ms: float) -> tuple[list[float], float]:
    producer = Producer.remote()
    lat = [_age(ray.get(ref)) for ref in producer.generate.options(num_returns="streaming").remote(steps, step_ms)]
    return lat, float("nan")


def _process_cpu(_self=None) -> float:
    return time.process_time()


def _read_streams(one_poll: bool, steps: int, step_ms: float) -> dict:
    """`STREAMS` streams pushed together, each read in its own thread: through one `SinkReader`
    (`one_poll`) or a `TokenSink.next` call per stream."""
    from concurrent.futures import ThreadPoolExecutor

    from raysched.sink import SinkReader, new_sink

    sink, producer = new_sink(), Producer.remote()
    ray.get(producer.__ray_ready__.remote())
    reader = SinkReader(sink) if one_poll else None
    ids = [f"s{k}" for k in range(STREAMS)]

    def read(rid: str) -> list[float]:
        lat, cursor, done = [], 0, False
        while not done:
            if reader is not None:
                tokens, done, _ = reader.next(rid, cursor, 2.0)
            else:
                tokens, done, _ = ray.get(sink.next.remote(rid, cursor, 2.0))
            now = time.time()
            lat += [now - t for t in tokens]
            cursor += len(tokens)
        return lat

    cpu0, sink0 = time.process_time(), ray.get(sink.__ray_call__.remote(_process_cpu))
    sent = producer.to_streams.remote(sink, ids, steps, step_ms)
    with ThreadPoolExecutor(STREAMS) as pool:
        lat = [x for one in pool.map(read, ids) for x in one]
    ray.get(sent)
    cpu = time.process_time() - cpu0 + ray.get(sink.__ray_call__.remote(_process_cpu)) - sink0
    reads = ray.get(sink.stats.remote())["reads"]
    if reader is not None:
        reader.close()
    ray.kill(sink)
    return {"p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000,
            "cpu_us_per_token": cpu / len(lat) * 1e6, "reads_per_step": reads / steps}


def main() -> dict:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = {}
    try:
        for name, run in (("sink", _sink_latencies), ("queue", _queue_latencies), ("generator", _generator_latencies)):
            run(20, STEP_MS)  # warm up (actor start-up)
            lat, cpu = run(STEPS, STEP_MS)
            rows[name] = {"p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000,
                          "sender_cpu_us": cpu * 1e6}
        readers = {"a call per stream": [], "one long-poll": []}
        for one_poll in (False, True):
            _read_streams(one_poll, 20, STEP_MS)  # warm up
        for _ in range(2):
            for name, one_poll in (("a call per stream", False), ("one long-poll", True)):
                readers[name].append(_read_streams(one_poll, STEPS, STEP_MS))
    finally:
        ray.shutdown()
    print(f"token path, {STEPS} steps of {STEP_MS} ms, load avg {load_average()}")
    for name, r in rows.items():
        print(f"{name:10s} latency p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  sender CPU {r['sender_cpu_us']:.0f} us/send")
    print(f"\n{STREAMS} streams of one reader, {STEPS} steps of {STEP_MS} ms, one push per step:")
    for name, runs in readers.items():
        for r in runs:
            print(f"{name:18s} reading CPU {r['cpu_us_per_token']:.0f} us/token  reads/step {r['reads_per_step']:.2f}  "
                  f"latency p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms")
    cpu = [min(r["cpu_us_per_token"] for r in runs) for runs in readers.values()]
    print(f"reading CPU, a call per stream / one long-poll (best of each): {cpu[0] / cpu[1]:.2f}x")
    rows["readers"] = readers
    return rows


if __name__ == "__main__":
    main()
