"""Builds (once, cached on disk) and loads the native CPU paged decode-attention kernel.

The kernel is compiled for this machine's instruction set (engine.native_build). If no compiler is
available the torch path is used instead.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

from engine.native_build import build_native, try_build_native

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
DISABLE_ENV = "PDSERVE_DISABLE_CPU_KERNEL"
PREFIX = "pdserve_paged_decode"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")


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
