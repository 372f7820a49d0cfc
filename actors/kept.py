"""Values made from a tensor and kept until the tensor changes (a decode step's constants).

`kept(store, name, t, make, extra)` returns `make()`, made once and kept in `store[name]` while
`t` is the same tensor, with the same storage, unwritten since (its version counter), in the
same inference mode (a tensor made in it is read-only outside), and `extra` is equal. Uses:
decode's per-layer constants derived from parameters (`actors.mamba.derived`: conv taps,
-exp(A_log), D), the RoPE tables every attention layer of a forward shares, and the slots a
fused state update checked. CPU tensors only: on a GPU a value kept from one CUDA graph's
capture would live in that graph's memory, so there (and for inference tensors, which keep no
version counter) the value is made each time.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def kept(store: dict, name: str, t: Tensor, make: Callable[[], T], extra: tuple = ()) -> T:
    """`make()`, kept in `store[name]` until `t` or `extra` changes (see the module doc). The
    entry holds `t` itself, so no other tensor takes its id meanwhile."""
    if t.is_inference() or t.device.type != "cpu":
        return make()
    key = (t.data_ptr(), t._version, torch.is_inference_mode_enabled(), extra)
    entry = store.get(name)
    if entry is None or entry[0] is not t or entry[1] != key:
        entry = store[name] = (t, key, make())
    return entry[2]
