"""The dist transport behind the connector interface (kv_transfer.connector); the protocol is in
kv_transfer.dist.

Sender: `begin` only records where the KV goes (nothing waits on the decode worker). Between
engine steps the blocks a streamed prompt has filled are packed (copied out while they cannot
change) and queued as a piece for the transfer's own piece thread (`pieces`), which announces
each with a ReceiveKV call and sends it over the pair; `finish` waits for those, then sends the
rest as the last piece and returns with its acknowledgement; `abort` drops the pieces not sent
yet. A prompt preempted and recomputed keeps its sent blocks (their KV depends only on the
tokens): sending resumes past them.

Receiver: the `KVReceiver` gRPC service this connector adds to the decode worker's server takes
each ReceiveKV, admits the piece through the worker's ReservationBook, receives it into the
reserved blocks once its bytes match their MAC, and completes it (or refuses it) there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import grpc
import torch

from engine.kv_memory import KVShards
from kv_transfer.connector import (
    GrpcService,
    KVReceiveConnector,
    KVSend,
    KVSendConnector,
    OnRefused,
    ReservationBook,
    Transfer,
    Write,
)
from kv_transfer.dist.control import ReceiveKVClient, WaitAck
from kv_transfer.dist.endpoints import KVReceiver, KVSender
from kv_transfer.dist.integrity import IntegrityError, PieceId, piece_mac, verify_piece
from kv_transfer.dist.packing import pack_blocks
from kv_transfer.dist.pieces import PieceSender
from kv_transfer.errors import TransferError, TransferStats
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
TRANSPORT = "dist"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVReceiver"].full_name


def _num_bytes(layers: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in layers)


# ---- sender side (prefill worker) ----------------------------------------------------------

class DistSendConnector(KVSendConnector):
    transport = TRANSPORT

    def __init__(self, worker_id: str, host: str, cache: KVShards, timeout_s: float):
        self.caches = cache
        self.timeout_s = timeout_s
        self.sender = KVSender(worker_id, host, cache.primary.device, timeout_s)
        self.control = ReceiveKVClient(timeout_s)
        # One block of every layer and KV head, K and V: what each block sent costs on the wire.
        self.block_bytes = cache.block_bytes

    def begin(self, transfer: Transfer) -> DistSend:
        addresses = transfer.descriptor.endpoint(TRANSPORT)
        store, control = addresses.get("store", ""), addresses.get("control", "")
        if not store or not control:
            raise ValueError(f"transfer.endpoints: the dist endpoint of "
                             f"{transfer.descriptor.receiver_id} needs a store and a control "
                             f"address, got {dict(addresses)}")
        return DistSend(self, transfer, store, control)

    def close(self) -> None:
        self.control.close()


class DistSend(KVSend):
    """One request's transfer. `send_ready` and `abort` run on the engine loop's thread, and
    `finish` on a shipping thread only once the loop has handed the transfer over, so they never
    run at once."""

    def __init__(self, connector: DistSendConnector, transfer: Transfer, store: str,
                 control: str):
        self.connector = connector
        self.transfer = transfer
        self.store = store
        self.control = control
        self.sent = 0  # blocks handed to `pieces` so far
        self.pieces: PieceSender | None = None  # started with the first streamed piece
        self.ended = False  # finished or aborted

    def send_ready(self, src_block_ids: Sequence[int]) -> int:
        # The last block always goes with `finish`: the last piece is never empty.
        upto = min(len(src_block_ids), self.transfer.num_blocks - 1)
        if self.ended or upto <= self.sent or (self.pieces is not None
                                               and self.pieces.error is not None):
            return 0  # a failed piece: `finish` reports it, and nothing more is sent
        layers = pack_blocks(self.connector.caches, src_block_ids[self.sent:upto])
        if self.pieces is None:
            self.pieces = PieceSender(self.transfer.request_id, self._send_more)
        self.pieces.put(layers, self.sent, upto - self.sent)
        self.sent = upto
        return _num_bytes(layers)

    def _send_more(self, layers: Sequence[torch.Tensor], first_block: int,
                   num_blocks: int) -> TransferStats:
        return self._send_piece(layers, first_block, num_blocks, more=True)

    def finish(self, src_block_ids: Sequence[int]) -> TransferStats:
        if self.ended:
            raise TransferError(f"the KV transfer of {self.transfer.request_id} was aborted")
        self.ended = True
        self._drain()
        rest = list(src_block_ids[self.sent:])
        # Packed here, on the shipping thread: the request is detached, its blocks held until
        # this returns, so they cannot change.
        stats = self._send_piece(pack_blocks(self.connector.caches, rest), self.sent, len(rest),
                                 more=False)
        return TransferStats(stats.num_bytes + self.sent * self.connector.block_bytes,
                             stats.seconds, TRANSPORT)

    def _drain(self) -> None:
        """Wait until every streamed piece is acknowledged, then stop the piece thread
        (TransferError if one failed or they take too long: the rest are dropped)."""
        pieces = self.pieces
        if pieces is None:
            return
        try:
            pieces.drain(self.connector.timeout_s)
        except TransferError:
            pieces.close(cancel=True)
            raise
        pieces.close()

    def abort(self) -> None:
        # Pieces already received left the reservation RESERVED under its lease (never
        # RECEIVING between pieces): the router's Abort or the lease frees it on the decode side.
        # A piece in flight ends within its own bounded waits; the rest are dropped.
        if self.ended:
            return
        self.ended = True
        if self.pieces is not None:
            self.pieces.close(cancel=True)

    def _send_piece(self, layers: Sequence[torch.Tensor], first_block: int, num_blocks: int,
                    more: bool) -> TransferStats:
        """Send packed blocks [first_block, +num_blocks) of the reservation and wait for the
        decode worker's acknowledgement. Their MAC (under the transfer secret) goes in the
        ReceiveKV call: the decode worker writes only bytes that match it."""
        transfer, connector = self.transfer, self.connector
        receiver = transfer.descriptor.receiver_id
        mac = piece_mac(transfer.secret,
                        PieceId(transfer.request_id, first_block, num_blocks, last=not more),
                        layers)
        acks: list[WaitAck] = []

        def start_receive(generation: int, tag: int) -> None:
            acks.append(connector.control.start(self.control, receiver, pb.ReceiveKVRequest(
                request_id=transfer.request_id, sender_id=connector.sender.worker_id,
                generation=generation, tag=tag, num_blocks=num_blocks, dtype=transfer.dtype,
                first_block=first_block, more=more, transfer_secret=transfer.secret,
                piece_mac=mac)))

        stats = connector.sender.send_packed(receiver, self.store, layers, start_receive)
        acks[0](connector.timeout_s)  # the decode worker has written the piece
        return stats


# ---- receiver side (decode worker) ---------------------------------------------------------

class DistReceiveConnector(KVReceiveConnector):
    transport = TRANSPORT

    def __init__(self, worker_id: str, host: str, public_host: str, cache: KVShards,
                 timeout_s: float, book: ReservationBook, on_refused: OnRefused):
        self.worker_id = worker_id
        self.caches = cache
        self.book = book
        self.on_refused = on_refused
        self.receiver = KVReceiver(worker_id, host, cache.primary.device, timeout_s)
        self.store_address = f"{public_host}:{self.receiver.port}"
        self.control_address = ""  # the worker's gRPC server, once it listens (`bind`)
        self.closed = False

    def endpoint(self) -> Mapping[str, str]:
        addresses = {"store": self.store_address}
        if self.control_address:
            addresses["control"] = self.control_address
        return addresses

    def services(self) -> list[GrpcService]:
        from kv_transfer.dist.service import ReceiveKVService

        servicer = ReceiveKVService(self)

        def add_to_server(server: grpc.Server) -> None:
            pb_grpc.add_KVReceiverServicer_to_server(servicer, server)

        return [GrpcService((SERVICE_NAME,), add_to_server)]

    def bind(self, address: str) -> None:
        self.control_address = address

    def close(self) -> None:
        self.closed = True

    def receive(self, write: Write, sender_id: str, generation: int, tag: int,
                mac: bytes) -> TransferStats:
        """Receive one announced piece into its reserved blocks (KeyError: no such
        reservation; PermissionError: wrong secret; ValueError: it does not fit;
        IntegrityError: its bytes do not match `mac`, nothing written; TransferError: the
        transfer failed, the blocks are freed)."""
        try:
            if self.closed:
                raise TransferError(f"decode worker {self.worker_id} is closing")
            block_ids = self.book.admit(write)
        except (KeyError, ValueError, PermissionError, TransferError) as exc:
            self._refuse(sender_id, generation, tag, str(exc))
            raise
        return self._receive_admitted(write, block_ids, sender_id, generation, tag, mac)

    def _refuse(self, sender_id: str, generation: int, tag: int, reason: str) -> None:
        """The sender waits for our answer in the store: tell it now, not at its timeout."""
        try:
            self.receiver.refuse(sender_id, generation, tag, reason)
        except RuntimeError as exc:  # our own store: only if it is going away
            log.warning("could not tell %s its KV was refused: %s", sender_id, exc)

    def _receive_admitted(self, write: Write, block_ids: list[int], sender_id: str,
                          generation: int, tag: int, mac: bytes) -> TransferStats:
        """Receive an admitted piece and end the write in the book, whatever happens: held on,
        refused (nothing written: RESERVED again) or failed (blocks freed)."""
        piece = PieceId(write.request_id, write.first_block, write.num_blocks, write.last)
        try:
            got = self.receiver.receive(sender_id, generation, tag, self.caches, block_ids,
                                        lambda layers: verify_piece(write.secret, piece,
                                                                    layers, mac))
        except IntegrityError as exc:
            self.book.refuse(write, str(exc))
            raise
        except BaseException as exc:
            self.book.complete(write, False, None)
            if isinstance(exc, Exception) and not isinstance(exc, TransferError):
                raise TransferError(f"receiving KV of {write.request_id} from {sender_id}: "
                                    f"{exc}") from exc
            raise
        stats = TransferStats(got.num_bytes, got.seconds, TRANSPORT)
        if not self.book.complete(write, True, stats):
            raise TransferError(f"request {write.request_id!r} was aborted during its transfer")
        return stats
