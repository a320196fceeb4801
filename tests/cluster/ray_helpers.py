"""Shared pieces of the Ray deployment tests: the tiny-model config and the Ray environment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from deploy.config import DeployConfig
from launch.cluster import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "pdserve-test"


def tiny_config(model_dir: Path, /, **sections: dict) -> DeployConfig:
    data = {"name": "t", "ray": {"namespace": NAMESPACE},
            "model": {"path": str(model_dir), "kv_cache_gb": 0.05, "dtype": "float32"},
            "router": {"port": free_port(), "http_port": free_port(), "num_cpus": 0},
            "placement": {"timeout_s": 120}, "workers": {"grace_s": 5}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return DeployConfig.from_dict(data)


def export_checkout_to_ray() -> None:
    """Ray's worker processes inherit the environment of the processes that start them (this
    one, for a local cluster): put this checkout on their import path."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def local_ray_session(num_cpus: int) -> Iterator[None]:
    """A module's local Ray (`yield from` it in a fixture): this checkout on its workers' path,
    `num_cpus` logical CPUs, shut down after the module. Always a new instance of its own
    (address "local"): without it, ray.init joins whatever Ray this machine runs, such as the
    multi-node test's simulated cluster in the other xdist process, and refuses `num_cpus`."""
    import ray

    export_checkout_to_ray()
    ray.init(address="local", num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()
