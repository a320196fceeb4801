"""Start a worker process: engine, step-loop thread, gRPC server, router link; stop on a signal."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Protocol

import grpc

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from pdserve_proto import pdserve_pb2 as pb
from serving.grpc_server import Server, start_server
from serving.loop import EngineLoop
from serving.options import WorkerOptions, parse_worker_args
from serving.router_link import ROLES, RouterLink, load_to_proto

log = logging.getLogger(__name__)


class WorkerRole(Protocol):
    """A role's servicers around a shared EngineLoop."""

    loop: EngineLoop
    service_names: list[str]
    transfer_host: str

    def add_to_server(self, server: grpc.Server) -> None: ...

    def close(self) -> None: ...


def main(role_name: str, make_role: Callable[[LLMEngine, WorkerOptions], WorkerRole],
         argv: list[str] | None = None) -> int:
    """`python -m {role}_worker` for either role: parse, load the engine, serve."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    options = parse_worker_args(role_name, argv)
    engine = build_engine(options)
    return serve(options, make_role(engine, options), engine.model_path.name)


def build_engine(options: WorkerOptions) -> LLMEngine:
    import torch

    torch.set_num_threads(options.threads)  # workers share the machine's cores
    cache = CacheConfig(kv_cache_gb=options.kv_cache_gb)
    scheduler = (SchedulerConfig(max_num_batched_tokens=options.max_num_batched_tokens)
                 if options.max_num_batched_tokens else SchedulerConfig())
    return LLMEngine(EngineConfig(model=options.model, dtype=options.dtype, cache=cache,
                                  scheduler=scheduler))


def registration(options: WorkerOptions, loop: EngineLoop, address: str,
                 transfer_host: str, model_name: str) -> pb.RegisterRequest:
    engine = loop.engine
    return pb.RegisterRequest(
        worker_id=options.worker_id, role=ROLES[options.role], address=address,
        model=model_name, block_size=engine.block_manager.block_size,
        max_model_len=engine.max_model_len, kv_transfer_host=transfer_host,
        load=load_to_proto(loop.load))


def serve(options: WorkerOptions, role: WorkerRole, model_name: str,
          stop: threading.Event | None = None) -> int:
    """Run until SIGINT/SIGTERM (or `stop` is set); return the exit code."""
    stop = stop or threading.Event()
    role.loop.start()
    server: Server = start_server(options.host, options.port, [role.add_to_server],
                                  role.service_names)
    address = f"{options.public_host}:{server.port}"
    link = RouterLink(options.router,
                      registration(options, role.loop, address, role.transfer_host, model_name),
                      lambda: role.loop.load)
    _install_signal_handlers(stop)
    try:
        link.register(options.connect_timeout_s)
        link.start()
        print(f"{options.role} worker {options.worker_id} serving on {address}", flush=True)
        stop.wait()
    finally:
        log.info("worker %s stopping", options.worker_id)
        server.set_serving(False)
        link.stop()
        server.stop(options.grace_s)
        role.loop.stop()
        role.close()
    return 0


def _install_signal_handlers(stop: threading.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
