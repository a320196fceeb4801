"""Builds (once, cached on disk) the native CPU kernels from their C++ sources.

Each kernel is compiled with torch's JIT extension builder for this machine's instruction set, so
the cache key includes the CPU's flags and the compiler flags. A kernel that cannot be built (no
compiler, no ninja) is None to its caller, which keeps its torch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
# Headers every native build may include (the AMX tiles' permission and configuration).
SHARED_HEADERS = Path(__file__).with_name("csrc")
# A build takes under a minute on 2 cores: a build lock this old outlived the process that took it.
STALE_LOCK_S = 900.0


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@functools.cache
def cpu_has_amx_bf16() -> bool:
    """Whether the CPU has AMX tiles for bfloat16 (Intel Xeon since Sapphire Rapids): there
    oneDNN's bfloat16 GEMMs, and SDPA's flash kernel built on them, beat the native kernels at all
    but a few rows (BENCHMARKS.md, "On an Intel Xeon with AMX")."""
    return "amx_bf16" in cpu_flags().split()


def extension_name(prefix: str, source: Path, cflags: tuple[str, ...]) -> str:
    """The build's name: the source, the headers beside it and the shared ones (it may include
    them), the CPU's flags and the compiler flags, hashed, and where the source and headers
    sit. torch keys a build folder by name alone and rebuilds it when the same source comes
    from another path: two checkouts on one machine (a clone for CI beside the working one)
    sharing a name rebuilt every kernel in turn, each time the other had loaded it."""
    folders = (source.parent, SHARED_HEADERS)
    headers = b"".join(h.read_bytes() for f in folders for h in sorted(f.glob("*.h")))
    where = "\0".join(str(p.resolve()) for p in (source, SHARED_HEADERS)).encode()
    key = source.read_bytes() + headers + cpu_flags().encode() + " ".join(cflags).encode()
    return f"{prefix}_{hashlib.sha256(key + where).hexdigest()[:12]}"


def wait_for_build_lock(name: str, poll_s: float = 0.5) -> bool:
    """torch waits on a build directory's lock file with no timeout, and a builder killed
    mid-build (SIGKILL, a parent's death signal) leaves that file behind: every later build of
    the module would wait forever. This waits while another process builds, but no longer than
    a lock can live: one older than any build is removed (True if one was)."""
    from torch.utils.cpp_extension import _get_build_directory  # where load() puts its lock

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    while True:
        try:
            age_s = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return False
        if age_s > STALE_LOCK_S:
            log.warning("removing a stale build lock (%.0f s old, its builder is gone): %s",
                        age_s, lock)
            lock.unlink(missing_ok=True)
            return True
        time.sleep(poll_s)


def build_native(prefix: str, source: Path, cflags: tuple[str, ...]) -> ModuleType:
    """Compiles (or loads the cached build of) `source`; raises where it cannot be built."""
    from torch.utils.cpp_extension import load

    name = extension_name(prefix, source, cflags)
    wait_for_build_lock(name)
    return load(name=name, sources=[str(source)], extra_cflags=list(cflags),
                extra_ldflags=["-fopenmp"], extra_include_paths=[str(SHARED_HEADERS)],
                verbose=False)


def try_build_native(prefix: str, source: Path, cflags: tuple[str, ...], what: str
                     ) -> ModuleType | None:
    """`build_native`, or None with one log line naming `what` falls back to torch."""
    try:
        return build_native(prefix, source, cflags)
    except Exception as exc:  # no compiler, no ninja, unsupported platform
        log.warning("%s unavailable, using the torch path: %s", what, exc)
        return None
