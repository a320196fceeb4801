"""The prefill role as the worker bootstrap sees it: its worker, with a KV sender connector per
transport its --kv-transport allows, and its servicer."""

from __future__ import annotations

from engine.engine import LLMEngine
from kv_transfer.connectors import send_connectors
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from prefill_worker.service import SERVICE_NAMES, PrefillWorkerServicer
from prefill_worker.worker import PrefillWorker
from serving.options import WorkerOptions, connector_options
from serving.worker_main import WorkerRole


def prefill_role(engine: LLMEngine, options: WorkerOptions) -> WorkerRole:
    connectors = send_connectors(connector_options(options), engine.runner.kv_shards)
    worker = PrefillWorker(engine, options, connectors)
    return WorkerRole(worker, SERVICE_NAMES, options.public_host,
                      lambda server: pb_grpc.add_PrefillWorkerServicer_to_server(
                          PrefillWorkerServicer(worker), server))
