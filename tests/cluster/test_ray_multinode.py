"""The Ray deployment on a simulated multi-node Ray cluster (ray.cluster_utils.Cluster, every node
on this machine): STRICT_SPREAD puts prefill and decode workers on different nodes; removing the
node under a decode worker leaves the cluster serving (the other decode worker takes the requests
at once) and the lost worker is restarted on the spare node and registers again."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from common.client import cluster_status
from deploy import deployment
from tests.cluster.cluster_helpers import greedy_request, stream_tokens, wait_until
from tests.cluster.ray_helpers import NAMESPACE, export_checkout_to_ray, tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nodes():
    export_checkout_to_ray()  # before the nodes start: they pass it on to their workers
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=1) for _ in range(4)]  # 3 bundles + 1 spare node
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


def _node_of(name: str) -> str:
    return ray.get(ray.get_actor(name).info.remote(), timeout=10)["node_id"]


def test_strict_spread_and_node_loss(nodes, tiny_llama_dir):
    cluster, workers = nodes
    config = tiny_config(tiny_llama_dir, decode={"replicas": 2},
                         placement={"strategy": "STRICT_SPREAD"})
    result = deployment.deploy(config)
    try:
        placed = {name: _node_of(f"t-{name}") for name in ("prefill-0", "decode-0", "decode-1")}
        assert len(set(placed.values())) == 3, placed  # each worker on its own node
        head = ray.get_runtime_context().get_node_id()
        assert head not in placed.values()  # the head has no CPU for workers: the router's

        lost = next(n for n in workers if n.node_id == placed["decode-0"])
        cluster.remove_node(lost)
        # Serving goes on at once: the router retries on the surviving decode worker.
        for i in range(3):
            tokens, _, _ = stream_tokens(result.router_address,
                                         greedy_request([5, 6, 7, i], 6), 120.0)
            assert len(tokens) == 6

        def restarted_elsewhere() -> bool:
            try:
                node = _node_of("t-decode-0")
            except (ray.exceptions.RayError, ValueError):
                return False
            return node not in placed.values()

        wait_until(restarted_elsewhere, 180, "decode-0 restarted on the spare node")
        wait_until(lambda: sum(w.healthy for w in cluster_status(result.router_address).workers)
                   == 3, 60, "decode-0 registered again")
        tokens, _, _ = stream_tokens(result.router_address, greedy_request([9, 8, 7], 6), 120.0)
        assert len(tokens) == 6
    finally:
        deployment.teardown(config)
    assert not deployment._existing(config)
