"""The sender's control path of the dist transport: the decode workers' `KVReceiver.ReceiveKV`
calls that announce each piece (the call's answer is the piece's acknowledgement)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from common.grpc_server import internal_channel
from kv_transfer.errors import TransferError
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

# Waits for the decode worker's answer to a ReceiveKV (TransferError: refused or failed).
WaitAck = Callable[[float], pb.ReceiveKVResponse]
RECEIVE_WAITS = 3


class ReceiveKVClient:
    """The decode workers' ReceiveKV, one channel per address shared by every transfer to it."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.KVReceiverStub]] = {}
        self._lock = threading.Lock()

    def _stub(self, address: str) -> pb_grpc.KVReceiverStub:
        with self._lock:
            if address not in self._channels:
                channel = internal_channel(address)
                self._channels[address] = (channel, pb_grpc.KVReceiverStub(channel))
            return self._channels[address][1]

    def start(self, address: str, receiver_id: str, message: pb.ReceiveKVRequest) -> WaitAck:
        """Announce a piece without waiting; the returned wait gives the decode worker's answer.
        The call's own deadline bounds it too, should nobody wait for it."""
        # The decode worker's side of one piece is three waits, each bounded by timeout_s: the
        # sender's rendezvous, a new pair's setup and the receive. One timeout_s from the
        # announce could end the call while a slow setup still completes the piece, the
        # transfer then failed (and retried) though its KV had arrived.
        future = self._stub(address).ReceiveKV.future(
            message, timeout=RECEIVE_WAITS * self.timeout_s)

        def wait_ack(timeout_s: float) -> pb.ReceiveKVResponse:
            try:
                return future.result(timeout=timeout_s)
            except grpc.RpcError as exc:
                raise TransferError(f"decode worker {receiver_id} did not acknowledge the KV: "
                                    f"{exc.code().name}: {exc.details()}") from exc
            except grpc.FutureTimeoutError as exc:
                future.cancel()
                raise TransferError(f"decode worker {receiver_id} did not acknowledge the KV "
                                    f"in {timeout_s:.0f}s") from exc

        return wait_ack

    def close(self) -> None:
        with self._lock:
            channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            channel.close()
