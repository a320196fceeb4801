"""The decode worker's policy over the shared engine loop: reservations under leases, KV arrival,
admission into the running batch, and colocated generation. Every engine access runs on the loop
thread (through `loop.call`); KV bytes are received on the caller's thread into reserved blocks."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from decode_worker.reservations import ReservationTable
from engine.engine import LLMEngine, RequestOutput
from engine.request import Request, SamplingParams
from kv_transfer import (
    IntegrityError,
    KVExporter,
    KVReceiver,
    PieceId,
    TransferError,
    TransferStats,
    verify_piece,
)
from serving.gate import Gate, check_queue
from serving.loop import EngineLoop
from serving.metrics import WorkerMetrics
from serving.options import WorkerOptions

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 30.0  # a loop command waits at most one long step plus the queue ahead


class NoRoom(Exception):
    """Not enough free KV blocks for the reservation."""


@dataclass(frozen=True)
class ReservedBlocks:
    block_ids: list[int]  # the blocks the prompt's KV is to be written into
    transfer_address: str
    # The prompt's first blocks already sit in this worker's prefix cache: they are shared with
    # the request and not sent again; `block_ids` are the blocks after them.
    num_cached_blocks: int = 0


class DecodePolicy:
    def __init__(self, table: ReservationTable):
        self.table = table

    def before_step(self, engine: LLMEngine) -> None:
        for request_id in self.table.expire():
            log.warning("reservation of %s expired before its KV arrived; blocks freed",
                        request_id)

    def after_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        pass


class DecodeWorker:
    def __init__(self, engine: LLMEngine, options: WorkerOptions):
        self.options = options
        self.worker_id = options.worker_id
        # Transfers begin and end on the RPC threads; freeing blocks is the loop's job.
        self.table = ReservationTable(
            release=lambda request: self.loop.post(lambda e: e.release(request)))
        self.metrics = WorkerMetrics(options.role, lambda: self.loop.load)
        self.gate = Gate(options.worker_id, self.metrics, options.max_queued_requests)
        self.loop = EngineLoop(engine, DecodePolicy(self.table), observer=self.metrics)
        self.receiver = KVReceiver(options.worker_id, options.host, torch.device(options.device),
                                   options.transfer_timeout_s)
        self.transfer_address = f"{options.public_host}:{self.receiver.port}"
        # Same-host prefill workers write into our cache themselves (kv_transfer.shared).
        self.exporter = (KVExporter(options.worker_id, engine.runner.kv_buffer, handler=self)
                         if options.kv_transport != "dist" and options.role == "decode" else None)
        self.kv_export_address = self.exporter.address if self.exporter else ""

    # ---- disaggregated path ----------------------------------------------------------------
    def reserve(self, request_id: str, token_ids: list[int], params: SamplingParams,
                lease_s: float, secret: str = "") -> ReservedBlocks:
        """ValueError on bad input, NoRoom when the blocks do not fit right now."""

        def run(engine: LLMEngine) -> ReservedBlocks:
            if request_id in self.table:
                raise ValueError(f"request_id {request_id!r} already holds a reservation")
            request = engine.new_request(token_ids, params, request_id)
            if not engine.reserve(request):
                raise NoRoom(f"{engine.block_manager.blocks_needed(len(token_ids))} KV blocks "
                             f"needed, {engine.block_manager.num_free_blocks} free")
            self.table.add(request, lease_s, secret)
            cached = _num_cached_blocks(engine, request)
            return ReservedBlocks(list(request.block_ids[cached:]), self.transfer_address, cached)

        return self.loop.call(run, COMMAND_TIMEOUT_S)

    def receive_kv(self, request_id: str, sender_id: str, generation: int, tag: int,
                   num_blocks: int, dtype: str, first_block: int = 0,
                   more: bool = False, secret: str = "", mac: bytes = b"") -> TransferStats:
        """dist transport: receive the prompt's KV, or one piece of it (see ReceiveKVRequest),
        into the reserved blocks (KeyError: no such reservation; ValueError: shape/dtype
        mismatch or a piece out of order; IntegrityError: the bytes do not match `mac`,
        nothing written, the reservation stays reserved; TransferError: the transfer
        failed)."""
        engine = self.loop.engine
        began = False
        try:
            request = self.table.begin_receive(request_id, first_block=first_block,
                                               secret=secret)
            began = True
            fresh = _fresh_blocks(engine, request)
            _check_piece(engine, len(fresh), first_block, num_blocks, more, dtype)
        except (KeyError, ValueError, PermissionError) as exc:
            self.receiver.refuse(sender_id, generation, tag, str(exc))
            if began:  # only the receive this call began: another may be writing
                self.table.end_receive(request_id, ok=False)
            raise
        piece = PieceId(request_id, first_block, num_blocks, last=not more)
        return self._receive_piece(piece, sender_id, generation, tag,
                                   fresh[first_block:first_block + num_blocks],
                                   lambda layers: verify_piece(secret, piece, layers, mac))

    def _receive_piece(self, piece: PieceId, sender_id: str, generation: int, tag: int,
                       block_ids: list[int], check: Callable[[Sequence[torch.Tensor]], None]
                       ) -> TransferStats:
        """Receive a begun piece into `block_ids`, then end the receive: held on, refused
        (nothing written: RESERVED again) or failed (blocks freed)."""
        rid, outcome = piece.request_id, "failed"
        try:
            stats = self.receiver.receive(sender_id, generation, tag,
                                          self.loop.engine.runner.kv_caches, block_ids, check)
            outcome = "ok"
            self.metrics.transfer("received", stats.num_bytes, stats.seconds, "dist")
            return stats
        except IntegrityError:
            outcome = "refused"
            self.metrics.integrity_failed("dist")
            log.warning("refused a KV piece of %s from %s: its bytes do not match their MAC",
                        rid, sender_id)
            raise
        except TransferError as exc:
            self.metrics.transfer_failed("received", "dist")
            log.warning("receiving KV of %s from %s failed: %s", rid, sender_id, exc)
            raise
        finally:
            if outcome == "refused":
                held = self.table.refuse_receive(rid)
            else:
                held = self.table.end_receive(rid, outcome == "ok",
                                              None if piece.last else len(block_ids))
            if outcome == "ok" and not held:
                raise TransferError(f"request {rid!r} was aborted during its transfer")

    # ---- shared transport: same-host writers copy into our cache (kv_transfer.shared) -------
    def begin_write(self, writer: str, request_id: str, num_blocks: int, dtype: str,
                    secret: str = "") -> None:
        """Let a live mapping of our cache write into a reservation's blocks (RECEIVING from here
        on, until end_write or the mapping closes). Runs on that mapping's exporter thread."""
        request = self.table.begin_receive(request_id, writer, secret=secret)
        try:
            _check_shape(self.loop.engine, _fresh_blocks(self.loop.engine, request), num_blocks,
                         dtype)
        except ValueError:
            self.table.end_receive(request_id, ok=False)
            raise

    def end_write(self, writer: str, request_id: str, ok: bool, num_bytes: int,
                  seconds: float) -> bool:
        """A mapping's write ended; True while the request still holds its blocks (KV ready)."""
        if self.table.writer_of(request_id) != writer:
            raise KeyError(f"request {request_id!r} is not being written by {writer}")
        held = self.table.end_receive(request_id, ok)
        if ok and held:
            self.metrics.transfer("received", num_bytes, seconds, "shared")
        elif not ok:
            self.metrics.transfer_failed("received", "shared")
            log.warning("the KV write of %s by %s failed", request_id, writer)
        return held

    def writer_gone(self, writer: str) -> None:
        """A mapping closed: none of its writes can land any more."""
        for request_id in self.table.writer_gone(writer):
            log.warning("the mapping %s closed during the write of %s; blocks freed", writer,
                        request_id)

    def admit(self, request_id: str, first_token: int, logprobs: dict[int, float] | None
              ) -> tuple[float, Iterator[RequestOutput]]:
        """Start decoding a request whose KV arrived: the seconds until it joined the batch
        (the loop finishing its step), and its outputs (first token first)."""
        outputs: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        called = time.monotonic()

        def run(engine: LLMEngine) -> None:
            request = self.table.take_ready(request_id)
            self.loop.sinks[request_id] = outputs.put
            first = engine.admit_prefilled(request, first_token, logprobs)
            if first.finished:  # the caller already has the first token; only the end is news
                self.loop.deliver(first)

        self.loop.call(run, COMMAND_TIMEOUT_S)
        return time.monotonic() - called, _drain(outputs)

    # ---- colocated path --------------------------------------------------------------------
    def generate(self, request_id: str, token_ids: list[int], params: SamplingParams
                 ) -> Iterator[RequestOutput]:
        """The whole generation on this worker (prefill + decode): the colocated baseline."""
        outputs: queue.Queue[RequestOutput | BaseException] = queue.Queue()

        def run(engine: LLMEngine) -> None:
            request = engine.new_request(token_ids, params, request_id)
            check_queue(engine.scheduler.num_waiting, self.gate.max_queued_requests)
            self.loop.sinks[request_id] = outputs.put
            engine.scheduler.add(request)

        self.loop.call(run, COMMAND_TIMEOUT_S)
        return _drain(outputs)

    # ---- both ------------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        return self.loop.call(lambda e: self._abort_on_loop(e, request_id), COMMAND_TIMEOUT_S)

    def _abort_on_loop(self, engine: LLMEngine, request_id: str) -> bool:
        found = self.table.abort(request_id)
        if engine.abort(request_id) is not None:
            self.loop.deliver(RuntimeError("aborted"), request_id)
            found = True
        return found

    def abort_later(self, request_id: str) -> None:
        """Abort without waiting (safe from gRPC callbacks)."""
        self.loop.post(lambda e: self._abort_on_loop(e, request_id))

    def in_flight(self) -> int:
        """Requests reserved, receiving, waiting or decoding here (drain waits for 0)."""
        return self.loop.call(lambda e: self.loop.num_in_flight() + len(self.table),
                              COMMAND_TIMEOUT_S)

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
        self.loop.stop()


