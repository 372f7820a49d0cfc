"""What the CPU kernels of this process run on: the CPU, torch's build, MKL's code path.

The engine's speed and its batch-invariant matrix path (`actors.model.TiledLinear`) depend on
the kernels MKL picks, and MKL picks them by CPU vendor and features: on an Intel CPU by
instruction set (which `MKL_ENABLE_INSTRUCTIONS` can lower), on an AMD one its generic
dispatch with Zen kernels (measured on an AMD EPYC, Zen 4 with AVX-512 hidden by the VM: the
same kernel, `mkl_blas_def_sgemm_kernel_0_zen` in `perf`, and the same bits whatever
`MKL_ENABLE_INSTRUCTIONS` says; `MKL_CBWR=COMPATIBLE` does change it). `describe()` gathers
what tells these apart; `raysched bench engine` prints it and puts it in its JSON.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

PATH_ENV = ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ATEN_CPU_CAPABILITY", "MKL_DEBUG_CPU_TYPE")
FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
_MKL_HEADER: list[str | None] = []  # MKL prints its header once per process: read it once


def describe() -> dict:
    """The CPU (model, vendor, family/model numbers, vector flags), torch's version and CPU
    build, MKL's own line about its code path, the environment variables that steer it, and a
    fingerprint of an fp32 GEMM's bits (the same fingerprint: the same summation order)."""
    cpu = _cpuinfo()
    flags = cpu_flags()
    return {"cpu_model": cpu.get("model name", "unknown"), "cpu_vendor": cpu.get("vendor_id"),
            "cpu_family_model": f"{cpu.get('cpu family')}/{cpu.get('model')}",
            "cpu_flags": [f for f in FLAGS if f in flags],
            "torch": torch.__version__, "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl_version": _mkl_version(), "mkl_path": mkl_path(),
            "env": {k: os.environ[k] for k in PATH_ENV if k in os.environ},
            "gemm_fingerprint": gemm_fingerprint()}


def mkl_path() -> str | None:
    """The processor line of MKL's verbose header: the instruction path it chose ("Intel(R)
    Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors", ...; "Intel(R)
    Architecture processors" for its generic dispatch, the one it takes on AMD), and its
    reproducibility mode (CNR). None without MKL, or when the header was printed before."""
    if not _MKL_HEADER:
        _MKL_HEADER.append(_read_mkl_verbose() if torch.backends.mkl.is_available() else None)
    return _MKL_HEADER[0]


def _read_mkl_verbose() -> str | None:
    """One small GEMM with MKL's verbose mode on, its stdout captured at the file descriptor."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
                torch.mm(torch.ones(4, 4), torch.ones(4, 4))
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        lines = f.read().decode(errors="replace").splitlines()
    header = next((l for l in lines if " for Intel(R) 64 architecture " in l), None)
    if header is None:
        return None
    path = header.split(" for Intel(R) 64 architecture ", 1)[1].split(", Lnx")[0]
    cnr = next((w for l in lines for w in l.split() if w.startswith("CNR:")), "CNR:?")
    return f"{path}; {cnr}"


def _mkl_version() -> str | None:
    line = next((l for l in torch.__config__.show().splitlines() if "Math Kernel Library" in l), None)
    return line.strip(" -") if line else None


def gemm_fingerprint() -> str:
    """12 hex digits of the bits of a seeded fp32 (16, 512) x (512, 512)^T product."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 512, generator=g), torch.randn(512, 512, generator=g)
    return hashlib.sha1(F.linear(x, w).numpy().tobytes()).hexdigest()[:12]


def cpu_fingerprint() -> dict:
    """What names this kind of CPU and the libraries its kernels come from (not this one chip):
    model name, vendor, family/model/stepping, the vector flags of `FLAGS`, torch's version,
    MKL's version and the environment variables that steer MKL and ATen. Machines with equal
    fingerprints run the same kernels (`actors.kernel_choice` keys its per-machine table by it)."""
    cpu = _cpuinfo()
    flags = cpu_flags()
    return {"cpu_model": cpu.get("model name", "unknown"), "cpu_vendor": cpu.get("vendor_id"),
            "cpu_family_model_stepping": f"{cpu.get('cpu family')}/{cpu.get('model')}/{cpu.get('stepping')}",
            "cpu_flags": [f for f in FLAGS if f in flags], "torch": torch.__version__,
            "mkl_version": _mkl_version(), "env": {k: os.environ[k] for k in PATH_ENV if k in os.environ}}


def cpu_flags() -> set[str]:
    """The first processor's feature flags (/proc/cpuinfo; empty where there is none)."""
    return set(_cpuinfo().get("flags", "").split())


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields
