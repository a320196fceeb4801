"""The deployment config: the shipped example parses, every mistake is an error naming its key,
and only deploy/ imports ray (the workers are the same code everywhere)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from deploy.config import ConfigError, DeployConfig
from serving.options import WorkerOptions

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


def test_workers_sharing_gpus():
    config = DeployConfig.from_dict({"workers": {"device": "cuda", "gpus_per_worker": 0.5,
                                                 "kv_transport": "shared"}})
    assert config.workers.bundle == {"CPU": 1, "GPU": 0.5}
    assert config.workers.num_gpus == 0.5
    engine = config.worker_engine()
    assert (engine["device"], engine["gpu_memory_fraction"], engine["kv_transport"]) == (
        "cuda", 0.45, "shared")
    assert WorkerOptions(role="decode", router="h:1", **engine).gpu_memory_fraction == 0.45
    explicit = DeployConfig.from_dict({"workers": {"device": "cuda", "gpus_per_worker": 0.25,
                                                   "gpu_memory_fraction": 0.2}})
    assert explicit.worker_engine()["gpu_memory_fraction"] == 0.2
    whole = DeployConfig.from_dict({"workers": {"device": "cuda", "kv_transport": "dist"}})
    assert (whole.workers.num_gpus, whole.worker_engine()["gpu_memory_fraction"]) == (1.0, 0.9)


def test_cpu_workers_get_no_gpu_keys():
    config = DeployConfig.from_dict({"model": {"kv_cache_gb": 0.5}})
    assert config.worker_engine() == {
        "model": "default", "dtype": None, "kv_cache_gb": 0.5, "max_num_batched_tokens": None,
        "device": "cpu", "threads": 1, "kv_transport": "auto", "tensor_parallel_size": 1}
    assert config.workers.num_gpus == 0


def test_tensor_parallel_size_per_role():
    config = DeployConfig.from_dict({"decode": {"replicas": 2, "tensor_parallel_size": 2}})
    assert (config.tp_for("prefill"), config.tp_for("decode")) == (1, 2)
    assert config.worker_engine("decode")["tensor_parallel_size"] == 2
    assert config.worker_engine("prefill")["tensor_parallel_size"] == 1
    with pytest.raises(ConfigError, match=r"prefill.tensor_parallel_size must be in \[1, 64\]"):
        DeployConfig.from_dict({"prefill": {"tensor_parallel_size": 0}})
    with pytest.raises(ConfigError, match="runs on CPU ranks only so far"):
        DeployConfig.from_dict({"decode": {"tensor_parallel_size": 2},
                                "workers": {"device": "cuda"}})


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
    ({"router": {"http_port": 70000}}, "router.http_port must be in \\[0, 65535\\] \\(0: off\\)"),
    ({"model": {"dtype": "fp8"}}, "model.dtype must be one of"),
    ({"model": {"kv_cache_gb": -1}}, "model.kv_cache_gb must be in"),
    ({"model": {"path": "/no/such/model"}}, "model.path '/no/such/model' is not a local model"),
    ({"name": "a b"}, "name must be letters"),
    ({"workers": {"gpus_per_worker": 0.5}}, "workers.gpus_per_worker needs workers.device: cuda"),
    ({"workers": {"gpu_memory_fraction": 0.4}},
     "workers.gpu_memory_fraction needs workers.device: cuda"),
    ({"workers": {"device": "cuda", "gpus_per_worker": 0}},
     "workers.gpus_per_worker must be in \\(0, 1\\], got 0.0"),
    ({"workers": {"device": "cuda", "gpus_per_worker": 1.5}},
     "workers.gpus_per_worker must be in \\(0, 1\\]"),
    ({"workers": {"device": "cuda", "gpus_per_worker": "half"}},
     "workers.gpus_per_worker must be float or null, got 'half'"),
    ({"workers": {"device": "cuda", "gpu_memory_fraction": 0.99}},
     "workers.gpu_memory_fraction must be in \\(0, 0.95\\]"),
    ({"workers": {"device": "cuda", "gpus_per_worker": 0.5, "gpu_memory_fraction": 0.6}},
     "workers.gpu_memory_fraction 0.6 x 2 workers on one GPU \\(gpus_per_worker 0.5\\)"),
    ({"workers": {"kv_transport": "nccl"}},
     "workers.kv_transport must be one of auto, shared, dist"),
    ({"workers": {"device": "cuda", "gpus_per_worker": 0.5, "kv_transport": "dist"}},
     "workers.kv_transport dist needs a whole GPU per worker"),
    ({"tls": {"cert_file": "server.pem"}},
     "tls.cert_file and tls.key_file go together \\(got only tls.cert_file\\)"),
    ({"tls": {"key_file": "server.key", "ca_file": "ca.pem"}},
     "tls.cert_file and tls.key_file go together \\(got only tls.key_file\\)"),
    ({"tls": {"cert_file": "server.pem", "key_file": "server.key"}},
     "tls.ca_file is needed with tls.cert_file"),
    ({"tls": {"ca_file": "ca.pem"}}, "tls.ca_file without tls.cert_file"),
    ({"tls": {"cert_file": ""}}, "tls.cert_file must be a path \\(or null\\)"),
    ({"tls": {"certificate": "x"}}, "unknown key tls.certificate"),
    ({"cluster_tls": {"cert_file": "server.pem", "key_file": "server.key"}},
     "cluster_tls.cert_file, key_file and ca_file go together \\(missing cluster_tls.ca_file\\)"),
    ({"cluster_tls": {"ca_file": "ca.pem"}},
     "missing cluster_tls.cert_file, cluster_tls.key_file"),
    ({"cluster_tls": {"ca_file": 3}}, "cluster_tls.ca_file must be str or null, got 3"),
    ({"router": {"port": 50051, "internal_port": 50051}},
     "router.internal_port must be in \\[1, 65535\\] and differ from router.port"),
    ({"cluster_token_file": ""}, "cluster_token_file must be a path"),
    ({"autoscale": {"enabled": "yes"}}, "autoscale.enabled must be true or false"),
    ({"autoscale": {"decode": {"min": 0, "max": 2}}},
     "autoscale.decode needs 1 <= min <= max <= 64 \\(the last worker of a role never goes\\)"),
    ({"autoscale": {"enabled": True, "decode": {"min": 2, "max": 3}}},
     "decode.replicas \\(1\\) must lie within autoscale.decode \\[2, 3\\]"),
    ({"autoscale": {"interval_s": 0}}, "autoscale.interval_s must be in \\(0, 3600\\]"),
    ({"autoscale": {"kv_high": 1.5}}, "kv_high in \\(0, 1\\]"),
    ({"autoscale": {"profile": "p.json"}}, "autoscale.profile and autoscale.workload go together"),
    ({"autoscale": {"slo_file": "no-such.yaml"}},
     "autoscale.slo_file 'no-such.yaml' is not a file"),
    ({"autoscale": {"prefill": {"mn": 1}}}, "unknown key autoscale.prefill.mn"),
])
def test_mistakes_are_errors_naming_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        DeployConfig.from_dict(data)


def test_credentials_are_paths_handed_to_the_actors():
    files = {"cert_file": "/etc/pdserve/server.pem", "key_file": "/etc/pdserve/server.key",
             "ca_file": "/etc/pdserve/ca.pem"}
    config = DeployConfig.from_dict({"cluster_token_file": "/etc/pdserve/token", "tls": files,
                                     "cluster_tls": files})
    credentials = config.credentials
    assert credentials.token_file == "/etc/pdserve/token"
    assert credentials.tls.enabled and credentials.tls.ca_file == "/etc/pdserve/ca.pem"
    assert credentials.cluster_tls.enabled and credentials.cluster_tls.key_file == files["key_file"]
    plain = DeployConfig.from_dict({}).credentials
    assert not plain.tls.enabled and not plain.cluster_tls.enabled and plain.token_file is None


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
