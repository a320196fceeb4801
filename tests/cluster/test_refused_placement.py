"""A placement whose KV can never move is refused at once, with both workers and the reason named
— never retried until the deadline. A real router (real gRPC) with registrations of workers whose
places make every pair impossible: two workers forced onto `dist` on one GPU (NCCL refuses two
ranks on one GPU), and workers forced onto `shared` on different hosts. No model is loaded: the
request must be refused before any worker is called."""

from __future__ import annotations

import grpc
import pytest

from common.grpc_server import channel
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from router.server import Router, RouterOptions
from tests.cluster.cluster_helpers import greedy_request, rpc_error, stream_tokens

GPU = "cuda:GPU-5c3e0d1a"


def register(router: tuple[str, str], worker_id: str, role: int, **place: str) -> None:
    address, model = router
    with channel(address) as ch:
        pb_grpc.WorkerRegistryStub(ch).Register(pb.RegisterRequest(
            worker_id=worker_id, role=role, address="127.0.0.1:9", model=model,
            block_size=16, max_model_len=8192,
            load=pb.WorkerLoad(free_blocks=1000, total_blocks=1000), **place), timeout=5)


@pytest.fixture()
def router():
    """(address, model name) of a router with no worker yet."""
    instance = Router(RouterOptions(port=0, heartbeat_timeout_s=30.0))
    port = instance.start()
    yield f"127.0.0.1:{port}", instance.model_name
    instance.stop(1.0)


@pytest.mark.parametrize("prefill_place,decode_place,reason", [
    ({"host_id": "h1", "kv_device": GPU, "kv_transport": "dist"},
     {"host_id": "h1", "kv_device": GPU, "kv_transport": "auto"},
     "NCCL cannot put two ranks on one GPU"),
    ({"host_id": "h1", "kv_device": "cpu", "kv_transport": "shared"},
     {"host_id": "h2", "kv_device": "cpu", "kv_transport": "auto"},
     "the shared transport needs both workers on one host"),
])
def test_an_impossible_pair_is_refused_at_once_naming_both_workers(router, prefill_place,
                                                                   decode_place, reason):
    register(router, "prefill-a", pb.WORKER_ROLE_PREFILL, **prefill_place)
    register(router, "decode-b", pb.WORKER_ROLE_DECODE, **decode_place)
    error = rpc_error(stream_tokens, router[0], greedy_request([5, 6, 7], 4), 60.0)
    # FAILED_PRECONDITION, not DEADLINE_EXCEEDED: refused, not waited on until the deadline
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "prefill-a -> decode-b" in error.details() and reason in error.details()


def test_a_registration_with_an_unknown_transport_is_refused(router):
    with pytest.raises(grpc.RpcError) as refused:
        register(router, "prefill-x", pb.WORKER_ROLE_PREFILL, kv_transport="rdma")
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_transport must be one of auto, shared, dist" in refused.value.details()
