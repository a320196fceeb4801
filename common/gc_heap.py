"""Long-lived serving processes mark their startup heap static once they serve.

CPython's oldest-generation collection stops every thread and walks every tracked object, and in
a worker nearly all of them exist from startup and live as long as the process: the model's
modules, the tokenizer, one `Block` per KV block (hundreds of thousands on a large GPU). None of
them is ever garbage, yet each full collection walks them all, while the step loop, and with it
the GPU, waits. `gc.freeze()` moves what exists now to the permanent generation, which no
collection walks; what the process allocates later is collected as before. vLLM does the same in
its engine core, its workers and its API server.

Only for a process that keeps its engine until it exits: an object frozen here is never
collected, so a process that builds and drops engines (tests, offline benchmarks) must not call
this.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect what startup left behind, then freeze the rest; returns how many objects froze."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("startup heap frozen: %d objects, %.0f ms", frozen,
             (time.perf_counter() - start) * 1e3)
    return frozen


def thaw_heap() -> None:
    """Give the frozen heap back to the collector as the process stops, so that the interpreter's
    teardown frees it as usual (native modules such as Triton's report objects still alive at
    exit)."""
    gc.unfreeze()
