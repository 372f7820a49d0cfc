"""A long-running control-plane process's memory: its heap, and its garbage collector (torch-free).

The scheduler handles a stream of mid-sized buffers (snapshots under Ray's 100 KiB inline limit
arrive in its heap; gRPC messages): glibc keeps such freed blocks in its arenas, so the RSS of a
scheduler that had served 2,000 requests grew by ~25 MiB of free-but-retained heap (measured:
`malloc_trim` gave it back). Serving blocks of 32 KiB and more from mmap, and trimming the heap
top past 128 KiB, keeps that memory returned to the system as it is freed.

    release_freed_memory()   # once, at process start; False where it does not apply
    trim_heap()              # now and then: hand back what a burst (a backlog of calls) left free
    tune_gc()                # once the process's long-lived objects exist: fewer, shorter collections
    GcPauses()               # how long Python's garbage collector held the process, per collection
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections import deque

from raysched.stats import percentile

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 10
TRIM_THRESHOLD_BYTES = 128 << 10


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Tune glibc's malloc for this process as above; False (nothing changed) on another libc."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def trim_heap() -> bool:
    """Return the free memory inside glibc's heaps to the system (`malloc_trim`; ~1 ms). Peaks,
    such as a backlog of a thousand pending calls, otherwise stay in the RSS for good."""
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    return bool(malloc_trim(0)) if malloc_trim is not None else False


GC_YOUNG_THRESHOLD = 20_000  # allocations between young collections (Python's default: 700)


def tune_gc() -> None:
    """For the scheduler's process, once its parts are built: freeze what exists (the modules,
    Ray's objects, the parts: never garbage, and no longer scanned by full collections), and
    collect the young generation every `GC_YOUNG_THRESHOLD` allocations instead of 700.

    Measured at 256 simulated workers (`raysched bench scale`, 64 per host, 10 ms steps, two
    runs each): the collector held the scheduler 1.1-1.3 s in a run, in ~770 collections, the
    longest 105-112 ms (full collections, during which no stream gets a token); tuned, 0.08-0.10 s
    in 4 collections, the longest 31-37 ms."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


class GcPauses:
    """Records each garbage collection of this process: its generation, and the seconds it held
    the interpreter. A decision that a collection interrupts takes that long more."""

    def __init__(self, keep: int = 20000) -> None:
        self.pauses: deque = deque(maxlen=keep)  # seconds, the latest `keep` collections
        self.collections = [0, 0, 0]
        self._t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._t0)
            self.collections[info["generation"]] += 1

    def summary(self) -> dict:
        """Collections per generation, and pause p50/p99/max in seconds."""
        return {"collections": list(self.collections), "pause_p50_s": percentile(self.pauses, 50),
                "pause_p99_s": percentile(self.pauses, 99), "pause_max_s": max(self.pauses, default=None),
                "pause_total_s": sum(self.pauses)}
