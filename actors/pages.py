"""Memory for large read-only streams (the packed weights every CPU product reads once a call).

A decode step streams every weight once. On 4 KiB pages that is a page crossing every 4 KiB: a
TLB miss each, and the hardware prefetchers stop at each boundary. `huge_page_empty` places a
tensor's whole 2 MiB stretches in an anonymous mapping advised for transparent huge pages
(`madvise(MADV_HUGEPAGE)`, before any page is touched, so the first writes fault in 2 MiB
pages). Only the placement differs: the values and every product's bits are the same.
`bench engine` times decode on both; it has not measured a gain yet (benchmarks/README.md).

Where the advice cannot be given (not Linux, a Python without `MADV_HUGEPAGE`, the kernel
refuses it), or with `RAYSCHED_HUGE_PAGES=0` in the environment when it is made, the tensor is
plain `torch.empty` memory. With THP set to `never` the advice is accepted and ignored. The
stretch past the last whole 2 MiB keeps 4 KiB pages, so no tensor takes more resident memory
than its bytes round up to 4 KiB.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's transparent huge page
ENV_SWITCH = "RAYSCHED_HUGE_PAGES"  # "0": plain memory (`bench engine` times both)


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised contiguous tensor of `shape`, its whole 2 MiB stretches advised for
    huge pages when it spans at least one (see the module's docstring). It keeps its mapping
    alive, and the mapping goes when the last view of it does."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None or os.environ.get(ENV_SWITCH) == "0":
        return torch.empty(shape, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(region, dtype=torch.uint8)
        start = (-raw.data_ptr()) % HUGE_PAGE  # the first 2 MiB boundary in the mapping
        region.madvise(advice, start, nbytes - nbytes % HUGE_PAGE)
    except (OSError, ValueError):
        return torch.empty(shape, dtype=dtype)
    return raw[start:start + nbytes].view(dtype).view(shape)


def advised_for_huge_pages(t: Tensor) -> bool:
    """Whether the mapping holding `t`'s first byte carries the huge-page advice (`hg` among its
    VmFlags in /proc/self/smaps; False where there is no such file). Whether the kernel then
    gave it huge pages depends on THP's setting and on free memory, which this does not say."""
    addr = t.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return False
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(h, 16) for h in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False
