"""Process bodies for the shared-transport tests (importable by spawned children): an exporting
"decode" process and a writing "prefill" process, with small caches."""

from __future__ import annotations

import os
import time

import torch

from engine.kv_memory import allocate_kv_buffer

SHAPE = (3, 2, 16, 4, 2, 8)  # layers, K/V, blocks, block size, KV heads, head dim
SRC_BLOCKS, DST_BLOCKS = [3, 4, 5, 9, 1], [10, 11, 12, 2, 0]  # runs: 3 of them


def source_cache() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))


def expected_blocks() -> torch.Tensor:
    return source_cache()[:, :, SRC_BLOCKS]


def exporter(queue, commands) -> None:
    """Exports a zeroed cache; reports its address, every closed mapping, and on request the
    blocks at DST_BLOCKS and whether every other block is still zero."""
    from kv_transfer.shared import KVExporter

    buffer = allocate_kv_buffer(SHAPE, torch.float32, torch.device("cpu"), shareable=True)
    exp = KVExporter("decode-t", buffer, on_gone=lambda key: queue.put(("gone", key)))
    queue.put(("address", exp.address))
    while True:
        command = commands.get(timeout=60)
        if command == "stop":
            return
        if command == "check":
            untouched = [b for b in range(SHAPE[2]) if b not in DST_BLOCKS]
            queue.put(("blocks", buffer.tensor[:, :, DST_BLOCKS].clone(),
                       bool((buffer.tensor[:, :, untouched] == 0).all())))


def writer(address: str, queue, plan: list[str]) -> None:
    """For each step: 'write' the blocks, or 'hang' (begin the write, then never finish: the
    test kills this process mid-write)."""
    from kv_transfer.errors import TransferError
    from kv_transfer.shared import SharedSender

    sender = SharedSender("prefill-t", timeout_s=5.0)
    src = source_cache()
    for step in plan:
        def begin(mapping_id: int, step: str = step) -> None:
            queue.put(("began", mapping_id))
            if step == "hang":
                time.sleep(600)

        def finish(ok: bool, num_bytes: int, seconds: float) -> bool:
            queue.put(("finished", ok, num_bytes))
            return True

        try:
            stats = sender.send("decode-t", address, src, SRC_BLOCKS, DST_BLOCKS, begin, finish)
            queue.put(("sent", stats.num_bytes, stats.transport))
        except TransferError as exc:
            queue.put(("error", str(exc), exc.permanent))
    sender.close()
    queue.close()
    queue.join_thread()  # os._exit would drop what the queue's feeder thread has not sent
    os._exit(0)
