"""The shared transport behind the connector interface (kv_transfer.connector).

Sender: `begin` opens the write on the decode worker from a thread of the connector's own (the
engine loop never waits for it). Between engine steps the blocks a streamed prompt has filled are
copied into the reserved blocks if the mapping is free right now (the source blocks cannot change
while no step runs, and a copy returns only once complete); `finish` copies what is left (the
last, partial block at least) and ends the write; `abort` ends it as failed once it is open, so
the decode worker frees the blocks. A prompt preempted and recomputed keeps its copied blocks
(their KV depends only on the tokens): copying resumes past them.

Receiver: the exporter hands out the cache and admits, ends and cleans up writes through the
worker's ReservationBook.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from engine.kv_memory import KVShards
from engine.omp_threads import use_one_torch_thread
from kv_transfer.connector import (
    KVReceiveConnector,
    KVSend,
    KVSendConnector,
    ReservationBook,
    Transfer,
)
from kv_transfer.errors import TransferError, TransferStats
from kv_transfer.shared.exporter import TRANSPORT, KVExporter
from kv_transfer.shared.sender import SharedSender, SharedWrite

log = logging.getLogger(__name__)


class SharedSendConnector(KVSendConnector):
    transport = TRANSPORT

    def __init__(self, worker_id: str, cache: KVShards, timeout_s: float,
                 pause_in_write_s: float = 0.0):
        self.cache = cache
        self.timeout_s = timeout_s
        self.sender = SharedSender(worker_id, timeout_s, pause_in_write_s)
        # Opening and failing writes wait on the decode worker: never on the caller's thread.
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-shared",
                                           initializer=use_one_torch_thread)

    def begin(self, transfer: Transfer) -> SharedSend:
        address = transfer.descriptor.endpoint(TRANSPORT).get("export", "")
        if not address:
            raise ValueError(f"transfer.endpoints: the shared endpoint of "
                             f"{transfer.descriptor.receiver_id} has no export address")
        send = SharedSend(self, transfer)
        self.executor.submit(send.open, address)
        return send

    def close(self) -> None:
        self.sender.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


class SharedSend(KVSend):
    def __init__(self, connector: SharedSendConnector, transfer: Transfer):
        self.connector = connector
        self.transfer = transfer
        self.dst_ids = list(transfer.descriptor.block_ids)
        self.opened: Future[SharedWrite] = Future()
        self.sent = 0  # blocks copied so far
        self.error: TransferError | None = None  # a copy failed: finish ends the write failed

    def open(self, address: str) -> None:
        transfer = self.transfer
        try:
            write = self.connector.sender.begin(
                transfer.descriptor.receiver_id, address, transfer.request_id,
                self.connector.cache, len(self.dst_ids), transfer.secret)
        except BaseException as exc:  # finish or abort reports it
            self.opened.set_exception(exc)
            return
        self.opened.set_result(write)

    def send_ready(self, src_block_ids: Sequence[int]) -> int:
        upto = min(len(src_block_ids), len(self.dst_ids))
        if upto <= self.sent or self.error is not None or not self.opened.done() \
                or self.opened.exception() is not None:
            return 0
        write = self.opened.result()
        before = write.num_bytes
        try:  # never waits on the decode worker: a busy mapping is tried next step
            if not write.copy(self.connector.cache, src_block_ids[self.sent:upto],
                              self.dst_ids[self.sent:upto], wait=False):
                return 0
        except TransferError as exc:
            self.error = exc
            return 0
        self.sent = upto
        return write.num_bytes - before

    def finish(self, src_block_ids: Sequence[int]) -> TransferStats:
        timeout_s = self.connector.timeout_s
        try:
            write = self.opened.result(timeout=timeout_s)
        except TimeoutError as exc:
            self.abort()  # should it open after all
            raise TransferError(f"{self.transfer.descriptor.receiver_id} did not admit the "
                                f"write of {self.transfer.request_id} in {timeout_s:.0f}s") from exc
        if self.error is not None:
            write.finish(ok=False)
            raise self.error
        return self.connector.sender.complete(write, self.connector.cache,
                                              src_block_ids[self.sent:], self.dst_ids[self.sent:])

    def abort(self) -> None:
        def finish_failed(opened: Future[SharedWrite]) -> None:
            if opened.exception() is None:  # never opened: nothing to finish
                self.connector.executor.submit(_finish_failed, opened.result())

        self.opened.add_done_callback(finish_failed)


def _finish_failed(write: SharedWrite) -> None:
    try:
        write.finish(ok=False)
    except TransferError as exc:  # the mapping is gone: the decode side ended it already
        log.debug("closing the KV write of %s: %s", write.request_id, exc)


class SharedReceiveConnector(KVReceiveConnector):
    transport = TRANSPORT

    def __init__(self, worker_id: str, cache: KVShards, book: ReservationBook):
        self.exporter = KVExporter(worker_id, cache, book)

    def endpoint(self) -> Mapping[str, str]:
        return {"export": self.exporter.address}

    def close(self) -> None:
        self.exporter.close()
