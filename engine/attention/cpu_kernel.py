"""Builds (once, cached on disk) and loads the native CPU attention kernels: paged decode
attention (csrc/paged_decode.cpp) and causal prefill attention (csrc/prefill_attention.cpp).

Each is compiled for this machine's instruction set (engine.native_build). If no compiler is
available, or the machine lacks what a kernel needs, the torch path is used instead.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

from engine.native_build import build_native, cpu_flags, try_build_native

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
DISABLE_ENV = "PDSERVE_DISABLE_CPU_KERNEL"
PREFIX = "pdserve_paged_decode"
PREFILL_SOURCE = SOURCE.with_name("prefill_attention.cpp")
PREFILL_DISABLE_ENV = "PDSERVE_DISABLE_CPU_PREFILL_KERNEL"
PREFILL_PREFIX = "pdserve_prefill_attention"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")
# What a CPU with AVX512-BF16 but no AMX builds (the prefill kernel's bf16 products on vdpbf16ps):
# the tests and the benchmark build it on AMX machines too.
NO_AMX_CFLAGS = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


def build_kernel(source: Path = SOURCE, extra_cflags: tuple[str, ...] = ()) -> ModuleType:
    """Compiles (or loads the cached build of) `source`; raises where it cannot be built. The
    benchmark passes another source to compare kernels in one process; the tests pass
    `-mno-avx512f` or `-mno-avx2` to build the paths machines without AVX-512 (the AVX2 kernel) or
    without AVX2 (the plain-loop path) get."""
    return build_native(PREFIX, source, (*CFLAGS, *extra_cflags))


@functools.cache
def load_cpu_kernel() -> ModuleType | None:
    """The compiled module, or None (with one log line) where it cannot be built."""
    if os.environ.get(DISABLE_ENV):
        return None
    return try_build_native(PREFIX, SOURCE, CFLAGS, "native CPU decode attention")


def build_prefill_kernel(extra_cflags: tuple[str, ...] = ()) -> ModuleType:
    """Compiles (or loads the cached build of) the prefill kernel; raises where it cannot."""
    return build_native(PREFILL_PREFIX, PREFILL_SOURCE, (*CFLAGS, *extra_cflags))


def prefill_kernel_applies() -> bool:
    """Whether the prefill kernel has a path for this CPU (AVX-512, or AVX2 with FMA)."""
    flags = set(cpu_flags().split())
    return "avx512f" in flags or {"avx2", "fma"} <= flags


@functools.cache
def load_prefill_kernel() -> ModuleType | None:
    """The compiled prefill kernel where this machine runs it (AVX-512, or AVX2 with FMA; its
    `supports(dtype)` says which dtypes, `uses_amx()` whether its bf16 products run on AMX
    tiles), else None: SDPA's flash kernel attends prompts instead."""
    if os.environ.get(DISABLE_ENV) or os.environ.get(PREFILL_DISABLE_ENV):
        return None
    if not prefill_kernel_applies():
        return None  # the kernel has no path for this CPU: nothing to build
    return try_build_native(PREFILL_PREFIX, PREFILL_SOURCE, CFLAGS, "native CPU prefill attention")
