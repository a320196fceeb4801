"""The Ray deployment on a local Ray (one session for the module): deploy 1P+1D with the tiny model
in secure mode (cluster token, TLS on the router's public ports, mutual TLS between the actors),
stream through the router over TLS, kill a worker actor and the router actor (both restart and
serve again), tear down with no actor left; invalid configs fail before anything starts."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import ray

from common.grpc_server import internal_channel
from deploy import deployment
from deploy.config import ConfigError, DeployConfig
from deploy.security import with_secure_dir
from launch.cluster import free_port
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from security import auth
from security.tls import ClusterTls
from tests.cluster.cluster_helpers import greedy_request, stream_tokens, wait_until
from tests.cluster.ray_helpers import (
    REPO_ROOT,
    local_ray_session,
    tiny_config,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    yield from local_ray_session(num_cpus=3)


def _generate(address: str, root_ca: bytes) -> list[int]:
    tokens, _, last = stream_tokens(address, greedy_request([1, 2, 3, 4, 5], 8), 60.0,
                                    root_ca=root_ca)
    assert len(tokens) == 8 and last.finish_reason != 0
    return tokens


def _secure_config(model: Path, tmp: Path) -> DeployConfig:
    """The tiny deployment with a cluster token, TLS on the router's public ports and mutual
    TLS between the actors, from the throwaway CA, certificate and token `python -m deploy up
    --secure DIR` writes (every actor reads them on its node; here: one node)."""
    return with_secure_dir(tiny_config(model, router={"internal_port": free_port()}),
                           tmp / "certs", node_ip=None)


def _rogue_register(address: str, tls: ClusterTls | None) -> grpc.StatusCode:
    """Register as a decode worker at the router's registry: with the cluster's certificate
    but no token, or with neither."""
    auth.configure(None, tls)
    try:
        with internal_channel(address) as ch:
            pb_grpc.WorkerRegistryStub(ch).Register(pb.RegisterRequest(
                worker_id="rogue", role=pb.WORKER_ROLE_DECODE, address="127.0.0.1:1",
                model="tiny", block_size=16), timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        auth.configure(None)
    return grpc.StatusCode.OK


def _placement_groups() -> list[dict]:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_invalid_config_is_refused_before_anything_starts(local_ray, tiny_llama_dir, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill: {replicas: 2}\ndecode: {replicas: 1, gpus: 1}\n")
    run = subprocess.run([sys.executable, "-m", "deploy", "up", "--config", str(bad)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "unknown key decode.gpus" in run.stderr
    with pytest.raises(ConfigError, match="prefill.replicas must be in"):
        tiny_config(tiny_llama_dir, prefill={"replicas": 0})
    # Valid on paper, impossible on this Ray cluster (3 CPUs): refused before any actor starts.
    with pytest.raises(ConfigError, match="but the Ray cluster has 3"):
        deployment.deploy(tiny_config(tiny_llama_dir, decode={"replicas": 3}))
    with pytest.raises(ConfigError, match="STRICT_SPREAD .* has 1 nodes"):
        deployment.deploy(tiny_config(tiny_llama_dir, placement={"strategy": "STRICT_SPREAD"}))
    assert not _placement_groups()
    assert not deployment._existing(tiny_config(tiny_llama_dir))


def _check_secure(config: DeployConfig, router: dict, ca: bytes, model_name: str) -> None:
    """The router actor's public ports speak TLS only; its registry wants the cluster's
    certificate and the token."""
    with pytest.raises(grpc.RpcError) as plaintext:
        stream_tokens(router["address"], greedy_request([1, 2, 3]), timeout_s=5)
    assert plaintext.value.code() is grpc.StatusCode.UNAVAILABLE
    registry = router["registry_address"]
    assert registry == f"127.0.0.1:{config.router.internal_port}"
    mutual = config.cluster_tls
    member = ClusterTls(mutual.cert_file or "", mutual.key_file or "", mutual.ca_file or "")
    assert _rogue_register(registry, member) is grpc.StatusCode.UNAUTHENTICATED  # no token
    assert _rogue_register(registry, None) is grpc.StatusCode.UNAVAILABLE  # no certificate
    assert router["http_address"] == f"127.0.0.1:{config.router.http_port}"
    trusting = ssl.create_default_context(cadata=ca.decode())
    with urllib.request.urlopen(f"https://{router['http_address']}/v1/models", timeout=10,
                                context=trusting) as reply:  # the OpenAI API, on TLS too
        assert json.loads(reply.read())["data"][0]["id"] == model_name


def test_deploy_stream_restart_and_teardown(local_ray, tiny_llama_dir, tmp_path):
    """One secure deployment: token, public TLS and mutual TLS reach every actor."""
    config = _secure_config(tiny_llama_dir, tmp_path)
    ca = Path(config.tls.ca_file).read_bytes()
    result = deployment.deploy(config)
    try:
        reference = _generate(result.router_address, ca)
        assert {a["role"] for a in result.actors} == {"router", "prefill", "decode"}
        _check_secure(config, next(a for a in result.actors if a["role"] == "router"), ca,
                      tiny_llama_dir.name)

        # A worker actor killed (its process dies): Ray restarts it, it registers again. The
        # router actor killed: it comes back on its fixed ports and rebuilds its registry from
        # the workers' heartbeats (they register again when it does not know them).
        for name in ("t-decode-0", "t-router"):
            actor = ray.get_actor(name)
            old_pid = ray.get(actor.info.remote(), timeout=10)["pid"]
            ray.kill(actor, no_restart=False)
            wait_until(lambda: _restarted(name, old_pid), 120, f"{name} restarted")  # noqa: B023
            deployment._wait_registered(result.router_address, 2, 60, ca)
            assert _generate(result.router_address, ca) == reference

        report = deployment.status(config)
        assert {a["state"] for a in report["actors"]} == {"alive"}
        assert sorted(w["id"] for w in report["registered"]) == ["decode-0", "prefill-0"]
        assert all(w["healthy"] for w in report["registered"])
    finally:
        names = deployment.teardown(config)
    assert sorted(names) == ["t-decode-0", "t-prefill-0", "t-router"]
    assert not deployment._existing(config)
    assert not _placement_groups()


def _restarted(name: str, old_pid: int) -> bool:
    try:
        info = ray.get(ray.get_actor(name).info.remote(), timeout=5)
    except (ray.exceptions.RayError, ValueError):
        return False
    return info["pid"] != old_pid and info["restarted"]


def test_a_tensor_parallel_decode_worker_is_a_placement_group_of_rank_actors(
        local_ray, tiny_llama_dir):
    """decode at TP 2: its own placement group of 2 bundles (STRICT_PACK), the worker actor in
    the first, its rank 1 an actor in the second; KV moves from the TP-1 prefill worker into
    both ranks' heads; the rank SIGKILLed takes the worker down as a unit, Ray restarts it with a
    new rank, and it serves the same tokens."""
    import os
    import signal

    config = tiny_config(tiny_llama_dir, decode={"tensor_parallel_size": 2})
    result = deployment.deploy(config)
    try:
        groups = {g["name"]: g for g in _placement_groups()}
        assert groups["t-decode-0-pg"]["strategy"] == "STRICT_PACK"
        assert len(groups["t-decode-0-pg"]["bundles"]) == 2 and len(groups["t-pg"]["bundles"]) == 1
        decode = ray.get_actor("t-decode-0")
        info = ray.get(decode.info.remote(), timeout=10)
        assert len(info["rank_pids"]) == 1 and info["rank_pids"][0] != info["pid"]
        tokens, _, last = stream_tokens(result.router_address,
                                        greedy_request(PROMPT, 8), 60.0)
        assert last.timings.prefill_site == "remote" and last.timings.kv_transfer_bytes > 0
        sizes = {w.worker_id: w.tensor_parallel_size
                 for w in deployment_status_workers(result.router_address)}
        assert sizes == {"prefill-0": 1, "decode-0": 2}

        os.kill(info["rank_pids"][0], signal.SIGKILL)
        wait_until(lambda: _restarted("t-decode-0", info["pid"]), 120, "decode-0 restarted")
        deployment._wait_registered(result.router_address, 2, 60)
        again, _, _ = stream_tokens(result.router_address,
                                    greedy_request(PROMPT, 8), 60.0)
        assert again == tokens
    finally:
        names = deployment.teardown(config)
    assert sorted(names) == ["t-decode-0", "t-prefill-0", "t-router"]
    assert not _placement_groups()


PROMPT = list(range(100, 800))  # past --local-prefill-max-tokens: prefilled remotely


def deployment_status_workers(address: str) -> list:
    from common.client import cluster_status

    return list(cluster_status(address).workers)
