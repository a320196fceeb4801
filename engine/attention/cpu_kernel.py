"""Builds (once, cached on disk) and loads the native CPU paged decode-attention kernel.

The kernel is compiled with torch's JIT extension builder for this machine's instruction set, so
the cache key includes the CPU's flags. If no compiler is available the torch path is used instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
DISABLE_ENV = "PDSERVE_DISABLE_CPU_KERNEL"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")


def extension_name(source: Path = SOURCE, extra_cflags: tuple[str, ...] = ()) -> str:
    key = source.read_bytes() + _cpu_flags().encode() + " ".join(extra_cflags).encode()
    return f"pdserve_paged_decode_{hashlib.sha256(key).hexdigest()[:12]}"


def build_kernel(source: Path = SOURCE, extra_cflags: tuple[str, ...] = ()) -> ModuleType:
    """Compiles (or loads the cached build of) `source`; raises where it cannot be built. The
    benchmark passes another source to compare kernels in one process; the tests pass
    `-mno-avx512f` to build the portable path a machine without AVX-512 gets."""
    from torch.utils.cpp_extension import load

    return load(name=extension_name(source, extra_cflags), sources=[str(source)],
                extra_cflags=[*CFLAGS, *extra_cflags], extra_ldflags=["-fopenmp"], verbose=False)


@functools.cache
def load_cpu_kernel() -> ModuleType | None:
    """The compiled module, or None (with one log line) where it cannot be built."""
    if os.environ.get(DISABLE_ENV):
        return None
    try:
        return build_kernel()
    except Exception as exc:  # no compiler, no ninja, unsupported platform
        log.warning("native CPU decode attention unavailable, using the torch path: %s", exc)
        return None
