"""Keep a long-running control-plane process's heap from holding freed memory (torch-free).

The scheduler handles a stream of mid-sized buffers (snapshots under Ray's 100 KiB inline limit
arrive in its heap; gRPC messages): glibc keeps such freed blocks in its arenas, so the RSS of a
scheduler that had served 2,000 requests grew by ~25 MiB of free-but-retained heap (measured:
`malloc_trim` gave it back). Serving blocks of 32 KiB and more from mmap, and trimming the heap
top past 128 KiB, keeps that memory returned to the system as it is freed.

    release_freed_memory()   # once, at process start; False where it does not apply
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 10
TRIM_THRESHOLD_BYTES = 128 << 10


def release_freed_memory() -> bool:
    """Tune glibc's malloc for this process as above; False (nothing changed) on another libc."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
