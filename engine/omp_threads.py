"""One parallel thread per process: only the engine loop's thread runs torch ops on an OpenMP
team of several threads. The engine is built on a thread that then ends (its team ends with it),
and every other thread that touches tensors (gRPC handlers, KV shipping and receiving) runs them
on itself alone.

Why: libgomp gives each thread that starts a parallel region a team of its own, whose worker
threads stay alive, docked, for as long as that thread lives. Once a process holds more of them
than it has cores, libgomp cuts every team's spin-wait to ~1,000 iterations, so each parallel
region then waits on futex wake-ups. Measured on 2 cores (torch 2.13, bf16): a step loop on a
second thread while the main thread's team sat idle ran its small ops 3x slower (0.11 -> 0.34 ms
per linear + element-wise group), and a decode step of the default model took 38-44 ms instead of
25. A team of one starts no threads at all. (Setting the building thread's own count to one is not
enough: MKL keeps the process-wide count and starts a team there anyway.)

No-op where torch is not loaded or its OpenMP runtime is not libgomp / libiomp.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

_RUNTIMES = ("libgomp", "libiomp5")


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (found in this process's memory map), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if any(name in Path(path).name for name in _RUNTIMES):
            try:  # the library already in memory, not a second copy
                return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:
                return None
    return None


def use_one_torch_thread() -> None:
    """From now on this thread's torch ops run on this thread alone (call it first thing in
    any thread that is not the engine loop's)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return  # nothing has loaded an OpenMP runtime: nothing to confine
    # torch sets each thread's OpenMP thread count from its global setting at the thread's first
    # parallel-capable op; do that now, so the count set below is not overwritten later.
    torch.get_num_threads()
    runtime = _openmp()
    if runtime is not None:
        runtime.omp_set_num_threads(1)  # this thread's own setting: other threads keep theirs


def build_on_passing_thread(build: Callable[[], T]) -> T:
    """`build()` on a thread of its own that ends when it returns, taking whatever OpenMP team
    the build started with it (the step loop's thread then holds the only one)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as exc:  # re-raised on the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="engine-build")
    thread.start()
    thread.join()  # in-process work with no peer to wait on: it ends when the build does
    if failure:
        raise failure[0]
    return result[0]

