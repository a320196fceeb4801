"""The decode role as the worker bootstrap sees it: its worker, servicer and transfer host."""

from __future__ import annotations

from decode_worker.service import SERVICE_NAMES, DecodeWorkerServicer
from decode_worker.worker import DecodeWorker
from engine.engine import LLMEngine
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from serving.options import WorkerOptions
from serving.worker_main import WorkerRole


def decode_role(engine: LLMEngine, options: WorkerOptions) -> WorkerRole:
    worker = DecodeWorker(engine, options)
    return WorkerRole(worker, SERVICE_NAMES, options.public_host,
                      lambda server: pb_grpc.add_DecodeWorkerServicer_to_server(
                          DecodeWorkerServicer(worker), server), worker.kv_export_address)
