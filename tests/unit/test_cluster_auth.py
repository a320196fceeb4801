"""Cluster-token authentication without a model: where the token comes from, and an in-process
gRPC server refusing internal calls without it (UNAUTHENTICATED, counted) while health stays
open."""

from __future__ import annotations

import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_server import channel, start_server
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from security import auth

TOKEN = "s3cret-token-of-the-test-cluster"
REGISTRY = pb.DESCRIPTOR.services_by_name["WorkerRegistry"].full_name


def test_the_token_comes_from_its_file_else_the_environment(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    os.chmod(path, 0o600)
    assert auth.load_token(str(path), env={auth.TOKEN_ENV: "x" * 20}) == TOKEN
    assert auth.load_token(None, env={auth.TOKEN_ENV: "y" * 20}) == "y" * 20
    assert auth.load_token(None, env={}) is None
    with pytest.raises(ValueError, match="at least 16 printable ASCII characters, got 5"):
        auth.load_token(None, env={auth.TOKEN_ENV: "short"})
    with pytest.raises(ValueError, match="printable ASCII"):  # gRPC metadata is ASCII
        auth.load_token(None, env={auth.TOKEN_ENV: "é" * 16})
    with pytest.raises(ValueError, match="--cluster-token-file .*missing"):
        auth.load_token(str(tmp_path / "missing"))
    assert len(auth.new_token()) >= 40


class Registry(pb_grpc.WorkerRegistryServicer):
    def Heartbeat(self, request, context):  # noqa: ANN001, ANN201
        return pb.HeartbeatResponse(known=True)


@pytest.fixture
def server():
    refused: list[str] = []
    auth.configure(TOKEN)
    try:
        running = start_server(
            "127.0.0.1", 0, [lambda s: pb_grpc.add_WorkerRegistryServicer_to_server(Registry(), s)],
            [REGISTRY], internal=[REGISTRY], on_refused=refused.append)
    finally:
        auth.configure(None)
    yield f"127.0.0.1:{running.port}", refused
    running.stop(0.5)


def heartbeat(ch: grpc.Channel) -> pb.HeartbeatResponse:
    return pb_grpc.WorkerRegistryStub(ch).Heartbeat(pb.HeartbeatRequest(worker_id="w"),
                                                     timeout=5)


def test_internal_calls_need_the_token_and_refusals_are_counted(server):
    address, refused = server
    with channel(address) as ch:  # no token configured here: an outsider
        with pytest.raises(grpc.RpcError) as missing:
            heartbeat(ch)
        assert missing.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "no cluster token" in missing.value.details()
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # health stays open
    auth.configure("a-wrong-token-of-enough-length")
    try:
        with channel(address) as ch, pytest.raises(grpc.RpcError) as wrong:
            heartbeat(ch)
        assert wrong.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "wrong cluster token" in wrong.value.details()
        auth.configure(TOKEN)
        with channel(address) as ch:
            assert heartbeat(ch).known
    finally:
        auth.configure(None)
    assert refused == [f"/{REGISTRY}/Heartbeat"] * 2


def test_refused_calls_to_methods_that_do_not_exist_share_one_label(server):
    """The method's name is the caller's: counted as given, names without the token would grow
    the refusal metric without bound."""
    address, refused = server
    with channel(address) as ch:
        for i in range(5):
            junk = ch.unary_unary(f"/{REGISTRY}/Junk{i}")
            with pytest.raises(grpc.RpcError) as info:
                junk(b"", timeout=5)
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert refused == ["unknown"] * 5


def test_binding_beyond_loopback_warns_about_plaintext_and_open_membership():
    assert auth.warn_if_exposed("the router", "127.0.0.1", None, plaintext=True) is None
    assert auth.warn_if_exposed("the router", "localhost", None) is None
    both = auth.warn_if_exposed("the router", "0.0.0.0", None, plaintext=True)
    assert "public API is plaintext" in both and "ANY process that reaches it" in both
    assert auth.warn_if_exposed("the router", "10.0.0.5", TOKEN, plaintext=False) is None
    token_only = auth.warn_if_exposed("worker d-0", "10.0.0.5", None)
    assert "plaintext" not in token_only and "may join the cluster" in token_only
