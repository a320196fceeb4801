"""A secure cluster (real processes, the tiny model): a cluster token, TLS on the router's
public ports and mutual TLS between its processes, all from a throwaway CA (`python -m router
certs`). It serves both public APIs over TLS to a client trusting the CA, and to nobody else
(plaintext, or another CA); a worker without the token, or with a wrong one, is refused at
registration (UNAUTHENTICATED, counted), never listed and never sent a prompt; a caller without
a certificate of the cluster CA (none, another CA's, an expired one) is refused at the TLS
handshake by the router's registry and by the workers; a caller without the token cannot reach
the workers' internal RPCs, a member without a reservation's transfer secret cannot write
into it, and KV bytes that do not match the MAC of their ReceiveKV are refused."""

from __future__ import annotations

import datetime
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from common.grpc_server import internal_channel
from engine.config import CacheConfig
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from security import auth
from security.auth import TOKEN_ENV, new_token
from security.certs import issue, make_certs
from security.tls import ClusterTls
from tests.cluster.cluster_helpers import (
    greedy_request,
    scrape,
    start_cluster,
    stream_tokens,
    wait_until,
)

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]


def token_file(path: Path, token: str) -> str:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("auth")
    certs = make_certs(tmp / "certs")
    with start_cluster(tmp, prefill=1, decode=1, model=str(tiny_llama_dir), kv_cache_gb=0.05,
                       dtype="bfloat16",  # fixed: the packed pieces below are built in it
                       cluster_token_file=token_file(tmp / "token", new_token()),
                       tls_cert=str(certs["server.pem"]), tls_key=str(certs["server.key"]),
                       tls_ca=str(certs["ca.pem"]), cluster_cert=str(certs["server.pem"]),
                       cluster_key=str(certs["server.key"]), cluster_ca=str(certs["ca.pem"]),
                       router_args=("--local-prefill", "off")) as running:
        running.token = (tmp / "token").read_text().strip()
        running.ca = certs["ca.pem"].read_bytes()
        running.member_tls = ClusterTls.load(str(certs["server.pem"]), str(certs["server.key"]),
                                             str(certs["ca.pem"]))
        yield running


def test_a_secure_cluster_serves_both_public_apis_over_tls_only(cluster, tmp_path):
    tokens, _, last = stream_tokens(cluster.address, greedy_request([1, 2, 3, 4, 5]),
                                    root_ca=cluster.ca)
    assert len(tokens) > 0 and last.timings.prefill_site == "remote"  # every internal RPC ran
    status = cluster.status()
    body = json.dumps({"model": status.model, "prompt": [1, 2, 3], "max_tokens": 3,
                       "temperature": 0}).encode()
    url = f"https://{status.http_address}/v1/completions"
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    trusting = ssl.create_default_context(cadata=cluster.ca.decode())
    with urllib.request.urlopen(request, timeout=60, context=trusting) as reply:
        assert json.loads(reply.read())["usage"]["completion_tokens"] == 3
    with pytest.raises(grpc.RpcError) as plaintext:  # a plaintext client gets nowhere
        stream_tokens(cluster.address, greedy_request([1, 2, 3]), timeout_s=5)
    assert plaintext.value.code() is grpc.StatusCode.UNAVAILABLE
    foreign = make_certs(tmp_path / "foreign")["ca.pem"].read_bytes()
    with pytest.raises(grpc.RpcError) as untrusted:  # nor one trusting another CA
        stream_tokens(cluster.address, greedy_request([1, 2, 3]), timeout_s=5, root_ca=foreign)
    assert untrusted.value.code() is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(request, timeout=10, context=ssl.create_default_context(
            cadata=foreign.decode()))


