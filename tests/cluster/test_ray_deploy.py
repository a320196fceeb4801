"""The Ray deployment on a local Ray (one session for the module): deploy 1P+1D with the tiny model,
stream through the router, kill a worker actor and the router actor (both restart and serve
again), tear down with no actor left; invalid configs fail before anything starts."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import urllib.request

import grpc
import pytest
import ray

from deploy import deployment
from deploy.config import ConfigError
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from serving.auth import new_token
from serving.grpc_server import channel
from tests.cluster.cluster_helpers import greedy_request, stream_tokens, wait_until
from tests.cluster.ray_helpers import (
    NAMESPACE,
    REPO_ROOT,
    export_checkout_to_ray,
    tiny_config,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    export_checkout_to_ray()
    ray.init(num_cpus=3, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _generate(address: str) -> list[int]:
    tokens, _, last = stream_tokens(address, greedy_request([1, 2, 3, 4, 5], 8), 60.0)
    assert len(tokens) == 8 and last.finish_reason != 0
    return tokens


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


def test_deploy_stream_restart_and_teardown(local_ray, tiny_llama_dir, tmp_path):
    token = tmp_path / "cluster.token"  # every actor reads it on its node (here: one node)
    token.write_text(new_token())
    token.chmod(0o600)
    config = dataclasses.replace(tiny_config(tiny_llama_dir), cluster_token_file=str(token))
    result = deployment.deploy(config)
    try:
        reference = _generate(result.router_address)
        with channel(result.router_address) as ch, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.WorkerRegistryStub(ch).Register(pb.RegisterRequest(
                worker_id="rogue", role=pb.WORKER_ROLE_DECODE, address="127.0.0.1:1",
                model=tiny_llama_dir.name, block_size=16), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED  # the actors have it
        assert {a["role"] for a in result.actors} == {"router", "prefill", "decode"}
        router = next(a for a in result.actors if a["role"] == "router")
        assert router["http_address"] == f"127.0.0.1:{config.router.http_port}"
        with urllib.request.urlopen(f"http://{router['http_address']}/v1/models",
                                    timeout=10) as reply:  # the OpenAI API, on the actor too
            assert json.loads(reply.read())["data"][0]["id"] == tiny_llama_dir.name

        # A worker actor killed (its process dies): Ray restarts it, it registers again. The
        # router actor killed: it comes back on its fixed port and rebuilds its registry from
        # the workers' heartbeats (they register again when it does not know them).
        for name in ("t-decode-0", "t-router"):
            actor = ray.get_actor(name)
            old_pid = ray.get(actor.info.remote(), timeout=10)["pid"]
            ray.kill(actor, no_restart=False)
            wait_until(lambda: _restarted(name, old_pid), 120, f"{name} restarted")  # noqa: B023
            deployment._wait_registered(result.router_address, 2, 60)
            assert _generate(result.router_address) == reference

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
