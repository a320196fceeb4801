"""The Locust load test, headless, against a local 1P+1D cluster of the tiny model: a loose SLO
passes (exit 0, CSV + HTML written, every entry recorded) over gRPC and over the OpenAI HTTP
API, an impossible one exits non-zero —
and `loadtest local` starts and stops its own cluster, leaving no process behind."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.cluster_helpers import start_cluster

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]
LOAD = ["--users", "3", "--duration-s", "8", "--max-requests", "40", "--max-tokens-cap", "6",
        "--request-timeout-s", "60"]


def _slo(tmp_path: Path, ttft_ms: float) -> str:
    path = tmp_path / f"slo-{ttft_ms}.yaml"
    path.write_text(f"ttft: {{percentile: 90, max_ms: {ttft_ms}}}\n"
                    "itl: {percentile: 99, max_ms: 60000}\nmax_error_rate: 0.05\n")
    return str(path)


def _loadtest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loadtest", *args, *LOAD], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    with start_cluster(tmp_path_factory.mktemp("load"), prefill=1, decode=1,
                       model=str(tiny_llama_dir), kv_cache_gb=0.05) as running:
        yield running


def test_a_loose_slo_passes_and_writes_the_reports(cluster, tmp_path):
    out = tmp_path / "out"
    done = _loadtest("run", "--address", cluster.address, "--slo", _slo(tmp_path, 60000),
                     "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for entry in ("TTFT", "ITL", "errors", "completed"):
        assert f"PASS  {entry}" in done.stdout
    with (out / "locust_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    assert int(rows["E2E"]["Request Count"]) > 0 and int(rows["TTFT"]["Request Count"]) > 0
    assert int(rows["ITL"]["Request Count"]) > 0 and int(rows["E2E"]["Failure Count"]) == 0
    assert (out / "report.html").stat().st_size > 0


def test_the_http_user_streams_openai_completions_with_the_same_entries(cluster, tmp_path):
    out = tmp_path / "out"
    done = _loadtest("run", "--api", "http", "--address", cluster.status().http_address,
                     "--slo", _slo(tmp_path, 60000), "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with (out / "locust_stats.csv").open() as f:
        rows = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    for name in ("TTFT", "ITL", "E2E"):
        assert int(rows[("http", name)]["Request Count"]) > 0, name
    assert int(rows[("http", "E2E")]["Failure Count"]) == 0


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """pdserve installed as a user installs it (`pip install .`, not editable) into a directory
    of its own; its dependencies are this environment's."""
    target = tmp_path_factory.mktemp("installed")
    build = tmp_path_factory.mktemp("source")
    shutil.copytree(REPO_ROOT, build / "pdserve", ignore=shutil.ignore_patterns(
        ".venv", ".git", ".gpu", "__pycache__", "*.egg-info", "build", "logs"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(build / "pdserve")],
                   check=True, capture_output=True, timeout=300)
    return target


def _installed_loadtest(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(installed), "COLUMNS": "1000"}  # help on one line
    return subprocess.run([sys.executable, "-m", "loadtest", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_an_installed_loadtest_runs_its_default_workload_from_anywhere(cluster, installed,
                                                                       tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shown = _installed_loadtest(installed, elsewhere, "run", "--help")
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert str(installed / "loadtest" / "workloads" / "online_mixed.jsonl") in shown.stdout
    assert str(installed / "loadtest" / "slo.yaml") in shown.stdout
    out = elsewhere / "out"
    done = _installed_loadtest(installed, elsewhere, "run", "--address", cluster.address,
                               "--slo", _slo(tmp_path, 60000), "--out", str(out), *LOAD)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with (out / "locust_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    assert int(rows["E2E"]["Request Count"]) > 0 and int(rows["E2E"]["Failure Count"]) == 0


def test_an_impossible_slo_exits_non_zero(cluster, tmp_path):
    done = _loadtest("run", "--address", cluster.address, "--slo", _slo(tmp_path, 0.001),
                     "--out", str(tmp_path / "out"))
    assert done.returncode != 0
    assert "FAIL  TTFT" in done.stdout and "PASS  errors" in done.stdout


def test_local_starts_its_own_cluster_and_stops_it(tiny_llama_dir, tmp_path):
    model = tmp_path / "tiny-local"  # its own path, so its processes can be told apart
    shutil.copytree(tiny_llama_dir, model)
    done = _loadtest("local", "--model", str(model), "--kv-cache-gb", "0.05",
                     "--slo", _slo(tmp_path, 0.001), "--out", str(tmp_path / "out"))
    assert done.returncode != 0 and "FAIL  TTFT" in done.stdout  # it ran, and judged
    assert "cluster ready" in done.stdout
    leftover = subprocess.run(["pgrep", "-f", str(model)],
                              capture_output=True, text=True)
    assert leftover.stdout == ""
