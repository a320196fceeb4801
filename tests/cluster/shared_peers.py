"""Process bodies for the shared-transport tests (importable by spawned children): an exporting
"decode" process and a writing "prefill" process, with small caches."""

from __future__ import annotations

import os

import torch

from engine.kv_memory import KVBuffer, KVShards, allocate_kv_buffer

SHAPE = (3, 2, 16, 4, 2, 8)  # layers, K/V, blocks, block size, KV heads, head dim
SRC_BLOCKS, DST_BLOCKS = [3, 4, 5, 9, 1], [10, 11, 12, 2, 0]  # runs: 3 of them
SECRET = "the-reservations-transfer-secret"  # what the router gave the reservation


def source_cache() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))


def as_shards(tensor: torch.Tensor) -> KVShards:
    """A whole cache in one buffer (an engine of one rank)."""
    return KVShards.whole(KVBuffer(tensor, list(tensor.unbind(0))))


def expected_blocks() -> torch.Tensor:
    return source_cache()[:, :, SRC_BLOCKS]


class Recorder:
    """The exporting side's ReservationBook: admits every write, reports every event."""

    def __init__(self, queue) -> None:  # noqa: ANN001 - a multiprocessing queue
        self.queue = queue

    def admit(self, write) -> list[int]:  # noqa: ANN001 - a kv_transfer Write
        if write.request_id == "refused":
            raise KeyError(f"no reservation for request {write.request_id!r}")
        if write.secret != SECRET:
            raise PermissionError(f"request {write.request_id!r}: wrong transfer secret")
        self.queue.put(("began", write.writer, write.request_id))
        return DST_BLOCKS[:write.num_blocks]

    def complete(self, write, ok: bool, stats) -> bool:  # noqa: ANN001
        self.queue.put(("finished", write.writer, ok, stats.num_bytes if stats else 0))
        return True

    def refuse(self, write, reason: str) -> bool:  # noqa: ANN001
        self.queue.put(("refused", write.writer, reason))
        return True

    def writer_gone(self, writer: str) -> None:
        self.queue.put(("gone", writer))


def exporter(queue, commands) -> None:
    """Exports a zeroed cache; reports its address, every write event and closed mapping, and
    on request the blocks at DST_BLOCKS and whether every other block is still zero."""
    from kv_transfer.shared.exporter import KVExporter

    buffer = allocate_kv_buffer(SHAPE, torch.float32, torch.device("cpu"), shareable=True)
    exp = KVExporter("decode-t", KVShards.whole(buffer), Recorder(queue))
    queue.put(("address", exp.address))
    while True:
        command = commands.get(timeout=60)
        if command == "stop":
            return
        if command == "check":
            untouched = [b for b in range(SHAPE[2]) if b not in DST_BLOCKS]
            queue.put(("blocks", buffer.tensor[:, :, DST_BLOCKS].clone(),
                       bool((buffer.tensor[:, :, untouched] == 0).all())))


def interleaved_writes(sender, address: str, src: KVShards) -> list:  # noqa: ANN001
    """Two requests' writes open at once through one mapping, each copied in pieces: "a" gets
    the first three blocks (in two pieces), "b" the last two; "b" finishes first."""
    a = sender.begin("decode-t", address, "a", src, 3, SECRET)
    b = sender.begin("decode-t", address, "b", src, 2, SECRET)
    a.copy(src, SRC_BLOCKS[:2], DST_BLOCKS[:2])
    b.copy(src, SRC_BLOCKS[3:], DST_BLOCKS[3:])
    return [sender.complete(b, src, [], []),
            sender.complete(a, src, SRC_BLOCKS[2:3], DST_BLOCKS[2:3])]


def writer(address: str, queue, plan: list[str]) -> None:
    """For each step: 'write' the blocks, 'refused' (the exporter refuses the write), 'hang'
    (the write begins, then this process stalls inside it: the test kills it mid-write),
    'interleaved' (interleaved_writes) or 'wrong-secret' (a write without the secret)."""
    from kv_transfer.errors import TransferError
    from kv_transfer.shared.sender import SharedSender

    src = as_shards(source_cache())
    sender = SharedSender("prefill-t", timeout_s=5.0,
                          pause_in_write_s=600.0 if "hang" in plan else 0.0)
    for step in plan:
        try:
            if step == "interleaved":
                for stats in interleaved_writes(sender, address, src):
                    queue.put(("sent", stats.num_bytes, stats.transport))
                continue
            secret = "a-guess" if step == "wrong-secret" else SECRET
            stats = sender.send("decode-t", address, step, src, SRC_BLOCKS, DST_BLOCKS, secret)
            queue.put(("sent", stats.num_bytes, stats.transport))
        except TransferError as exc:
            queue.put(("error", str(exc), exc.permanent))
    sender.close()  # says bye: no write in flight
    queue.close()
    queue.join_thread()  # os._exit would drop what the queue's feeder thread has not sent
    os._exit(0)
