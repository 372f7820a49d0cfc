"""A second device on a CPU-only machine, for tests: tensors that say they live on `meta` but
hold real CPU data, and refuse to meet plain CPU tensors in one op, as CUDA tensors do.

CI has no GPU, yet the bugs of device-to-host state movement (an `out=` buffer on the CPU for a
gather on the GPU, a CPU index tensor indexing device tensors, `.numpy()` of a device tensor)
only show with two devices. Inside `fake_device()`:
- a tensor created or moved to `meta` (`torch.zeros(..., device="meta")`, `t.to("meta")`) is a
  `DeviceTensor`: its `.device` is `meta`, so code takes its non-CPU paths, and its data is a
  CPU tensor (`.data_cpu`), so results keep their values;
- an op that mixes `DeviceTensor`s with plain CPU tensors of one or more dimensions raises
  `CrossDeviceError`, except the ops CUDA allows across devices: copies (`copy_`, `.to`),
  reading a scalar (`.item()`), and CPU index tensors in advanced indexing (`t[idx]`);
- `.numpy()` of a `DeviceTensor` raises (it does for a CUDA tensor), `.tolist()` works;
- a real `meta` tensor (no data) that reaches an op raises, so no value is ever made up.

It checks placement, not speed or streams: CUDA-only branches (`device.type == "cuda"`: pinned
memory, side streams, graph capture) are not taken, the generic device path is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten
DEVICE = torch.device("meta")  # what the fake device calls itself
_ACROSS = {aten.copy_.default, aten._to_copy.default, aten._local_scalar_dense.default}
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
             aten._index_put_impl_.default}  # their index list (argument 1) may stay on the CPU


class CrossDeviceError(RuntimeError):
    """An op mixed device and CPU tensors where a GPU would refuse them."""


class DeviceTensor(torch.Tensor):
    """A tensor on the fake device: metadata says `meta`, `data_cpu` holds the values."""

    data_cpu: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> "DeviceTensor":
        t = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=DEVICE, requires_grad=data.requires_grad)
        t.data_cpu = data
        return t

    def tolist(self) -> list:
        return self.data_cpu.tolist()

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert a fake-device tensor to numpy (a CUDA one cannot be either): "
                        "copy it to the host first")

    def __repr__(self) -> str:
        return f"DeviceTensor({self.data_cpu!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with _Placement():
            return func(*args, **(kwargs or {}))


def _on_device(kwargs: dict) -> bool:
    dev = kwargs.get("device")
    return dev is not None and torch.device(dev).type == DEVICE.type


class _Placement(TorchDispatchMode):
    """Runs every op on the CPU data, checking placement first and wrapping device results."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        to_device = _on_device(kwargs)
        on_device = any(isinstance(a, DeviceTensor) for a in flat)
        _check(func, args, kwargs, flat, on_device or to_device)
        originals = {id(a.data_cpu): a for a in flat if isinstance(a, DeviceTensor)}
        cpu_args, cpu_kwargs = tree_unflatten(
            [a.data_cpu if isinstance(a, DeviceTensor) else a for a in flat], spec)
        if to_device:
            cpu_kwargs["device"] = torch.device("cpu")
        out = func(*cpu_args, **cpu_kwargs)
        if func is aten._local_scalar_dense.default:
            return out
        moved_off = func is aten._to_copy.default and kwargs.get("device") is not None
        wrap = to_device or (on_device and not moved_off)
        leaves, out_spec = tree_flatten(out)
        return tree_unflatten([_result(o, originals, wrap) for o in leaves], out_spec)


def _check(func, args: tuple, kwargs: dict, flat: list, device_side: bool) -> None:
    """Raise where a GPU would: device and CPU tensors (1+ dims) in one op, or a data-less meta."""
    if any(type(a) is torch.Tensor and a.device.type == "meta" for a in flat):
        raise CrossDeviceError(f"{func}: a meta tensor made outside the fake device has no data")
    if func in _ACROSS or not device_side:
        return
    checked = flat if func not in _INDEXING else tree_flatten(((args[0], *args[2:]), kwargs))[0]
    cpu = [a for a in checked if type(a) is torch.Tensor and a.dim() > 0]
    if cpu:
        raise CrossDeviceError(f"{func}: expected all tensors on one device, got device (meta) and "
                               f"cpu tensors of shapes {[tuple(a.shape) for a in cpu]}")


def _result(o, originals: dict, wrap: bool):
    if not isinstance(o, torch.Tensor):
        return o
    if id(o) in originals:  # in place or out=: the very tensor passed in
        return originals[id(o)]
    if not wrap:
        return o
    with torch.inference_mode(False):  # a normal tensor, so views of it can share its version
        return DeviceTensor(o)


def _index(i):
    """A list index as a CPU index tensor (torch would make it a data-less meta one)."""
    if isinstance(i, list):
        return torch.tensor(i)
    if isinstance(i, tuple):
        return tuple(_index(j) for j in i)
    return i


class _Creation(TorchFunctionMode):
    """Python-level conversions that bypass the dispatcher: list indices, `torch.tensor(...,
    device="meta")`; turned into CPU tensors (moved to the fake device for the latter)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            args = (args[0], _index(args[1]), *args[2:])
        elif func in (torch.tensor, torch.as_tensor) and _on_device(kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k != "device"}
            return func(*args, **kwargs).to(DEVICE)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_device() -> Iterator[torch.device]:
    """Inside it, `meta` is a second device with real values (see the module doc)."""
    with _Creation(), _Placement():
        yield DEVICE


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """The CPU values of a fake-device tensor (a plain tensor as it is)."""
    return t.data_cpu if isinstance(t, DeviceTensor) else t
