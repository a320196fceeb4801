"""The cluster's API surface against one 1P+1D cluster: health, reflection, status, bad input,
client cancel, deadlines, Complete — and no KV block leaked by any of them."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from serving.grpc_server import channel
from tests.cluster.cluster_helpers import (
    greedy_request,
    long_prompt,
    rpc_error,
    start_cluster,
    stream_tokens,
    wait_blocks_free,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with start_cluster(tmp_path_factory.mktemp("api"), prefill=1, decode=1) as running:
        yield running


@pytest.fixture()
def stub(cluster):
    with channel(cluster.address) as ch:
        yield pb_grpc.GenerationStub(ch)


def _assert_no_leak(cluster) -> None:
    workers = wait_blocks_free(cluster)
    assert all(w.free_blocks == w.total_blocks for w in workers), workers


def test_health_and_reflection_answer_on_router_and_workers(cluster):
    addresses = [cluster.address] + [w.address for w in cluster.status().workers]
    for address in addresses:
        with channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with channel(cluster.address) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= services


def test_status_lists_workers_and_their_load(cluster, stub):
    status = stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=5)
    assert status.model == "SmolLM2-135M-Instruct"
    assert sorted(w.role for w in status.workers) == [pb.WORKER_ROLE_PREFILL,
                                                      pb.WORKER_ROLE_DECODE]
    for w in status.workers:
        assert w.healthy and w.address.startswith("127.0.0.1:")
        assert w.total_blocks > 0 and w.seconds_since_heartbeat < 3


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(prompt=""), "prompt"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 99999999])), "vocabulary"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(max_tokens=100000)),
     "max_tokens"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(temperature=-1)),
     "temperature"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(top_p=1.5)), "top_p"),
    (pb.GenerateRequest(prompt="hi", model="gpt-4"), "model"),
    (pb.GenerateRequest(sampling=pb.SamplingOptions(max_tokens=4)), "prompt"),
])
def test_bad_input_is_invalid_argument_naming_the_field(cluster, stub, request_, field):
    exc = rpc_error(lambda: list(stub.Generate(request_, timeout=30)))
    assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in exc.details()


def test_complete_returns_what_generate_streams(cluster, stub):
    request = greedy_request([1, 2, 3, 4, 5, 6, 7, 8], max_tokens=8)
    tokens, text, _ = stream_tokens(cluster.address, request)
    reply = stub.Complete(request, timeout=60)
    assert list(reply.token_ids) == tokens and reply.text == text
    assert reply.finish_reason == pb.FINISH_REASON_LENGTH
    assert reply.usage.completion_tokens == 8


def test_client_cancel_mid_stream_frees_blocks_on_both_workers(cluster, stub):
    call = stub.Generate(greedy_request(long_prompt()[:600], max_tokens=400), timeout=120)
    seen = 0
    for part in call:
        seen += len(part.token_ids)
        if seen >= 3:
            break
    call.cancel()
    _assert_no_leak(cluster)
    tokens, _, _ = stream_tokens(cluster.address, greedy_request([5, 6, 7], max_tokens=4))
    assert len(tokens) == 4  # the cluster keeps serving


def test_cancel_before_prefill_finishes_leaks_nothing(cluster, stub):
    future = stub.Complete.future(greedy_request(long_prompt(), max_tokens=4), timeout=120)
    time.sleep(0.3)
    future.cancel()
    _assert_no_leak(cluster)


def test_deadline_is_propagated_and_frees_everything(cluster, stub):
    exc = rpc_error(lambda: list(stub.Generate(greedy_request(long_prompt(), max_tokens=300),
                                               timeout=1.5)))
    assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    _assert_no_leak(cluster)
