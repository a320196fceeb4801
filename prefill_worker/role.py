"""The prefill role as the worker bootstrap sees it: its worker (with the decode workers'
ReceiveKV client it starts each transfer with) and its servicer."""

from __future__ import annotations

from engine.engine import LLMEngine
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from prefill_worker.service import SERVICE_NAMES, DecodeStubs, PrefillWorkerServicer
from prefill_worker.worker import PrefillWorker
from serving.options import WorkerOptions
from serving.worker_main import WorkerRole


def prefill_role(engine: LLMEngine, options: WorkerOptions) -> WorkerRole:
    worker = PrefillWorker(engine, options,
                           DecodeStubs(options.transfer_timeout_s, options.worker_id))
    return WorkerRole(worker, SERVICE_NAMES, options.public_host,
                      lambda server: pb_grpc.add_PrefillWorkerServicer_to_server(
                          PrefillWorkerServicer(worker), server))
