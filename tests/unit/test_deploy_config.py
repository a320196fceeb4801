"""The deployment config: the shipped example parses, every mistake is an error naming its key,
and only deploy/ imports ray (the workers are the same code everywhere)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from deploy.config import ConfigError, DeployConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_example_parses():
    config = DeployConfig.from_yaml(REPO_ROOT / "deploy" / "pdserve.yaml")
    assert config.worker_names == [("prefill", "prefill-0"), ("decode", "decode-0")]
    assert config.workers.bundle == {"CPU": 1}
    assert config.router.port == 50051


def test_defaults_and_gpu_bundles():
    config = DeployConfig.from_dict({"decode": {"replicas": 3}, "workers": {"device": "cuda"}})
    assert [w for _, w in config.worker_names] == ["prefill-0", "decode-0", "decode-1",
                                                   "decode-2"]
    assert config.workers.bundle == {"CPU": 1, "GPU": 1}
    assert config.placement.strategy == "PACK"


@pytest.mark.parametrize(("data", "message"), [
    ({"prefil": {"replicas": 1}}, "unknown key prefil"),
    ({"decode": {"replicas": 1, "gpus": 1}}, "unknown key decode.gpus"),
    ({"decode": {"replicas": 0}}, "decode.replicas must be in \\[1, 64\\], got 0"),
    ({"prefill": {"replicas": 65}}, "prefill.replicas must be in \\[1, 64\\]"),
    ({"prefill": {"replicas": "two"}}, "prefill.replicas must be int, got 'two'"),
    ({"prefill": {"replicas": True}}, "prefill.replicas must be int"),
    ({"workers": {"num_cpus": 0}}, "workers.num_cpus must be in \\[1, 256\\]"),
    ({"workers": {"device": "tpu"}}, "workers.device must be cpu or cuda"),
    ({"workers": {"max_restarts": -2}}, "workers.max_restarts must be -1"),
    ({"workers": 4}, "workers must be a mapping"),
    ({"placement": {"strategy": "spread"}}, "placement.strategy must be one of"),
    ({"placement": {"timeout_s": 0}}, "placement.timeout_s must be in"),
    ({"router": {"port": 0}}, "router.port must be in \\[1, 65535\\] \\(a fixed port"),
    ({"router": {"max_running": 0}}, "router.max_running must be >= 1"),
    ({"model": {"dtype": "fp8"}}, "model.dtype must be one of"),
    ({"model": {"kv_cache_gb": -1}}, "model.kv_cache_gb must be in"),
    ({"model": {"path": "/no/such/model"}}, "model.path '/no/such/model' is not a local model"),
    ({"name": "a b"}, "name must be letters"),
])
def test_mistakes_are_errors_naming_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        DeployConfig.from_dict(data)


def test_unreadable_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("prefill: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read deployment config"):
        DeployConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="cannot read deployment config"):
        DeployConfig.from_yaml(tmp_path / "missing.yaml")


def test_only_deploy_imports_ray():
    importers = []
    for path in REPO_ROOT.rglob("*.py"):
        relative = path.relative_to(REPO_ROOT)
        if relative.parts[0] in ("deploy", "tests", ".venv") or "site-packages" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "ray" or n.startswith("ray.") for n in names):
                importers.append(str(relative))
    assert importers == []
