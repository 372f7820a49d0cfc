"""Helpers shared by the benchmarks: timing, tables, JSON and PNG output, small Ray instances.

Every benchmark module has `main(out_dir: Path, quick: bool) -> dict`: it prints a table,
writes `<name>.json` (and maybe `<name>.png`) into `out_dir` and returns the dict it wrote.
Ray instances started here are small (no dashboard, bounded object store) and always shut down.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raysched.stats import percentile  # noqa: F401  (one rule for every percentile; benchmarks import it here)

OBJECT_STORE_BYTES = 256 << 20  # per node; snapshots here are at most ~35 MB


# ---------------------------------------------------------------------------- timing
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Shortest of `repeats` timed calls: the least disturbed by other load on the machine."""
    return min(timed(fn)[0] for _ in range(repeats))


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or zero."""
    return a / b if a and b else None


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


# ---------------------------------------------------------------------------- inputs
def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    """A seeded prompt of `length` token ids in [0, vocab_size)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


# ---------------------------------------------------------------------------- output
def plain_setup(setup: Any) -> dict:
    """A benchmark's frozen `Setup` dataclass as JSON-ready data (tuples as lists)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(setup).items()}


def machine() -> dict:
    """What the numbers were measured on (the load average says how shared it was)."""
    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_avg_1m": round(os.getloadavg()[0], 2), "python": platform.python_version(),
            "torch": torch.__version__}


def load_average() -> float:
    """1-minute load average: on a shared machine, how many others wanted the CPUs."""
    return round(os.getloadavg()[0], 2)


def write_json(out_dir: Path, name: str, result: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend (no display needed), or None when matplotlib is
    not installed."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(ax: Any, ttfts_by_label: dict[str, list], title: str, what: str = "requests",
                  **style: Any) -> None:
    """One CDF line per label of time-to-first-token values (None skipped), log x axis."""
    for label, ttfts in ttfts_by_label.items():
        xs = sorted(t for t in ttfts if t is not None)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label, **style)
    ax.set_xscale("log")
    ax.set_xlabel(f"{'urgent request ' if what.startswith('urgent') else ''}TTFT (s)")
    ax.set_ylabel(f"fraction of {what}")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()


def plot(out_dir: Path, name: str, draw: Callable[[Any], Any]) -> Path | None:
    """`draw(plt)` -> a figure, saved as out_dir/name.png; without matplotlib the plot is skipped,
    saying so in one line (the table and the JSON do not need it)."""
    plt = pyplot()
    if plt is None:
        print(f"bench {name}: matplotlib is not installed; no {name}.png (pip install matplotlib)")
        return None
    fig = draw(plt)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@dataclass(frozen=True)
class Column:
    """One table column: header, row key, format spec (applied when the value is a number)."""

    header: str
    key: str
    fmt: str = ""
    scale: float = 1.0  # e.g. 1e3 to print seconds as milliseconds


def report(out_dir: Path, name: str, result: dict, show: Callable[[dict], None],
           figure: Callable[[dict, Any], Any] | None = None) -> dict:
    """A benchmark's ending: print its tables (`show`), write `<name>.json`, draw `<name>.png`
    with `figure(result, plt)` where matplotlib is installed; returns the result."""
    show(result)
    write_json(out_dir, name, result)
    if figure is not None:
        plot(out_dir, name, lambda plt: figure(result, plt))
    return result


def label_axes(ax: Any, xlabel: str, ylabel: str, title: str, which: str = "major") -> None:
    """Axis labels, title, a small legend and a light grid (`which="both"` on log axes)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, which=which, alpha=0.3)


def print_load(result: dict) -> None:
    """The 1-minute load average at the start and end of a run, and the CPU count (what makes a
    run on a shared machine readable)."""
    print(f"load average (1 min): {result.get('load_avg_1m_start')} at the start, {result.get('load_avg_1m_end')} "
          f"at the end; {result['machine']['cpus']} CPUs")


