"""Builds (once, cached on disk) the native CPU kernels from their C++ sources.

Each kernel is compiled with torch's JIT extension builder for this machine's instruction set, so
the cache key includes the CPU's flags and the compiler flags. A kernel that cannot be built (no
compiler, no ninja) is None to its caller, which keeps its torch path.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def extension_name(prefix: str, source: Path, cflags: tuple[str, ...]) -> str:
    key = source.read_bytes() + cpu_flags().encode() + " ".join(cflags).encode()
    return f"{prefix}_{hashlib.sha256(key).hexdigest()[:12]}"


def build_native(prefix: str, source: Path, cflags: tuple[str, ...]) -> ModuleType:
    """Compiles (or loads the cached build of) `source`; raises where it cannot be built."""
    from torch.utils.cpp_extension import load

    return load(name=extension_name(prefix, source, cflags), sources=[str(source)],
                extra_cflags=list(cflags), extra_ldflags=["-fopenmp"], verbose=False)


def try_build_native(prefix: str, source: Path, cflags: tuple[str, ...], what: str
                     ) -> ModuleType | None:
    """`build_native`, or None with one log line naming `what` falls back to torch."""
    try:
        return build_native(prefix, source, cflags)
    except Exception as exc:  # no compiler, no ninja, unsupported platform
        log.warning("%s unavailable, using the torch path: %s", what, exc)
        return None