@pytest.mark.parametrize("credential", ["none", "wrong"])
def test_a_worker_without_the_token_is_refused_and_never_placed(cluster, tmp_path, credential,
                                                                tiny_llama_dir):
    router_metrics = cluster.status().metrics_address
    failures = "pdserve_router_auth_failures_total{method=/pdserve.v1.WorkerRegistry/Register}"
    before = scrape(router_metrics).get(failures, 0.0)
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    extra = [] if credential == "none" else [
        "--cluster-token-file", token_file(tmp_path / "wrong", new_token())]
    spec = cluster.spec
    rogue = subprocess.run(  # it holds a cluster certificate: only the token lacks
        [sys.executable, "-m", "decode_worker", "--router", cluster.registry_address, "--model",
         str(tiny_llama_dir), "--kv-cache-gb", "0.05", "--worker-id", "rogue",
         "--cluster-cert", spec.cluster_cert, "--cluster-key", spec.cluster_key,
         "--cluster-ca", spec.cluster_ca, *extra],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert rogue.returncode != 0
    reason = "no cluster token" if credential == "none" else "wrong cluster token"
    assert "refused the registration" in rogue.stderr and reason in rogue.stderr
    assert "rogue" not in {w.worker_id for w in cluster.status().workers}
    assert scrape(router_metrics).get(failures, 0.0) == before + 1
    tokens, _, _ = stream_tokens(cluster.address, greedy_request([5, 6, 7]), root_ca=cluster.ca)
    assert tokens  # still served, by the members only


def test_the_workers_internal_rpcs_refuse_an_outsider(cluster):
    decode = next(w for w in cluster.status().workers if w.role == pb.WORKER_ROLE_DECODE)
    auth.configure(None, cluster.member_tls)  # a valid certificate, but no token
    try:
        with internal_channel(decode.address) as ch:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.DecodeWorkerStub(ch).Reserve(pb.ReserveRequest(
                    request_id="stolen", prompt_token_ids=[1, 2, 3]), timeout=10)
    finally:
        auth.configure(None)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    counted = scrape(decode.metrics_address)
    assert counted["pdserve_worker_rejections_total{code=UNAUTHENTICATED,"
                   "method=/pdserve.v1.DecodeWorker/Reserve,role=decode}"] >= 1


def test_a_member_without_the_transfer_secret_cannot_write_into_a_reservation(cluster):
    """Even with the cluster token, KV lands only from the transfer the router placed: a
    ReceiveKV without the reservation's secret is refused before anything is received."""
    decode = next(w for w in cluster.status().workers if w.role == pb.WORKER_ROLE_DECODE)
    before = next(w.free_blocks for w in cluster.status().workers if w.worker_id ==
                  decode.worker_id)
    auth.configure(cluster.token, cluster.member_tls)  # a (compromised) cluster member
    try:
        with internal_channel(decode.address) as ch:
            stub = pb_grpc.DecodeWorkerStub(ch)
            reserved = stub.Reserve(pb.ReserveRequest(
                request_id="guarded", prompt_token_ids=list(range(1, 40)), lease_s=30,
                sampling=pb.SamplingOptions(max_tokens=2), transfer_secret="the-real-one"),
                timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.KVReceiverStub(ch).ReceiveKV(pb.ReceiveKVRequest(
                    request_id="guarded", sender_id="rogue", generation=1, tag=1,
                    num_blocks=len(reserved.transfer.block_ids), dtype="float32",
                    transfer_secret="a-guess"), timeout=10)
            assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "wrong transfer secret" in refused.value.details()
            assert stub.Abort(pb.AbortRequest(request_id="guarded"), timeout=10).found
    finally:
        auth.configure(None)
    wait_until(lambda: next(w.free_blocks for w in cluster.status().workers
                            if w.worker_id == decode.worker_id) == before, 10, "blocks back")


def packed_like_the_cache(model_dir: Path, num_blocks: int, fill: float) -> list:
    """`num_blocks` packed blocks of the tiny model's KV cache as the workers hold it
    (bfloat16, the cluster's dtype; block size 16)."""
    import torch

    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    shape = (2, num_blocks, CacheConfig.block_size, config["num_key_value_heads"], head_dim)
    return [torch.full(shape, fill, dtype=torch.bfloat16)
            for _ in range(config["num_hidden_layers"])]


def send_piece(stub, sender, reserved, layers: list, mac: bytes) -> grpc.StatusCode:  # noqa: ANN001
    """Send `layers` over a dist pair as the whole of reservation "sealed", announced by a
    ReceiveKV (on the KVReceiver `stub`) carrying the reservation's secret and `mac`: the decode
    worker's answer."""
    calls = []
    transfer = reserved.transfer

    def start_receive(generation: int, tag: int) -> None:
        calls.append(stub.ReceiveKV.future(pb.ReceiveKVRequest(
            request_id="sealed", sender_id="rogue", generation=generation, tag=tag,
            num_blocks=len(transfer.block_ids), dtype="bfloat16", transfer_secret="the-secret",
            piece_mac=mac), timeout=30))

    sender.send_packed(transfer.receiver_id, transfer.endpoints["dist"].addresses["store"],
                       layers, start_receive)
    return _code(lambda _, timeout: calls[0].result(timeout=timeout), None)


def test_kv_bytes_that_do_not_match_their_mac_are_refused_and_counted(cluster,
                                                                      tiny_llama_dir):
    """A member holding the reservation's transfer secret sends KV over a real dist pair, but
    the bytes do not match the MAC in its ReceiveKV (other bytes than the MAC was computed over,
    or a MAC under another key): PERMISSION_DENIED, counted, the reservation stays reserved —
    the honest piece after them lands — and its blocks come back at the abort."""
    from kv_transfer.dist.endpoints import KVSender
    from kv_transfer.dist.integrity import PieceId, piece_mac

    decode = next(w for w in cluster.status().workers if w.role == pb.WORKER_ROLE_DECODE)
    free = lambda: next(w.free_blocks for w in cluster.status().workers  # noqa: E731
                        if w.worker_id == decode.worker_id)
    before, counter = free(), ("pdserve_worker_kv_integrity_failures_total{role=decode,"
                               "transport=dist}")
    counted = scrape(decode.metrics_address).get(counter, 0.0)
    auth.configure(cluster.token, cluster.member_tls)  # a (compromised) cluster member
    try:
        with internal_channel(decode.address) as ch:
            stub = pb_grpc.DecodeWorkerStub(ch)
            reserved = stub.Reserve(pb.ReserveRequest(
                request_id="sealed", prompt_token_ids=list(range(1, 40)), lease_s=60,
                sampling=pb.SamplingOptions(max_tokens=2), transfer_secret="the-secret"),
                timeout=10)
            n = len(reserved.transfer.block_ids)
            real = packed_like_the_cache(tiny_llama_dir, n, 0.25)
            forged = packed_like_the_cache(tiny_llama_dir, n, 9.0)
            piece = PieceId("sealed", 0, n, last=True)
            sender = KVSender("rogue", "127.0.0.1", real[0].device, timeout_s=20)
            kv = pb_grpc.KVReceiverStub(ch)
            codes = [send_piece(kv, sender, reserved, forged, piece_mac("the-secret", piece,
                                                                        real)),
                     send_piece(kv, sender, reserved, real, piece_mac("a-guess", piece, real)),
                     send_piece(kv, sender, reserved, real, piece_mac("the-secret", piece,
                                                                      real))]
            assert codes == [grpc.StatusCode.PERMISSION_DENIED] * 2 + [grpc.StatusCode.OK]
            assert stub.Abort(pb.AbortRequest(request_id="sealed"), timeout=10).found
    finally:
        auth.configure(None)
    assert scrape(decode.metrics_address)[counter] == counted + 2
    wait_until(lambda: free() == before, 10, "blocks back")


def outsider_tls(tmp: Path, kind: str, cluster) -> ClusterTls | None:  # noqa: ANN001
    """A caller's certificate: none, one of another CA, or an expired one of the cluster CA."""
    if kind == "none":
        return None
    if kind == "foreign-ca":
        certs = make_certs(tmp / "foreign")
        return ClusterTls(str(certs["server.pem"]), str(certs["server.key"]), str(certs["ca.pem"]))
    ca = Path(cluster.spec.cluster_ca)
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)
    files = issue(tmp, "expired", ca, ca.with_suffix(".key"), ["127.0.0.1"], 5, start=past)
    return ClusterTls(str(files["expired.pem"]), str(files["expired.key"]), str(ca))


@pytest.mark.parametrize("kind", ["none", "foreign-ca", "expired"])
def test_a_caller_without_a_valid_cluster_certificate_is_refused_at_the_handshake(
        cluster, tmp_path, kind):
    """Mutual TLS: the router's registry and the workers refuse the connection itself (gRPC
    reports UNAVAILABLE: no call is made, so no status can be sent), even with the token; the
    same calls with the cluster's certificate go through."""
    decode = next(w for w in cluster.status().workers if w.role == pb.WORKER_ROLE_DECODE)
    heartbeat = pb.HeartbeatRequest(worker_id="nobody")
    credentials = {"outsider": outsider_tls(tmp_path, kind, cluster), "member": cluster.member_tls}
    codes = {}
    for who, tls in credentials.items():
        auth.configure(cluster.token, tls)
        try:
            with internal_channel(cluster.registry_address, cluster.ca) as ch:
                codes[who, "register"] = _code(pb_grpc.WorkerRegistryStub(ch).Heartbeat, heartbeat)
            with internal_channel(decode.address, cluster.ca) as ch:
                codes[who, "abort"] = _code(pb_grpc.DecodeWorkerStub(ch).Abort,
                                            pb.AbortRequest(request_id="nothing"))
        finally:
            auth.configure(None)
    assert codes == {("outsider", "register"): grpc.StatusCode.UNAVAILABLE,
                     ("outsider", "abort"): grpc.StatusCode.UNAVAILABLE,
                     ("member", "register"): grpc.StatusCode.OK,
                     ("member", "abort"): grpc.StatusCode.OK}


def _code(method, request) -> grpc.StatusCode:  # noqa: ANN001 - a stub method and its message
    try:
        method(request, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK
