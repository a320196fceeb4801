"""How KV arrives at a decode worker: its ReservationBook, which admits its receiver connectors'
writes into reserved blocks, completes them and refuses them (whatever the transport) over the
reservation table, and counts and logs each outcome."""

from __future__ import annotations

import logging

from decode_worker.reservations import ReservationTable
from engine.engine import LLMEngine
from engine.request import Request
from kv_transfer import TransferStats, Write
from serving.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class KVArrivals:
    """A ReservationBook (kv_transfer.connector) over the worker's reservations; safe from the
    connectors' threads (it reads only what never changes of the engine)."""

    def __init__(self, table: ReservationTable, engine: LLMEngine, metrics: WorkerMetrics):
        self.table = table
        self.engine = engine
        self.metrics = metrics

    def admit(self, write: Write) -> list[int]:
        request = self.table.begin_receive(write.request_id, write.writer,
                                           first_block=write.first_block, secret=write.secret)
        try:
            fresh = fresh_blocks(self.engine, request)
            check_piece(self.engine, len(fresh), write)
        except ValueError:
            self.table.end_receive(write.request_id, ok=False)
            raise
        return fresh[write.first_block:write.first_block + write.num_blocks]

    def complete(self, write: Write, ok: bool, stats: TransferStats | None) -> bool:
        rid = write.request_id
        if self.table.writer_of(rid) != write.writer:
            raise KeyError(f"request {rid!r} is not being written by {write.writer}")
        held = self.table.end_receive(rid, ok, None if write.last else write.num_blocks)
        if ok and stats is not None:
            self.metrics.transfer("received", stats.num_bytes, stats.seconds, write.transport)
        elif not ok:
            self.metrics.transfer_failed("received", write.transport)
            log.warning("the KV write of %s by %s failed", rid, write.writer)
        return held

    def refuse(self, write: Write, reason: str) -> bool:
        self.metrics.integrity_failed(write.transport)
        log.warning("refused KV of %s from %s: %s", write.request_id, write.writer, reason)
        return self.table.refuse_receive(write.request_id)

    def writer_gone(self, writer: str) -> None:
        for request_id in self.table.writer_gone(writer):
            log.warning("%s closed during the write of %s; blocks freed", writer, request_id)


def num_cached_blocks(engine: LLMEngine, request: Request) -> int:
    return request.num_cached_tokens // engine.block_manager.block_size


def fresh_blocks(engine: LLMEngine, request: Request) -> list[int]:
    """A reservation's blocks that a transfer writes (those after its prefix-cache hits)."""
    return list(request.block_ids[num_cached_blocks(engine, request):])


def check_piece(engine: LLMEngine, reserved: int, write: Write) -> None:
    """A write of [first_block, first_block + num_blocks) of `reserved` fresh blocks; the last
    piece ends at the last block."""
    end = write.first_block + write.num_blocks
    more = not write.last
    if end > reserved or (not more and end != reserved) or (more and write.num_blocks == 0):
        raise ValueError(f"num_blocks is {write.num_blocks} from first_block {write.first_block} "
                         f"({'more to come' if more else 'the last piece'}) but {reserved} "
                         f"blocks are reserved")
    ours = str(engine.dtype).removeprefix("torch.")
    if write.dtype != ours:
        raise ValueError(f"dtype {write.dtype!r} does not match this worker's KV cache ({ours})")
