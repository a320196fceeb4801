"""The decode role as the worker bootstrap sees it: its loop, servicer and transfer endpoint."""

from __future__ import annotations

import grpc

from decode_worker.service import SERVICE_NAMES, DecodeWorkerServicer
from decode_worker.worker import DecodeWorker
from engine.engine import LLMEngine
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from serving.options import WorkerOptions


class DecodeRole:
    def __init__(self, engine: LLMEngine, options: WorkerOptions):
        self.worker = DecodeWorker(engine, options)
        self.loop = self.worker.loop
        self.metrics = self.worker.metrics
        self.gate = self.worker.gate
        self.service_names = SERVICE_NAMES
        self.transfer_host = options.public_host

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_DecodeWorkerServicer_to_server(DecodeWorkerServicer(self.worker), server)

    def in_flight(self) -> int:
        return self.worker.in_flight()

    def close(self) -> None:
        self.worker.close()
