"""gRPC server bootstrap shared by every process: health (grpc.health.v1), reflection, binding."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.omp_threads import use_one_torch_thread
from security import auth
from security.tls import ClusterTls, ServerTls

# Messages carry token ids and KV-free metadata only; 16 MiB bounds a request's size.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


# gRPC reports a call without a deadline as ~9.2e18 s remaining (not None): passing that on as a
# timeout overflows into a deadline already past. Anything beyond a year means "no deadline".
NO_DEADLINE_S = 365 * 24 * 3600.0


def call_budget_s(time_remaining: float | None, default_s: float) -> float:
    """Seconds a call may take: the client's deadline, or `default_s` when it set none."""
    if time_remaining is None or not time_remaining < NO_DEADLINE_S:
        return default_s
    return max(0.0, time_remaining)


class Server:
    """A started gRPC server, its port, and its health servicer."""

    def __init__(self, server: grpc.Server, port: int, health_servicer: health.HealthServicer,
                 service_names: Sequence[str]):
        self.server = server
        self.port = port
        self.health = health_servicer
        self.service_names = list(service_names)

    def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def stop(self, grace_s: float) -> None:
        self.set_serving(False)
        self.server.stop(grace_s).wait(grace_s + 1.0)


def start_server(host: str, port: int, adders: Sequence[Callable[[grpc.Server], None]],
                 service_names: Sequence[str], max_workers: int = 128,
                 max_receive_bytes: int = MAX_MESSAGE_BYTES, internal: Sequence[str] = (),
                 on_refused: Callable[[str], None] | None = None,
                 tls: ServerTls | ClusterTls | None = None) -> Server:
    """Bind host:port (port 0 picks a free one), register the services plus health and
    reflection, start, and mark every service SERVING. With a cluster token configured
    (security.auth), calls to the `internal` services must carry it (`on_refused(method)`
    counts those that do not). With `tls`, the port speaks TLS only (a ClusterTls: mutual TLS,
    every caller presenting a certificate of the cluster CA)."""
    options = [("grpc.max_receive_message_length", max_receive_bytes),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.so_reuseport", 0)]
    token = auth.current()
    interceptors = [auth.TokenCheck(token, internal, on_refused)] if token and internal else []
    # Handlers never start OpenMP teams of their own (engine.omp_threads): the engine loop's
    # thread is the only one computing in parallel.
    handlers = futures.ThreadPoolExecutor(max_workers=max_workers,
                                          initializer=use_one_torch_thread)
    server = grpc.server(handlers, options=options,
                         interceptors=interceptors)
    for add in adders:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    server.start()
    result = Server(server, bound, health_servicer, names)
    result.set_serving(True)
    return result


def channel(address: str, root_ca: bytes | None = None) -> grpc.Channel:
    """A channel to `address` (TLS, trusting `root_ca`, when given); every call on it carries
    this process's cluster token, if any."""
    plain = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_ca),
                                CHANNEL_OPTIONS) \
        if root_ca else grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return _with_token(plain)


def internal_channel(address: str, root_ca: bytes | None = None) -> grpc.Channel:
    """A channel to another process of the cluster: mutual TLS when this process has a cluster
    certificate (security.auth.configure), else as `channel`."""
    tls = auth.current_tls()
    if tls is None:
        return channel(address, root_ca)
    return _with_token(grpc.secure_channel(address, tls.channel_credentials(), CHANNEL_OPTIONS))


def _with_token(plain: grpc.Channel) -> grpc.Channel:
    """Every call on the channel carries this process's cluster token, if any."""
    token = auth.current()
    return grpc.intercept_channel(plain, auth.TokenAttacher(token)) if token else plain


def wait_healthy(address: str, timeout_s: float, root_ca: bytes | None = None) -> bool:
    """True once the server at `address` answers SERVING, False when `timeout_s` passes."""
    import time

    deadline = time.monotonic() + timeout_s
    with channel(address, root_ca) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False
