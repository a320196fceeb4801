"""The router's clients of the workers: one channel per worker address, and best-effort aborts."""

from __future__ import annotations

import logging
import threading

import grpc

from common.grpc_server import internal_channel
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from router.fleet.registry import Worker

log = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 2.0


class WorkerStubs:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = internal_channel(address)
            return self._channels[address]

    def decode(self, worker: Worker) -> pb_grpc.DecodeWorkerStub:
        return pb_grpc.DecodeWorkerStub(self._channel(worker.address))

    def prefill(self, worker: Worker) -> pb_grpc.PrefillWorkerStub:
        return pb_grpc.PrefillWorkerStub(self._channel(worker.address))

    def abort(self, worker: Worker, kind: str, request_id: str) -> None:
        """Tell a worker to free what it holds for the request (a dead one cannot: its blocks
        died with it). Bounded; failures are logged, not raised."""
        stub = self.prefill(worker) if kind == "prefill" else self.decode(worker)
        try:
            stub.Abort(pb.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.warning("abort of %s on %s failed: %s", request_id, worker.worker_id,
                        exc.code().name)
