"""The internal WorkerRegistry service: workers register and heartbeat their load; it only
translates proto <-> the registry's domain objects."""

from __future__ import annotations

import grpc

from kv_transfer.selection import MODES
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from router.fleet.registry import (
    KVLayoutMismatch,
    Role,
    Worker,
    WorkerIdTaken,
    WorkerLoad,
    WorkerRegistry,
)

ROLE_FROM_PROTO = {pb.WORKER_ROLE_PREFILL: Role.PREFILL, pb.WORKER_ROLE_DECODE: Role.DECODE,
                   pb.WORKER_ROLE_COLOCATED: Role.COLOCATED}
ROLE_TO_PROTO = {v: k for k, v in ROLE_FROM_PROTO.items()}
MAX_PREFIX_KEYS = 32768  # the proto's PrefixDigest limit


class WorkerRegistryServicer(pb_grpc.WorkerRegistryServicer):
    def __init__(self, registry: WorkerRegistry, model_name: str, heartbeat_interval_s: float):
        self.registry = registry
        self.model_name = model_name
        self.heartbeat_interval_s = heartbeat_interval_s

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext
                 ) -> pb.RegisterResponse:
        if request.role not in ROLE_FROM_PROTO:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role {request.role} is not a "
                          "worker role (prefill, decode or colocated)")
        if request.model != self.model_name:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"worker serves model {request.model!r}; this router serves "
                          f"{self.model_name!r}")
        if not request.worker_id or not request.address or request.block_size < 1 \
                or request.max_model_len < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id, address, "
                          "block_size >= 1 and max_model_len >= 1 are required")
        _check_prefix(request.load, context)
        unreachable = _unreachable(request.address)
        if unreachable:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address {request.address!r}: "
                          f"{unreachable}")
        if request.kv_transport not in ("", *MODES):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kv_transport must be one of "
                          f"{', '.join(MODES)}, got {request.kv_transport!r}")
        try:
            self.registry.register(_worker(request))
        except KVLayoutMismatch as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except WorkerIdTaken as exc:  # not a refusal: the worker retries, and gets in later
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        return pb.RegisterResponse(heartbeat_interval_s=self.heartbeat_interval_s)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
                  ) -> pb.HeartbeatResponse:
        _check_prefix(request.load, context)
        return pb.HeartbeatResponse(known=self.registry.heartbeat(
            request.worker_id, _load(request.load), draining=request.draining,
            prefix_hashes=_prefix(request.load)))


def _worker(request: pb.RegisterRequest) -> Worker:
    return Worker(
        worker_id=request.worker_id, role=ROLE_FROM_PROTO[request.role],
        address=request.address, block_size=request.block_size,
        max_model_len=request.max_model_len, transfer_host=request.kv_transfer_host,
        load=_load(request.load), metrics_address=request.metrics_address,
        host_id=request.host_id, kv_device=request.kv_device or "cpu",
        kv_transport=request.kv_transport or "auto",
        kv_receiver_id=request.kv_receiver_id,
        tensor_parallel_size=max(1, request.tensor_parallel_size),
        prefix_hashes=_prefix(request.load) or frozenset(),
        kv_layout=request.kv_layout, prefill_chunk_tokens=request.prefill_chunk_tokens)


def _unreachable(address: str) -> str:
    """Why the router could not call a worker at `address` ("" when it could)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        return "needs host:port with a port in 1..65535"
    if host.strip("[]") in ("", "0.0.0.0", "::"):
        return ("a wildcard host is where a worker listens, not where it is reached: give the "
                "worker --advertise-host")
    return ""


def _check_prefix(load: pb.WorkerLoad, context: grpc.ServicerContext) -> None:
    """A digest of at most MAX_PREFIX_KEYS keys (a worker sends at most that many, the most
    recently cached: engine.block_manager.MAX_PUBLISHED_HASHES): a 64 MiB message would
    otherwise be ~8M keys, hundreds of MB as a set, at every heartbeat."""
    count = len(load.prefix.block_hashes)
    if count > MAX_PREFIX_KEYS:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"load.prefix.block_hashes has {count} "
                      f"keys; the limit is {MAX_PREFIX_KEYS}")


def _prefix(load: pb.WorkerLoad) -> frozenset[int] | None:
    """The worker's prefix-cache digest, when this report carries one."""
    return frozenset(load.prefix.block_hashes) if load.HasField("prefix") else None


def _load(load: pb.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(queued_prompt_tokens=load.queued_prompt_tokens,
                      running_requests=load.running_requests,
                      waiting_requests=load.waiting_requests, free_blocks=load.free_blocks,
                      total_blocks=load.total_blocks)
