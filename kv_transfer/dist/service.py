"""The receiver's control path of the dist transport: the `KVReceiver` gRPC service a decode
worker's dist connector adds to its server (an internal service: the cluster token is required).
It only translates proto <-> `DistReceiveConnector.receive` and maps refusals to status codes."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import grpc

from kv_transfer.connector import Write
from kv_transfer.dist.integrity import IntegrityError
from kv_transfer.errors import TransferError
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from kv_transfer.dist.connector import TRANSPORT

if TYPE_CHECKING:
    from kv_transfer.dist.connector import DistReceiveConnector

# The decode worker receives each piece itself, on the ReceiveKV call's thread, so no mapping of
# its cache writes it: "" is the reservation table's name for that (and never matches a peer's
# mapping key, so a closing mapping cannot free blocks a receive is writing into).
WRITER = ""


class ReceiveKVService(pb_grpc.KVReceiverServicer):
    """KVReceiver.ReceiveKV: proto <-> DistReceiveConnector.receive, and its refusals."""

    def __init__(self, connector: DistReceiveConnector):
        self.connector = connector

    def ReceiveKV(self, request: pb.ReceiveKVRequest, context: grpc.ServicerContext
                  ) -> pb.ReceiveKVResponse:
        write = Write(TRANSPORT, WRITER, request.request_id, request.num_blocks, request.dtype,
                      request.transfer_secret, request.first_block, last=not request.more)
        try:
            stats = self.connector.receive(write, request.sender_id, request.generation,
                                           request.tag, request.piece_mac)
        except KeyError as exc:
            self._reject(context, grpc.StatusCode.NOT_FOUND, str(exc))
        except (PermissionError, IntegrityError) as exc:
            self._reject(context, grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except ValueError as exc:
            self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TransferError as exc:
            self._reject(context, grpc.StatusCode.ABORTED, str(exc))
        return pb.ReceiveKVResponse(num_bytes=stats.num_bytes, seconds=stats.seconds)

    def _reject(self, context: grpc.ServicerContext, code: grpc.StatusCode,
                message: str) -> NoReturn:
        self.connector.on_refused("ReceiveKV", code.name, message)  # counted and logged
        context.abort(code, message)
        raise AssertionError("unreachable: context.abort raises")
