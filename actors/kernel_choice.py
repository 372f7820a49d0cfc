"""Which kernel runs each fp32 matrix product on the CPU: one per weight shape and phase,
chosen by measurement at start-up, once per machine.

Candidates (`candidates()`), each row-free on this CPU (a row's bits depend on nothing but that
row and the weight, so any of them keeps batch invariance):
- "rowdot <build>" for each build of `actors.rowdot` this CPU runs ("avx512f" where it has
  AVX-512F, "avx2+fma" where it has AVX2 and FMA), widest first; "rowdot portable" only where
  neither runs (the same order with one more rounding: never faster);
- "rowdot panel" where a vector build runs: `actors.rowdot.panel_product` (the weight packed in
  panels of columns, each output one fused multiply-add chain over k in order, no sum across
  lanes), on the widest build; its bits are the same on every build, so machines with and
  without AVX-512 that both take it agree;
- "mkl packed": MKL's packed GEMM (`actors.model.TiledLinear`), for a phase only where the
  probe finds the shape row-free at that phase's tile (else it is no candidate).

Phases: "decode" (one call of 1 to `MAX_CALL_ROWS` rows per product and step) and "prefill"
(calls of up to `PREFILL_CALL_ROWS` rows). A phase keeps one kernel per shape for every row
count: a row's bits must not follow the batch.

The rule (`decide`): the default is the first candidate (rowdot's widest build). Each candidate
is timed at the phase's row counts (`PHASE_ROWS`; best of `REPEATS`, the candidates taking
turns), and scored by the geometric mean over those counts of its time over the default's.
Walking the candidates in order, one replaces the pick so far only where its score is below the
pick's by `MARGIN` (a near tie keeps the earlier candidate, whichever measured lower). MKL is
first timed as if row-free from 1 row (its fastest case); only where that would win is it
probed, then timed again padded to its probed minimum. So the choice is a function of the CPU, the libraries and the shapes,
except where two candidates' scores lie within measurement noise of exactly `MARGIN` apart.

Per machine, not per process: every choice and every probe answer is kept in one JSON file,
`kernel-choice-<key>.json` in rowdot's cache directory (`RAYSCHED_KERNEL_CACHE`, else
`$XDG_CACHE_HOME/raysched`, else `~/.cache/raysched`, else a per-user temporary one), `key`
hashing `actors.cpu_info.cpu_fingerprint()` and rowdot's source. A process measures only what
the file lacks, holding an exclusive lock (`flock` on a sibling `.lock` file) while it
measures and writes (a temporary file renamed over the old one), so workers starting together
on one machine measure once and agree. Copied to machines of the same fingerprint, the file
is their fixed table: they then agree whatever their own timings would say.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from actors import rowdot
from actors.cpu_info import cpu_fingerprint

log = logging.getLogger(__name__)

MKL = "mkl packed"
PANEL = "rowdot panel"  # `rowdot.panel_product` on the widest build: the same bits on every build
ENV_FORCE = "RAYSCHED_KERNEL"  # a candidate's name: every shape and phase takes it (no measuring)
PHASES = ("decode", "prefill")
PHASE_ROWS = {"decode": (1, 8, 32), "prefill": (256,)}  # row counts timed per phase
MAX_TIMED_OUT = 4096  # a weight's first rows timed at most (both kernels go by column blocks, so
#   the time per output column holds; a 128k-vocabulary LM head would cost seconds)
MARGIN = 0.03  # another candidate must beat the default by this fraction of its time (so the
#   default, kept on a near tie, is at most this much slower than the fastest measured)
REPEATS = 5  # timings per candidate and row count (best taken)
SAMPLE_S = 1e-3  # a timing repeats a short call until it takes about this long
_CHOSEN: dict[tuple[str, int, int], str] = {}  # (phase, out, in) -> kernel, this process
_FILE: dict[str, Any] = {}  # "path": the cache file in use (None: none writable), "data": its entries
_LOCK = threading.RLock()
_HELD = [0]  # depth of this process's hold on the file lock (`cached` nests: probe inside choice)
_MEASURE_S = [0.0]  # seconds this process spent measuring (cache misses only)


def candidates() -> tuple[str, ...]:
    """The kernels that may be chosen on this CPU, the default first (see the module doc)."""
    builds = [b for b in rowdot.builds_here() if rowdot.library(b) is not None]
    fast = [b for b in builds if b != "portable"]
    panel = (PANEL,) if fast else ()  # (on the portable build it is correct but slow)
    return tuple(f"rowdot {b}" for b in fast or builds) + panel + ((MKL,) if _mkl_packed_available() else ())


def choose(shape: tuple[int, int], phase: str) -> str:
    """The kernel of fp32 products with a weight of `shape` (out, in) in `phase`: measured with
    one thread on the first ask on this machine (see the module doc), then kept. It depends on
    the CPU and the shape alone, never on the asking process's thread count, so a driver and
    its workers (each on its own thread count) take the same kernel and get the same bits."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    forced = os.environ.get(ENV_FORCE)
    if forced:
        return _forced(forced)
    key = (phase, int(shape[0]), int(shape[1]))
    kernel = _CHOSEN.get(key)
    if kernel is None:
        names = candidates()
        if len(names) <= 1:
            kernel = names[0] if names else "tiles"
        else:
            entry = cached(f"choice {phase} {key[1]}x{key[2]}", lambda: _one_thread(_measure, key, names))
            kernel = entry["kernel"]
        _CHOSEN[key] = kernel
    return kernel