def print_table(title: str, columns: Sequence[Column], rows: Sequence[dict]) -> None:
    """A plain fixed-width table; missing values print as '-'."""
    cells = [[_cell(row.get(c.key), c) for c in columns] for row in rows]
    widths = [max([len(c.header)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print(title)
    print("  ".join(c.header.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))



def print_targets(targets: dict[str, dict]) -> None:
    """One line per target (`met` True/False) or informational figure (`met` None)."""
    for name, t in targets.items():
        verdict = "" if t["met"] is None else ("met" if t["met"] else "MISSED")
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        print(f"{'target' if t['met'] is not None else 'info'} {name}: {value} (want {t['target']}) {verdict}")

def _cell(value: Any, col: Column) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value * col.scale if col.scale != 1.0 else value, col.fmt)
    return str(value)


# ---------------------------------------------------------------------------- Ray
@contextlib.contextmanager
def local_ray(num_cpus: int, object_store_bytes: int = OBJECT_STORE_BYTES) -> Iterator[None]:
    """An embedded single-node Ray instance for the duration of the block (the one
    `raysched run` starts: `raysched.cluster.start_embedded`)."""
    from raysched.cluster import shutdown_ray, start_embedded

    start_embedded(num_cpus, object_store_bytes)
    try:
        yield
    finally:
        shutdown_ray()


@contextlib.contextmanager
def two_node_cluster(cpus_per_node: int = 1,
                     object_store_bytes: int = OBJECT_STORE_BYTES) -> Iterator[tuple[str, str]]:
    """A `ray.cluster_utils.Cluster` of two nodes on this machine, the driver attached to the
    first; yields (head node id, second node id). Each node has its own object store, so an
    object read on the other node really crosses between stores."""
    import ray
    from ray.cluster_utils import Cluster

    node_args = {"num_cpus": cpus_per_node, "object_store_memory": object_store_bytes}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    try:
        cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        head = ray.get_runtime_context().get_node_id()
        other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
        yield head, other
    finally:
        ray.shutdown()  # before removing the node the driver is attached to
        cluster.shutdown()


def actor_pids(class_name: str) -> list[int]:
    """Process ids of the live actors of `class_name` in the connected Ray instance (read from
    the GCS actor table, so no dashboard is needed); all on this machine here."""
    from raysched.ray_compat import actors

    return sorted(a["pid"] for a in actors(class_name) if a["state"] == "ALIVE" and a["pid"])


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time the processes have used so far (0 for one that is gone).

    Competing programs on a shared machine move this much less than wall time, so it compares
    the work two runs did; it is not immune (caches and memory bandwidth are shared too)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15)
    return total


def pinned(node_id: str) -> Any:
    """Scheduling strategy that places an actor on `node_id` and nowhere else."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


@contextlib.contextmanager
def measured_client(config: Any) -> Iterator[tuple[Any, Callable[[], dict]]]:
    """`raysched.launch(config)` on the connected Ray, yielding (client, costs): `costs()` gives
    the CPU seconds the worker and scheduler processes used since the launch (from /proc) and
    the workers' summed busy seconds as the scheduler counted them (compute inside step calls).
    Shuts the client down and waits until its workers are gone (the next run gets the CPUs)."""
    import raysched

    client = raysched.launch(config)
    try:
        workers, scheduler = actor_pids("Worker"), actor_pids("Scheduler")
        cpu0 = cpu_seconds(workers), cpu_seconds(scheduler)
        busy0 = client.stats()["busy_s"]

        def costs() -> dict:
            return {"worker_cpu_s": cpu_seconds(workers) - cpu0[0] if len(workers) == config.workers else None,
                    "scheduler_cpu_s": cpu_seconds(scheduler) - cpu0[1],
                    "worker_busy_s": client.stats()["busy_s"] - busy0}

        yield client, costs
    finally:
        client.shutdown()
        deadline = time.monotonic() + 30
        while actor_pids("Worker") and time.monotonic() < deadline:
            time.sleep(0.2)  # polling the actor table, not a synchronisation guess


def warm_up(client: Any, workers: int = 2) -> None:
    """One short request per worker, so no mode pays the workers' first-call costs."""
    handles = [client.submit([1 + i] * 8, {"max_new_tokens": 2}) for i in range(workers)]
    for h in handles:
        h.result(timeout=120)


# ---------------------------------------------------------------------------- streams
class Recorder:
    """One request streamed on its own thread: its tokens, when each arrived at the client
    (`time.perf_counter`), when it was submitted and ended, and any error it raised. Submitted
    as a streaming client submits (`stream=True`): each decode step's tokens come as the step
    completes from its first call on, not the first call's all at once."""

    def __init__(self, client: Any, prompt: list[int], sampling: dict) -> None:
        import threading

        self.tokens: list[int] = []
        self.arrivals: list[float] = []
        self.error: str | None = None
        self.submitted = time.perf_counter()
        self.ended: float | None = None
        self.record: dict = {}
        self._handle = client.submit(prompt, sampling, stream=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for tok in self._handle.stream():
                self.tokens.append(tok)
                self.arrivals.append(time.perf_counter())
            self.ended = time.perf_counter()
            self.record = self._handle.result(timeout=600)
        except Exception as err:  # noqa: BLE001 - a client error is a measured outcome here
            self.error = f"{type(err).__name__}: {err}"

    @property
    def request_id(self) -> str:
        return self._handle.request_id

    def abort(self) -> None:
        self._handle.abort()

    def join(self, timeout: float = 900.0) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive() and self.error is None:
            self.error = f"still streaming after {timeout} s"

    def latency_s(self) -> float | None:
        return None if self.ended is None else self.ended - self.submitted


def wait_for_tokens(recorders: Sequence[Recorder], count: int, timeout_s: float = 900.0) -> None:
    """Block until every recorder has at least `count` tokens (or ended, or failed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(len(r.tokens) >= count or r.ended or r.error for r in recorders):
            return
        time.sleep(0.005)  # polling token counts the reader threads append to
    raise TimeoutError(f"not every request reached {count} tokens in {timeout_s} s")
