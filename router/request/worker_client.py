"""The router's clients of the workers: one channel per worker address, one Outputs stream per
decode worker (router.request.output_mux), and best-effort aborts."""

from __future__ import annotations

import logging
import threading
import time

import grpc

from common.grpc_server import internal_channel
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from router.fleet.registry import Worker
from router.request.calls import RouterError
from router.request.output_mux import ATTACH_TIMEOUT_S, MuxedDecode, OutputMux, StreamError

log = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 2.0


class WorkerStubs:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._muxes: dict[tuple[str, str], OutputMux] = {}  # by (worker id, address)

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = internal_channel(address)
            return self._channels[address]

    def decode(self, worker: Worker) -> pb_grpc.DecodeWorkerStub:
        return pb_grpc.DecodeWorkerStub(self._channel(worker.address))

    def decode_stream(self, worker: Worker, message: pb.DecodeRequest, timeout_s: float
                      ) -> MuxedDecode:
        """Start a decode on `worker`, its chunks read off the worker's Outputs stream
        (opened on first use, again after it ended). RouterError (retryable, the worker suspect)
        when the stream cannot be opened."""
        deadline = time.monotonic() + timeout_s
        mux = self._mux(worker)
        if not mux.attach(min(timeout_s, ATTACH_TIMEOUT_S)):
            if timeout_s < ATTACH_TIMEOUT_S and not mux.closed:
                # This request's own time ran out while the stream opened: the stream is not
                # at fault, and the requests waiting on it keep it.
                raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline "
                                  f"passed while worker {worker.worker_id}'s Outputs stream "
                                  "opened")
            mux.close()
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"worker {worker.worker_id} did not "
                              "open an Outputs stream", retryable=True, suspect=worker.worker_id)
        try:
            return mux.open(message, deadline)
        except StreamError as exc:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, exc.details(), retryable=True,
                              suspect=worker.worker_id) from exc

    def _mux(self, worker: Worker) -> OutputMux:
        """The worker's stream: open, opening, or opened now (one per worker, however many
        requests start at once); streams that ended are dropped."""
        key = (worker.worker_id, worker.address)
        channel = self._channel(worker.address)
        with self._lock:
            mux = self._muxes.get(key)
            if mux is None or mux.closed:
                for old in [k for k, m in self._muxes.items() if m.closed]:
                    del self._muxes[old]
                mux = self._muxes[key] = OutputMux(channel, worker.worker_id)
            return mux

    def forget(self, worker_id: str) -> None:
        """The router dropped the worker: stop reading its Outputs stream (what streamed there
        fails over)."""
        with self._lock:
            keys = [key for key in self._muxes if key[0] == worker_id]
            muxes = [self._muxes.pop(key) for key in keys]
        for mux in muxes:
            mux.close()

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