def _forced(name: str) -> str:
    if name not in candidates():
        raise ValueError(f"{ENV_FORCE}={name!r} does not run here: one of {', '.join(candidates())}")
    return name


def choices() -> dict[str, str]:
    """This process's choices: "<phase> <out>x<in>" -> kernel."""
    return {f"{p} {o}x{i}": k for (p, o, i), k in sorted(_CHOSEN.items())}


def summary(shapes: list[tuple[int, int]]) -> str:
    """The choice for every shape, per phase, in one line (what `WorkerInfo.kernel` carries):
    "decode rowdot avx2+fma, prefill mkl packed" where one kernel takes a phase's every shape,
    else that phase's most common kernel "except <shape> <kernel>, ..."."""
    parts = []
    for phase in PHASES:
        picked = {s: choose(s, phase) for s in sorted(set(shapes))}
        counts = {k: sum(v == k for v in picked.values()) for k in picked.values()}
        common = min(counts, key=lambda k: (-counts[k], k))
        rest = ", ".join(f"{o}x{i} {k}" for (o, i), k in picked.items() if k != common)
        parts.append(f"{phase} {common}" + (f" except {rest}" if rest else ""))
    return ", ".join(parts)


def measure_seconds() -> float:
    """Seconds this process spent timing candidates (zero where the machine's file had them)."""
    return _MEASURE_S[0]


def decide(scores: dict[str, float], names: tuple[str, ...]) -> str:
    """The rule: walk the candidates in order from the default (`names[0]`); one replaces the
    pick so far only where its score (its time over the default's) is below the pick's by the
    margin. So timing noise under the margin cannot change the choice, between the default and
    another or between two others: a near tie goes to the earlier candidate, whichever measured
    lower, and the pick is at most MARGIN slower than the fastest measured."""
    pick = names[0]
    for n in names[1:]:
        if n in scores and scores[n] < (1.0 - MARGIN) * scores.get(pick, 1.0):
            pick = n
    return pick


def _one_thread(fn: Callable[..., dict], *args) -> dict:
    """`fn(*args)` with torch on one thread (the thread count restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def _measure(key: tuple[str, int, int], names: tuple[str, ...]) -> dict:
    """{"kernel": the choice, "score": per candidate}: the rule on fresh timings (one thread)."""
    phase, out_f, in_f = key
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(min(out_f, MAX_TIMED_OUT), in_f, generator=g)  # (out, in), rows capped
    x = torch.randn(max(PHASE_ROWS[phase]), in_f, generator=g)  # (rows, in)
    runners = {n: _runner(n, w, 1) for n in names}
    scores = _scores(runners, x, PHASE_ROWS[phase], names[0])
    if decide(scores, names) == MKL:  # it would win row-free from 1 row: probe, time it as it runs
        min_rows = _mkl_min_rows(out_f, in_f, phase)
        del runners[MKL]
        if min_rows is not None:
            runners[MKL] = _runner(MKL, w, min_rows)
        scores = _scores(runners, x, PHASE_ROWS[phase], names[0])
    _MEASURE_S[0] += time.perf_counter() - t0
    return {"kernel": decide(scores, names), "score": {n: round(s, 4) for n, s in scores.items()},
            "load_avg_1m": round(os.getloadavg()[0], 2)}  # how shared the CPU was while timed


def _scores(runners: dict[str, Callable[[Tensor], Tensor]], x: Tensor, rows: tuple[int, ...],
            default: str) -> dict[str, float]:
    """Per candidate: the geometric mean over `rows` of its best time over the default's."""
    logs = {n: 0.0 for n in runners}
    for m in rows:
        part = x[:m].contiguous()  # (m, in)
        calls = {n: max(1, math.ceil(SAMPLE_S / _seconds(run, part, 1))) for n, run in runners.items()}
        best = {n: math.inf for n in runners}
        for _ in range(REPEATS):
            for n, run in runners.items():
                best[n] = min(best[n], _seconds(run, part, calls[n]))
        for n in runners:
            logs[n] += math.log(best[n] / best[default]) / len(rows)
    return {n: math.exp(v) for n, v in logs.items()}


