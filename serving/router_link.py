"""A worker's link to the router: register, then heartbeat its load; register again whenever the
router says it does not know the worker (it restarted or dropped us)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from common.grpc_server import internal_channel
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from serving.loop import LoadSnapshot

log = logging.getLogger(__name__)

ROLES = {"prefill": pb.WORKER_ROLE_PREFILL, "decode": pb.WORKER_ROLE_DECODE,
         "colocated": pb.WORKER_ROLE_COLOCATED}
RPC_TIMEOUT_S = 2.0


def load_to_proto(load: LoadSnapshot, with_prefix: bool = True) -> pb.WorkerLoad:
    message = pb.WorkerLoad(queued_prompt_tokens=load.queued_prompt_tokens,
                            running_requests=load.running_requests,
                            waiting_requests=load.waiting_requests,
                            free_blocks=load.free_blocks, total_blocks=load.total_blocks)
    if with_prefix:
        message.prefix.version = load.prefix_version
        message.prefix.block_hashes.extend(load.prefix_hashes)
    return message


# The router's answers that another try would get again: a bad token, another model, a KV
# layout its peers cannot exchange blocks with.
REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.INVALID_ARGUMENT)


class RouterLink:
    def __init__(self, router_address: str, registration: pb.RegisterRequest,
                 load: Callable[[], LoadSnapshot], router_ca: bytes | None = None):
        self.router_address = router_address
        self.registration = registration
        self.load = load
        self.heartbeat_interval_s = 0.5
        self.draining = False  # sent with every heartbeat: the router stops placing on us
        self._sent_prefix_version = -1  # the prefix digest goes out only when it changed
        self._channel = internal_channel(router_address, router_ca)  # mTLS, or TLS, or plain
        self._stub = pb_grpc.WorkerRegistryStub(self._channel)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-link", daemon=True)

    def register(self, timeout_s: float, stop: threading.Event | None = None) -> None:
        """Register, retrying until the router answers; TimeoutError after `timeout_s`,
        InterruptedError once `stop` is set (a signal: the worker is stopping, not waiting)."""
        deadline = time.monotonic() + timeout_s
        stop = stop or threading.Event()
        while True:
            if stop.is_set():
                raise InterruptedError(f"stopped while registering with {self.router_address}")
            try:
                self._register_once()
                return
            except grpc.RpcError as exc:
                if exc.code() in REFUSALS:  # retrying cannot help
                    raise PermissionError(f"router {self.router_address} refused the "
                                          f"registration: {exc.details()}") from exc
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"router {self.router_address} did not accept the registration within "
                        f"{timeout_s:.0f}s: {exc.code().name}") from exc
                stop.wait(0.2)

    def _register_once(self) -> None:
        load = self.load()
        self.registration.load.CopyFrom(load_to_proto(load))
        self._sent_prefix_version = load.prefix_version
        reply = self._stub.Register(self.registration, timeout=RPC_TIMEOUT_S)
        self.heartbeat_interval_s = reply.heartbeat_interval_s or self.heartbeat_interval_s

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():  # never started when the registration failed
            self._thread.join(RPC_TIMEOUT_S + 1.0)
        self._channel.close()

    def drain(self) -> None:
        """Tell the router now (not at the next beat) that this worker takes nothing new."""
        self.draining = True
        self.beat()

    def _run(self) -> None:
        while not self._stopped.wait(self.heartbeat_interval_s):
            self.beat()

    def beat(self) -> None:
        load = self.load()
        changed = load.prefix_version != self._sent_prefix_version
        try:
            reply = self._stub.Heartbeat(
                pb.HeartbeatRequest(worker_id=self.registration.worker_id,
                                    load=load_to_proto(load, with_prefix=changed),
                                    draining=self.draining),
                timeout=RPC_TIMEOUT_S)
            if changed:
                self._sent_prefix_version = load.prefix_version
            if not reply.known and not self.draining:
                self._register_once()
        except grpc.RpcError as exc:  # router down or restarting: keep trying
            if exc.code() in REFUSALS:  # its registration again, refused: say so each time
                log.error("router %s refused this worker's registration: %s",
                          self.router_address, exc.details())
            else:
                log.debug("heartbeat to %s failed: %s", self.router_address, exc.code().name)