def _num_cached_blocks(engine: LLMEngine, request: Request) -> int:
    return request.num_cached_tokens // engine.block_manager.block_size


def _fresh_blocks(engine: LLMEngine, request: Request) -> list[int]:
    """A reservation's blocks that a transfer writes (those after its prefix-cache hits)."""
    return list(request.block_ids[_num_cached_blocks(engine, request):])


def _check_shape(engine: LLMEngine, block_ids: list[int], num_blocks: int, dtype: str) -> None:
    _check_piece(engine, len(block_ids), 0, num_blocks, False, dtype)


def _check_piece(engine: LLMEngine, reserved: int, first_block: int, num_blocks: int, more: bool,
                 dtype: str) -> None:
    """A piece [first_block, first_block + num_blocks) of `reserved` fresh blocks; the last
    piece (not `more`) ends at the last block."""
    end = first_block + num_blocks
    if end > reserved or (not more and end != reserved) or (more and num_blocks == 0):
        raise ValueError(f"num_blocks is {num_blocks} from first_block {first_block} "
                         f"({'more to come' if more else 'the last piece'}) but {reserved} "
                         f"blocks are reserved")
    ours = str(engine.dtype).removeprefix("torch.")
    if dtype != ours:
        raise ValueError(f"dtype {dtype!r} does not match this worker's KV cache ({ours})")


STALL_TIMEOUT_S = 300.0  # no output for this long means the loop is stuck: give up


def _drain(outputs: queue.Queue[RequestOutput | BaseException]) -> Iterator[RequestOutput]:
    while True:
        try:
            item = outputs.get(timeout=STALL_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError(f"no output for {STALL_TIMEOUT_S:.0f}s") from None
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finished:
            return
