"""The router process: options, wiring, the dead-worker reaper, and serve-until-signal."""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig
from engine.prepare import default_model_dir, is_prepared
from engine.tokenizer import Tokenizer
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from router.frontend import Frontend
from router.orchestrator import Orchestrator, WorkerStubs
from router.placement import PlacementPolicy
from router.registry import WorkerRegistry
from router.service import GenerationServicer, WorkerRegistryServicer
from serving.grpc_server import Server, start_server

log = logging.getLogger(__name__)
SERVICE_NAMES = [pb.DESCRIPTOR.services_by_name[name].full_name
                 for name in ("Generation", "WorkerRegistry")]


@dataclass(frozen=True)
class RouterOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    model: str = "default"
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    lease_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("heartbeat_interval_s must be > 0 and below heartbeat_timeout_s "
                             f"({self.heartbeat_interval_s} vs {self.heartbeat_timeout_s})")
        if not self.lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")


def model_dir(model: str) -> Path:
    """The tokenizer/config directory (the router never loads weights, so it never prepares)."""
    if model == "default":
        path = default_model_dir()
        if not is_prepared(path):
            raise FileNotFoundError(f"the default model is not prepared at {path}: run "
                                    "`python -m engine prepare-model` (scripts/setup.sh does)")
        return path
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {model!r} is not a local model directory")
    return path


class Router:
    def __init__(self, options: RouterOptions):
        self.options = options
        path = model_dir(options.model)
        self.model_name = path.name
        self.registry = WorkerRegistry(options.heartbeat_timeout_s)
        self.placement = PlacementPolicy(self.registry)
        self.frontend = Frontend(Tokenizer(path), ModelConfig.from_dir(path), self.model_name)
        self.orchestrator = Orchestrator(self.placement, WorkerStubs(), options.lease_s)
        self._stopped = threading.Event()
        self.server: Server | None = None

    def start(self) -> int:
        generation = GenerationServicer(self.frontend, self.orchestrator, self.placement)
        registry = WorkerRegistryServicer(self.registry, self.model_name,
                                          self.options.heartbeat_interval_s)
        self.server = start_server(
            self.options.host, self.options.port,
            [lambda s: pb_grpc.add_GenerationServicer_to_server(generation, s),
             lambda s: pb_grpc.add_WorkerRegistryServicer_to_server(registry, s)],
            SERVICE_NAMES)
        threading.Thread(target=self._reap, name="reaper", daemon=True).start()
        return self.server.port

    def _reap(self) -> None:
        while not self._stopped.wait(self.options.heartbeat_interval_s):
            for worker in self.registry.drop_dead():
                log.warning("worker %s (%s) missed its heartbeats: dropped", worker.worker_id,
                            worker.address)

    def stop(self, grace_s: float = 5.0) -> None:
        self._stopped.set()
        if self.server is not None:
            self.server.stop(grace_s)


def serve(options: RouterOptions) -> int:
    router = Router(options)
    port = router.start()
    print(f"router serving on {options.host}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    router.stop()
    return 0
