"""What CPython's cyclic collector walks while an engine runs.

Its oldest-generation collection stops every thread and walks every tracked object, and in a
process that runs an engine nearly all of them exist before the first step and outlive the last:
the model's modules, the tokenizer, one `Block` per KV block (hundreds of thousands on a large
GPU). None of them is garbage, yet each full collection walks them all while the step loop, and
with it the GPU, waits: ~60-200 ms on a 2-core Xeon with 4 GB of KV blocks. `gc.freeze()` moves
what exists now to the permanent generation, which no collection walks; what is allocated later
is collected as before. vLLM freezes its engine core's heap once it is built and thaws it at
shutdown.

Two scopes:
- `freeze_startup_heap`: a serving process (worker, router) that keeps its engine until it exits,
  once it serves; `thaw_heap` as it stops.
- `heap_frozen_while`: one offline run (`LLM.generate`), in a process that may build and drop
  engines. Nothing frozen stays frozen past the run, so an engine dropped later is collected
  whole (a freeze for the engine's life would keep a dropped engine's cycles, KV cache included,
  until some other call thawed them).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

_lock = threading.Lock()
_process_frozen = False  # freeze_startup_heap's, until thaw_heap
_runs = 0  # heap_frozen_while scopes open


def freeze_startup_heap() -> int:
    """Collect what startup left behind, then freeze the rest; returns how many objects froze."""
    global _process_frozen
    start = time.perf_counter()
    gc.collect()
    with _lock:
        gc.freeze()
        _process_frozen = True
    frozen = gc.get_freeze_count()
    log.info("startup heap frozen: %d objects, %.0f ms", frozen,
             (time.perf_counter() - start) * 1e3)
    return frozen


def thaw_heap() -> None:
    """Give the frozen heap back to the collector as the process stops, so that the interpreter's
    teardown frees it as usual (native modules such as Triton's report objects still alive at
    exit)."""
    global _process_frozen
    with _lock:
        gc.unfreeze()
        _process_frozen = False


@contextlib.contextmanager
def heap_frozen_while() -> Iterator[None]:
    """Freeze what exists now for the length of the block, and thaw it after (no collection
    first: both are constant-time, so a short call pays nothing). Nested or concurrent blocks
    thaw with the last; under a process-wide freeze this changes nothing."""
    global _runs
    with _lock:
        _runs += 1
        if _runs == 1 and not _process_frozen:
            gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _runs -= 1
            if _runs == 0 and not _process_frozen:
                gc.unfreeze()


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """No automatic collection during the block, after one full collection before it, and the
    heap frozen meanwhile. For CUDA graph capture, as vLLM does: a collection during a capture
    can finalize an object whose teardown calls the CUDA driver (a Triton kernel unloading its
    module), which breaks the capture. Frozen, a collection that torch makes itself before a
    capture (older releases always did; 2.13 where `force_cudagraph_gc` is set) walks only what
    the captures allocated, not every KV block once per graph."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with heap_frozen_while():
            yield
    finally:
        if was_enabled:
            gc.enable()
