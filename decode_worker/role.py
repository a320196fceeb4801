"""The decode role as the worker bootstrap sees it: its worker with its KV receiver connectors
(and sender ones, for running requests that move to another decode worker), and the gRPC
services (its own and those the connectors' control paths need)."""

from __future__ import annotations

from decode_worker.service import SERVICE_NAMES, DecodeWorkerServicer
from decode_worker.worker import DecodeWorker, no_receivers
from engine.engine import LLMEngine
from kv_transfer import KVReceiveConnector, ReservationBook
from kv_transfer.connector import OnRefused
from kv_transfer.connectors import receive_connectors, send_connectors
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from serving.options import WorkerOptions, connector_options
from serving.worker_main import WorkerRole


def decode_role(engine: LLMEngine, options: WorkerOptions) -> WorkerRole:
    def connect(book: ReservationBook, on_refused: OnRefused) -> list[KVReceiveConnector]:
        return receive_connectors(connector_options(options), engine.runner.kv_shards, book,
                                  on_refused)

    if options.role == "decode":  # KV arrives from prefill workers, and moves between us
        worker = DecodeWorker(engine, options, connect,
                              send_connectors(connector_options(options), engine.runner.kv_shards))
    else:
        worker = DecodeWorker(engine, options, no_receivers)
    services = worker.kv_services()

    def add_services(server: object) -> None:
        pb_grpc.add_DecodeWorkerServicer_to_server(DecodeWorkerServicer(worker), server)
        for service in services:
            service.add_to_server(server)

    return WorkerRole(worker, SERVICE_NAMES + [n for s in services for n in s.names],
                      options.public_host, add_services, bind=worker.bind,
                      kv_receiver_id=worker.kv_receiver_id)
