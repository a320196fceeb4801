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
- `heap_frozen_while`: one step of an offline run (`LLM.generate`, `LLM.stream`), in a process
  that may build and drop engines. Nothing frozen stays frozen past the step, so an engine dropped
  later is collected whole (a freeze for the engine's life would keep a dropped engine's cycles,
  KV cache included, until some other call thawed them), and neither does a freeze span a
  stream's `yield`: a stream abandoned inside a reference cycle is then collectable, and its
  `finally` (which aborts its requests, freeing their blocks) runs. A freeze the application made
  itself is left as it is: `gc.unfreeze` cannot thaw only part of the frozen heap.
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
_run_froze = False  # whether the first of them froze (the heap was not frozen before it)


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
    first: both are constant-time, so a short block pays nothing). Nested or concurrent blocks
    thaw with the last; where the heap was already frozen (a serving process's freeze, or the
    application's own) this changes nothing."""
    global _runs, _run_froze
    with _lock:
        _runs += 1
        if _runs == 1:
            _run_froze = gc.get_freeze_count() == 0
            if _run_froze:
                gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _runs -= 1
            if _runs == 0 and _run_froze:
                _run_froze = False
                if not _process_frozen:  # a serving process froze its heap meanwhile
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
