"""The prefill role as the worker bootstrap sees it."""

from __future__ import annotations

import grpc

from engine.engine import LLMEngine
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from prefill_worker.service import SERVICE_NAMES, DecodeStubs, PrefillWorkerServicer
from prefill_worker.worker import PrefillWorker
from serving.options import WorkerOptions


class PrefillRole:
    def __init__(self, engine: LLMEngine, options: WorkerOptions):
        stubs = DecodeStubs(options.transfer_timeout_s)
        self.worker = PrefillWorker(
            engine, options,
            lambda target, rid, gen, tag, n, dtype: stubs.start_receive(
                target, rid, gen, tag, n, dtype, options.worker_id))
        self.loop = self.worker.loop
        self.metrics = self.worker.metrics
        self.gate = self.worker.gate
        self.service_names = SERVICE_NAMES
        self.transfer_host = options.public_host

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_PrefillWorkerServicer_to_server(PrefillWorkerServicer(self.worker), server)

    def in_flight(self) -> int:
        return self.worker.in_flight()

    def close(self) -> None:
        self.worker.close()
