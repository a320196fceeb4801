"""An in-process transport behind the connector interface, for the workers' tests: a sender
writes straight into a receiver's cache in the same process through a shared `FakeFabric`,
admitting, completing and aborting its write through the receiver's ReservationBook exactly as a
real transport does. One write per transfer (admitted at the first blocks sent), like `shared`.

`FakeFabric.fail_next` makes the next copy fail (as a broken peer would) so tests can drive the
failure paths; clearing `FakeFabric.finish_gate` holds every `finish` (a transfer in flight at its
end, as a slow receiver would keep it) until it is set; `FakeFabric.copy_delay_s` makes each copy
that slow (a long prompt then streams for long enough that a test can act in the middle of it);
`FakeFabric.events` records what each
transfer did, in order."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import torch

from engine.kv_memory import KVBuffer
from kv_transfer.connector import (
    KVReceiveConnector,
    KVSend,
    KVSendConnector,
    ReservationBook,
    Transfer,
    Write,
)
from kv_transfer.errors import TransferError, TransferStats

TRANSPORT = "fake"


class FakeFabric:
    """The receivers of one test, by name."""

    def __init__(self) -> None:
        self.receivers: dict[str, FakeReceiveConnector] = {}
        self.fail_next = False
        self.finish_gate = threading.Event()
        self.finish_gate.set()
        self.copy_delay_s = 0.0
        self.events: list[tuple[str, str, int]] = []  # (what, request id, blocks sent by then)
        self.lock = threading.Lock()

    def note(self, what: str, request_id: str, blocks: int) -> None:
        with self.lock:
            self.events.append((what, request_id, blocks))

    def take_failure(self) -> bool:
        with self.lock:
            fail, self.fail_next = self.fail_next, False
            return fail


class FakeReceiveConnector(KVReceiveConnector):
    transport = TRANSPORT

    def __init__(self, fabric: FakeFabric, worker_id: str, buffer: KVBuffer,
                 book: ReservationBook):
        self.fabric, self.worker_id, self.buffer, self.book = fabric, worker_id, buffer, book
        fabric.receivers[worker_id] = self

    def endpoint(self) -> Mapping[str, str]:
        return {"receiver": self.worker_id}

    def close(self) -> None:
        self.fabric.receivers.pop(self.worker_id, None)


class FakeSendConnector(KVSendConnector):
    transport = TRANSPORT

    def __init__(self, fabric: FakeFabric, worker_id: str, buffer: KVBuffer):
        self.fabric, self.worker_id, self.buffer = fabric, worker_id, buffer

    def begin(self, transfer: Transfer) -> FakeSend:
        name = transfer.descriptor.endpoint(TRANSPORT).get("receiver", "")
        return FakeSend(self, transfer, name)

    def close(self) -> None:
        pass


class FakeSend(KVSend):
    def __init__(self, connector: FakeSendConnector, transfer: Transfer, receiver: str):
        self.connector, self.transfer, self.receiver = connector, transfer, receiver
        self.write = Write(TRANSPORT, connector.worker_id, transfer.request_id,
                           transfer.num_blocks, transfer.dtype, transfer.secret)
        self.dst: list[int] | None = None  # admitted: where the blocks go
        self.sent = 0
        self.num_bytes = 0
        self.ended = False
        self.error: TransferError | None = None  # a streamed copy failed: finish raises it

    def _peer(self) -> FakeReceiveConnector:
        peer = self.connector.fabric.receivers.get(self.receiver)
        if peer is None:
            raise TransferError(f"no receiver {self.receiver!r} in this process")
        return peer

    def _admit(self) -> FakeReceiveConnector:
        peer = self._peer()
        if self.dst is None:
            try:
                self.dst = peer.book.admit(self.write)
            except (KeyError, ValueError, PermissionError) as exc:
                self.ended = True
                raise TransferError(f"{self.receiver} refused the write: {exc}") from exc
        return peer

    def _copy(self, peer: FakeReceiveConnector, src: Sequence[int], upto: int) -> int:
        if upto <= self.sent:
            return 0
        if self.connector.fabric.take_failure():
            raise TransferError(f"the copy into {self.receiver} failed (injected)")
        assert self.dst is not None
        cache, theirs = self.connector.buffer.tensor, peer.buffer.tensor
        src_index = torch.tensor(list(src[self.sent:upto]), device=cache.device)
        dst_index = torch.tensor(self.dst[self.sent:upto], device=theirs.device)
        theirs.index_copy_(2, dst_index, cache.index_select(2, src_index).to(theirs.device))
        num_bytes = cache[:, :, 0].numel() * cache.element_size() * (upto - self.sent)
        self.sent, self.num_bytes = upto, self.num_bytes + num_bytes
        time.sleep(self.connector.fabric.copy_delay_s)
        self.connector.fabric.note("copied", self.transfer.request_id, upto)
        return num_bytes

    def send_ready(self, src_block_ids: Sequence[int]) -> int:
        if self.ended:
            return 0
        try:
            peer = self._admit()
            return self._copy(peer, src_block_ids, min(len(src_block_ids), len(self.dst or [])))
        except TransferError as exc:
            self.error = exc
            self.abort()
            return 0

    def finish(self, src_block_ids: Sequence[int]) -> TransferStats:
        if self.ended:
            raise self.error or TransferError(f"the transfer of {self.transfer.request_id} "
                                              f"ended already")
        started = time.perf_counter()
        if not self.connector.fabric.finish_gate.wait(30):
            raise TransferError("the test held the finish gate past 30 s")
        peer = self._admit()
        try:
            self._copy(peer, src_block_ids, len(src_block_ids))
        except TransferError:
            self.abort()
            raise
        self.ended = True
        self.connector.fabric.note("finished", self.transfer.request_id, self.sent)
        stats = TransferStats(self.num_bytes, time.perf_counter() - started, TRANSPORT)
        if not peer.book.complete(self.write, True, stats):
            raise TransferError(f"{self.receiver} dropped request {self.transfer.request_id} "
                                f"during the write")
        return stats

    def abort(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.connector.fabric.note("aborted", self.transfer.request_id, self.sent)
        if self.dst is not None:
            self._peer().book.complete(self.write, False, None)
