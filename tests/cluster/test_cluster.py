"""The disaggregated cluster end to end: real processes, real gRPC, real KV transfers on CPU —
once per transport (shared: one-sided copies into the decode worker's shared-memory cache; dist:
gloo pair groups), at 1P+1D and 2P+2D, one cluster per combination shared by its tests. Greedy
output through the cluster must be token-identical to the offline engine."""

from __future__ import annotations

import pytest

from tests.cluster.cluster_helpers import (
    MAX_TOKENS,
    LoadWatcher,
    greedy_request,
    long_prompt,
    offline_greedy,
    start_cluster,
    stream_all,
    stream_tokens,
    wait_blocks_free,
)
from tests.conftest import mixed_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(workload_prompts) -> list[list[int]]:
    return mixed_prompts(workload_prompts, 16) + [long_prompt()]


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    """The offline engine's greedy tokens, computed before any cluster process starts."""
    return offline_greedy(prompts, MAX_TOKENS)


@pytest.fixture(scope="module", params=[("shared", 1, 1), ("shared", 2, 2), ("dist", 1, 1),
                                        ("dist", 2, 2)], ids=lambda p: f"{p[0]}-{p[1]}p{p[2]}d")
def cluster(request, tmp_path_factory, reference):
    transport, prefill, decode = request.param
    with start_cluster(tmp_path_factory.mktemp(f"{transport}-{prefill}p{decode}d"),
                       prefill=prefill, decode=decode, dtype="float32",
                       kv_transport=transport) as running:
        yield running


def test_cluster_greedy_matches_offline_engine_with_16_concurrent_streams(
        cluster, prompts, reference):
    before = {w.worker_id: w.total_blocks for w in cluster.status().workers}
    with LoadWatcher(cluster) as watcher:
        got = stream_all(cluster.address, prompts, concurrency=16)
    for i, (ours, ref) in enumerate(zip(got, reference)):
        assert ours == ref, f"prompt {i} ({len(prompts[i])} tokens) differs"
    workers = wait_blocks_free(cluster)
    assert {w.worker_id: w.free_blocks for w in workers} == before, "KV blocks leaked"
    busy = {wid for wid, n in watcher.max_running.items() if n > 0}
    decode_ids = {w.worker_id for w in workers if w.role == 2}
    assert busy >= decode_ids, f"placement left decode workers idle: {watcher.max_running}"
    assert {w.kv_transport for w in workers} == {cluster.spec.kv_transport}


def test_long_prompt_crosses_the_transfer_intact_and_reports_timings(
        cluster, prompts, reference):
    ids = prompts[-1]
    assert len(ids) >= 1500
    tokens, text, last = stream_tokens(cluster.address, greedy_request(ids))
    assert tokens == reference[-1]
    assert last.timings.kv_transport == cluster.spec.kv_transport
    assert text  # detokenized by the router
    # 30 layers x 2 x 3 KV heads x 64 dims x 4 bytes per token, whole blocks of 16 tokens
    blocks = -(-len(ids) // 16)
    assert last.timings.kv_transfer_bytes == blocks * 16 * 30 * 2 * 3 * 64 * 4
    assert last.timings.kv_transfer_s > 0
    assert last.usage.prompt_tokens == len(ids) and last.usage.completion_tokens == MAX_TOKENS
    assert 0 < last.timings.ttft_s <= last.timings.e2e_s


def test_colocated_mode_matches_offline_engine(tmp_path, prompts, reference):
    with start_cluster(tmp_path, prefill=0, decode=0, colocated=1, dtype="float32") as cluster:
        got = stream_all(cluster.address, prompts[:6], concurrency=6)
        assert got == reference[:6]
        status = cluster.status()
        assert [w.role for w in status.workers] == [3]  # WORKER_ROLE_COLOCATED
        assert wait_blocks_free(cluster)[0].free_blocks == status.workers[0].total_blocks
        assert sorted(cluster.processes) == ["colocated-0", "router"]  # started once, not twice
    assert all(p.poll() is not None for p in cluster.processes.values()), "processes left running"
