"""The cluster on CUDA: 1P+1D and 2P+2D on one GPU over the shared transport (CUDA IPC), 16
concurrent streams token-identical to the offline engine and no block leaked; `dist` on one GPU
refused at once with a clear error; with two GPUs or more also NCCL between them; and
`router launch --device cuda` started as a user starts it, serving the default model and stopping
cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.cluster import ClusterSpec, LocalCluster, free_port
from tests.cluster.cluster_helpers import (
    greedy_request,
    offline_greedy,
    start_cluster,
    stream_all,
    stream_tokens,
    wait_blocks_free,
)
from tests.cluster.openai_helpers import raw
from tests.conftest import mixed_prompts
from tests.gpu.conftest import gpu_count

MAX_TOKENS = 12
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prompts(workload_prompts) -> list[list[int]]:
    return mixed_prompts(workload_prompts, 16)


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    return offline_greedy(prompts, MAX_TOKENS)  # float32 on the CPU: CUDA fp32 must match it


def run_cluster(tmp: Path, prompts: list[list[int]], reference: list[list[int]],
                **spec: object) -> tuple[set[str], set[str]]:
    with start_cluster(tmp, dtype="float32", device="cuda", **spec) as cluster:
        before = {w.worker_id: w.total_blocks for w in cluster.status().workers}
        got = stream_all(cluster.address, prompts, concurrency=16)
        assert got == reference
        workers = wait_blocks_free(cluster)
        assert {w.worker_id: w.free_blocks for w in workers} == before, "KV blocks leaked"
        return {w.kv_transport for w in workers}, {w.kv_device for w in workers}


EAGER = {"cuda_graphs": False, "async_scheduling": False}
WITHOUT_FUSED = {"fused_kernels": False}


@pytest.mark.parametrize("prefill, decode, speed_paths", [
    (1, 1, EAGER), (2, 2, {}), (1, 1, WITHOUT_FUSED)], ids=["eager", "default", "unfused"])
def test_one_gpu_shared_transport_matches_the_offline_engine(prefill, decode, speed_paths,
                                                             prompts, reference, tmp_path):
    """The workers' defaults on CUDA ({}): every worker replays CUDA graphs and runs the fused
    kernels, decode workers schedule asynchronously; EAGER turns all three off, WITHOUT_FUSED
    the fused kernels only."""
    transports, devices = run_cluster(tmp_path, prompts, reference, prefill=prefill,
                                      decode=decode, gpus=1, kv_transport="shared",
                                      router_args=("--local-prefill", "off"), **speed_paths)
    assert transports == {"shared"} and all(d.startswith("cuda") for d in devices)


def test_dist_on_one_gpu_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="--kv-transport dist needs one GPU per worker"):
        LocalCluster(ClusterSpec(prefill=1, decode=1, device="cuda", gpus=1,
                                 kv_transport="dist")).start()


@pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs")
def test_two_gpus_nccl_matches_the_offline_engine(prompts, reference, tmp_path):
    transports, _ = run_cluster(tmp_path, prompts, reference, prefill=1, decode=1, gpus=2,
                                kv_transport="dist", router_args=("--local-prefill", "off"))
    assert transports == {"dist"}


def test_router_launch_device_cuda_serves_and_stops_cleanly(tmp_path):
    port, http_port = free_port(), free_port()
    launch = subprocess.Popen(
        [sys.executable, "-m", "router", "launch", "--device", "cuda", "--port", str(port),
         "--http-port", str(http_port), "--log-dir", str(tmp_path / "logs"), "--kv-cache-gb", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        ready = ""
        while f"127.0.0.1:{port}" not in ready and time.monotonic() < deadline:
            line = launch.stdout.readline() if launch.stdout else ""
            if not line and launch.poll() is not None:
                break
            ready += line
        assert f"127.0.0.1:{port}" in ready, ready[-3000:]
        tokens, _, last = stream_tokens(f"127.0.0.1:{port}", greedy_request([1, 2, 3, 4], 8))
        assert len(tokens) == 8 and last.timings.e2e_s > 0
        assert streamed_completion_tokens(f"127.0.0.1:{http_port}") == 8
    finally:
        launch.send_signal(signal.SIGINT)
        code = launch.wait(120)
    assert code == 0
    assert processes_naming(f"127.0.0.1:{port}") == []  # every process it started is gone


def streamed_completion_tokens(http_address: str) -> int:
    """Streams one completion over HTTP (the router's stream driver beside a CUDA decode worker)
    and returns the usage it reports after checking the SSE stream ended with [DONE]."""
    conn, reply = raw(http_address, "/v1/models")
    model = json.loads(reply.read())["data"][0]["id"]
    conn.close()
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    conn, reply = raw(http_address, "/v1/completions", body)
    data = reply.read()
    conn.close()
    assert reply.status == 200 and data.endswith(b"data: [DONE]\n\n"), data[-500:]
    last = json.loads(data.split(b"\n\n")[-3][len(b"data: "):])
    return last["usage"]["completion_tokens"]


def processes_naming(text: str) -> list[int]:
    """Pids whose command line holds `text` (read from /proc: no pgrep needed)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:  # it exited meanwhile
            continue
    return [pid for pid in found if pid != os.getpid()]