def _seconds(run: Callable[[Tensor], Tensor], x: Tensor, calls: int) -> float:
    """Seconds per call of `run(x)`, over `calls` calls in a row."""
    t0 = time.perf_counter()
    for _ in range(calls):
        run(x)
    return (time.perf_counter() - t0) / calls


def _runner(name: str, w: Tensor, min_rows: int) -> Callable[[Tensor], Tensor]:
    """x (M, in) -> (M, out) on candidate `name` (MKL: calls padded to `min_rows` rows)."""
    if name == PANEL:
        return rowdot.panel_product(w, None)
    if name.startswith("rowdot "):
        lib = rowdot.library(name.split(" ", 1)[1])
        return rowdot.product(w, None, lib)
    from actors.model import PACK_ROWS, _packed_call

    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS)
    return lambda x: _packed_call(x, packed, w, None, min_rows)


def _mkl_min_rows(out_f: int, in_f: int, phase: str) -> int | None:
    """The probe's answer for MKL's packed path at the phase's tile (None: not row-free)."""
    from actors.model import DECODE_TILE, PREFILL_TILE, probed_min_rows

    return probed_min_rows(out_f, in_f, DECODE_TILE if phase == "decode" else PREFILL_TILE)


def _mkl_packed_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def cached(key: str, compute: Callable[[], Any]) -> Any:
    """The machine's answer for `key`: read from the cache file, or computed (holding the file's
    lock, so concurrent processes compute it once) and written back atomically. JSON values only.
    Where no cache directory can be written, computed once per process."""
    with _LOCK, _file_lock() as path:
        data = _read(path)
        if key not in data:
            data[key] = compute()
            _write(path, {**_read(path), key: data[key]})
        return data[key]


def cache_file() -> Path | None:
    """The machine's cache file (it need not exist yet); None where no directory can be written."""
    if "path" not in _FILE:
        name = f"kernel-choice-{_machine_key()}.json"
        _FILE["path"] = None
        for folder in rowdot.cache_dirs():
            try:
                folder.mkdir(parents=True, exist_ok=True)
                with open(folder / f"{name}.lock", "a"):
                    pass
            except OSError:
                continue
            _FILE["path"] = folder / name
            break
        if _FILE["path"] is None:
            log.warning("kernel choice: no writable cache directory; choices are measured per process")
    return _FILE["path"]


def _machine_key() -> str:
    """16 hex digits over the CPU fingerprint and rowdot's source (its speed is the source's)."""
    facts = json.dumps(cpu_fingerprint(), sort_keys=True).encode() + rowdot.SOURCE.read_bytes()
    return hashlib.sha1(facts).hexdigest()[:16]


@contextlib.contextmanager
def _file_lock():
    """Hold the cache file's exclusive lock (re-entered freely by this process); yields its path."""
    path = cache_file()
    if path is None or _HELD[0]:
        _HELD[0] += 1
        try:
            yield path
        finally:
            _HELD[0] -= 1
        return
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _HELD[0] += 1
        try:
            yield path
        finally:
            _HELD[0] -= 1
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(path: Path | None) -> dict:
    """The file's entries (this process's own where there is no file); {} for a damaged file."""
    if path is None:
        return _FILE.setdefault("data", {})
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return dict(entries) if isinstance(entries, dict) else {}


def _write(path: Path | None, entries: dict) -> None:
    """Replace the file in one rename (a reader sees the old file or the new one, whole)."""
    if path is None:
        _FILE["data"] = entries
        return
    body = json.dumps({"fingerprint": cpu_fingerprint(), "entries": entries}, indent=1, sort_keys=True)
    try:
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("kernel choice: cannot write %s (%s); kept for this process", path, e)
