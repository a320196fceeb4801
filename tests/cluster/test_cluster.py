"""The disaggregated cluster end to end: real processes, real gRPC, real KV transfers on CPU —
once per transport (shared: one-sided copies into the decode worker's shared-memory cache; dist:
gloo pair groups), at 1P+1D and 2P+2D, one cluster per combination shared by its tests, and over
the placement modes (local prefill on the decode worker auto or off; cache-aware or load-only
placement); the dist 2P+2D cluster runs in secure mode (cluster token, TLS, transfer secrets).
Greedy output through the cluster must be token-identical to the offline engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from common.grpc_server import channel
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from tests.cluster.cluster_helpers import (
    MAX_TOKENS,
    LoadWatcher,
    greedy_params,
    greedy_request,
    long_prompt,
    offline_outputs,
    router_ca,
    scrape,
    secure_spec,
    start_cluster,
    stream_all,
    stream_tokens,
    wait_blocks_free,
)
from tests.conftest import mixed_prompts

if TYPE_CHECKING:
    from engine.engine import RequestOutput

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(workload_prompts) -> list[list[int]]:
    """16 mixed prompts and a long one (streamed together), then two more long ones for the
    transfer tests: one no worker has seen, and one sharing 800 tokens with it."""
    fresh = long_prompt(rank=1)[20:]  # past the chat template many workload prompts share
    shares_800 = fresh[:800] + long_prompt()[:700]
    return mixed_prompts(workload_prompts, 16) + [long_prompt(), fresh, shares_800]


# The prompts (by index; the second cut to 600 tokens) whose logprobs (top 2) are checked.
LOGPROB_PROMPTS = {6: None, 17: 600}


@pytest.fixture(scope="module")
def offline_runs(prompts) -> list[RequestOutput]:
    """One offline engine's outputs, computed before any cluster process starts: each prompt's
    greedy tokens, then the prompt logprobs of LOGPROB_PROMPTS."""
    from engine.request import SamplingParams

    logprobs = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    chosen = [prompts[i][:cut] for i, cut in LOGPROB_PROMPTS.items()]
    return offline_outputs(prompts + chosen,
                           [greedy_params(MAX_TOKENS)] * len(prompts) + [logprobs] * len(chosen))


@pytest.fixture(scope="module")
def reference(offline_runs, prompts) -> list[list[int]]:
    """The offline engine's greedy tokens."""
    return [out.token_ids for out in offline_runs[:len(prompts)]]


# (transport, prefill workers, decode workers, router placement flags, secure mode: a cluster
# token, TLS on the router, transfer secrets checked — the whole module runs on it once; async
# scheduling on the decode workers: step N+1 scheduled before step N is read)
CLUSTERS = [("shared", 1, 1, (), False, False),
            ("shared", 2, 2, ("--local-prefill", "off"), False, True),
            ("dist", 1, 1, ("--local-prefill", "off", "--placement", "load"), False, False),
            ("dist", 2, 2, (), True, False)]


@pytest.fixture(scope="module", params=CLUSTERS,
                ids=lambda p: f"{p[0]}-{p[1]}p{p[2]}d{'-' if p[3] else ''}"
                              f"{'-'.join(a.strip('-') for a in p[3])}"
                              f"{'-secure' if p[4] else ''}{'-async' if p[5] else ''}")
def cluster(request, tmp_path_factory, reference):
    transport, prefill, decode, placement, secure, async_scheduling = request.param
    tmp = tmp_path_factory.mktemp(f"{transport}-{prefill}p{decode}d")
    with start_cluster(tmp, prefill=prefill, decode=decode, dtype="float32",
                       kv_transport=transport, router_args=placement,
                       async_scheduling=async_scheduling,
                       **(secure_spec(tmp) if secure else {})) as running:
        yield running


def test_cluster_greedy_matches_offline_engine_with_16_concurrent_streams(
        cluster, prompts, reference):
    before = {w.worker_id: w.total_blocks for w in cluster.status().workers}
    with LoadWatcher(cluster) as watcher:
        got = stream_all(cluster.address, prompts[:17], concurrency=16,
                         root_ca=router_ca(cluster))
    for i, (ours, ref) in enumerate(zip(got, reference)):
        assert ours == ref, f"prompt {i} ({len(prompts[i])} tokens) differs"
    workers = wait_blocks_free(cluster)
    assert {w.worker_id: w.free_blocks for w in workers} == before, "KV blocks leaked"
    busy = {wid for wid, n in watcher.max_running.items() if n > 0}
    decode_ids = {w.worker_id for w in workers if w.role == 2}
    assert busy >= decode_ids, f"placement left decode workers idle: {watcher.max_running}"
    assert {w.kv_transport for w in workers} == {cluster.spec.kv_transport}


BLOCK_BYTES = 16 * 30 * 2 * 3 * 64 * 4  # tokens x layers x K/V x KV heads x dims x fp32


def streamed_bytes(cluster) -> float:  # noqa: ANN001 - a LocalCluster
    """KV bytes the prefill workers copied while their prompts were still computing."""
    return sum(scrape(w.metrics_address).get("pdserve_worker_kv_streamed_bytes_total"
                                             "{role=prefill}", 0.0)
               for w in cluster.status().workers if w.role == pb.WORKER_ROLE_PREFILL)


def test_long_prompt_crosses_the_transfer_intact_and_reports_timings(
        cluster, prompts, reference):
    ids = prompts[-2]  # seen by no worker yet
    assert len(ids) >= 1400
    streamed_before = streamed_bytes(cluster)
    tokens, text, last = stream_tokens(cluster.address, greedy_request(ids),
                                       root_ca=router_ca(cluster))
    assert tokens == reference[-2]
    # Prefilled alone in 512-token chunks: every chunk but the last was streamed while the next
    # one computed (a copy on shared, a piece on dist), the rest (the tail) after the first token.
    streamed = streamed_bytes(cluster) - streamed_before
    before_last_chunk = (len(ids) - 1) // 512 * 512 // 16 * BLOCK_BYTES
    assert streamed == before_last_chunk
    assert last.timings.kv_transport == cluster.spec.kv_transport
    assert last.timings.prefill_site == "remote"  # long, and the prefill pool is idle
    assert text  # detokenized by the router
    assert last.timings.kv_transfer_bytes == -(-len(ids) // 16) * BLOCK_BYTES  # whole blocks
    assert last.timings.kv_transfer_s > 0
    assert last.usage.prompt_tokens == len(ids) and last.usage.completion_tokens == MAX_TOKENS
    assert last.usage.cached_tokens == 0
    assert 0 < last.timings.ttft_s <= last.timings.e2e_s
    wait_blocks_free(cluster)  # the next test's placement reads the heartbeats after this one


def test_only_blocks_the_decode_worker_lacks_are_sent(cluster, prompts, reference):
    """Its first 800 tokens were the previous test's prompt's: both the prefill worker that
    computed it and the decode worker that received it hold them in their prefix caches."""
    ids = prompts[-1]
    tokens, _, last = stream_tokens(cluster.address, greedy_request(ids),
                                    root_ca=router_ca(cluster))
    assert tokens == reference[-1]
    assert last.usage.cached_tokens == 800  # not computed again on the prefill worker
    assert last.timings.kv_transport == cluster.spec.kv_transport  # prefilled remotely
    whole = -(-len(ids) // 16)  # placed on the decode worker that holds the 800 tokens
    assert last.timings.kv_transfer_bytes == (whole - 800 // 16) * BLOCK_BYTES
    wait_blocks_free(cluster)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_colocated_mode_matches_offline_engine(tmp_path, prompts, reference,
                                              prompt_logprobs_reference, tp):
    """Also with the model split over 2 ranks (one more process: engine.tp_ranks)."""
    with start_cluster(tmp_path, prefill=0, decode=0, colocated=1, dtype="float32",
                       tensor_parallel_size=tp) as cluster:
        got = stream_all(cluster.address, prompts[:6], concurrency=6)
        assert got == reference[:6]
        request = greedy_request(prompts[6], max_tokens=2)
        request.sampling.prompt_logprobs = 2
        with channel(cluster.address) as ch:
            reply = pb_grpc.GenerationStub(ch).Complete(request, timeout=180)
        assert_prompt_logprobs(list(reply.prompt_logprobs), prompts[6],
                               prompt_logprobs_reference[6])
        status = cluster.status()
        assert [w.role for w in status.workers] == [3]  # WORKER_ROLE_COLOCATED
        assert status.workers[0].tensor_parallel_size == tp
        assert wait_blocks_free(cluster)[0].free_blocks == status.workers[0].total_blocks
        assert sorted(cluster.processes) == ["colocated-0", "router"]  # started once, not twice
    assert all(p.poll() is not None for p in cluster.processes.values()), "processes left running"


def test_a_short_prompt_is_prefilled_where_the_placement_mode_says(cluster, prompts, reference):
    """31 tokens: one of the decode worker's 32-token chunks on CPU, so it is short there."""
    tokens, _, last = stream_tokens(cluster.address, greedy_request(prompts[6]),
                                    root_ca=router_ca(cluster))
    assert tokens == reference[6]
    local = "off" not in cluster.spec.router_args
    assert last.timings.prefill_site == ("local" if local else "remote")
    assert (last.timings.kv_transfer_bytes == 0) == local


@pytest.fixture(scope="module")
def prompt_logprobs_reference(offline_runs, prompts) -> dict[int, list]:
    """The offline engine's prompt logprobs (top 2) for a short prompt and a 600-token one."""
    chosen = offline_runs[len(prompts):]
    return {i: out.prompt_logprobs for i, out in zip(LOGPROB_PROMPTS, chosen)}


def assert_prompt_logprobs(got: list[pb.TokenLogprob], prompt: list[int], expected: list) -> None:
    assert [e.token_id for e in got] == prompt[1:]
    for entry, want in zip(got, expected[1:]):
        have = {entry.token_id: entry.logprob, **dict(entry.top)}
        assert have.keys() == want.keys()
        assert all(abs(have[t] - want[t]) < 1e-3 for t in want)


def test_prompt_logprobs_from_whichever_worker_computes_the_prompt(cluster, prompts,
                                                                   prompt_logprobs_reference):
    """Short prompts are prefilled locally where the placement mode allows, long ones remotely;
    either way the prompt's logprobs arrive with the first token, as the offline engine's."""
    for i, cut in LOGPROB_PROMPTS.items():
        ids = prompts[i][:cut]
        request = greedy_request(ids, max_tokens=2)
        request.sampling.prompt_logprobs = 2
        with channel(cluster.address, router_ca(cluster)) as ch:
            parts = list(pb_grpc.GenerationStub(ch).Generate(request, timeout=180))
        assert_prompt_logprobs(list(parts[0].prompt_logprobs), ids, prompt_logprobs_reference[i])
        assert all(not p.prompt_logprobs for p in parts[1:])
        assert parts[-1].usage.cached_tokens == 0  # computed, not served from a cache
    wait_blocks_free(cluster)


def test_n_samples_prefill_once_and_fork_on_the_decode_worker(cluster, prompts):
    """n = 3: sample 0 is prefilled (locally or remotely, as the placement mode says) and the
    others fork from its KV on its decode worker (Timings.prefill_site "fork"); each sample
    equals the same request sent alone with seed + j, and no block stays held."""
    for ids in (prompts[9], prompts[17][:600]):
        request = greedy_request(ids, max_tokens=6)
        request.sampling.temperature, request.sampling.seed = 1.0, 21
        request.n = 3
        with channel(cluster.address, router_ca(cluster)) as ch:
            parts = list(pb_grpc.GenerationStub(ch).Generate(request, timeout=180))
        last = {p.index: p for p in parts if p.finish_reason != pb.FINISH_REASON_UNSPECIFIED}
        assert sorted(last) == [0, 1, 2]
        assert last[0].timings.prefill_site in ("local", "remote")
        assert [last[j].timings.prefill_site for j in (1, 2)] == ["fork", "fork"]
        for j in range(3):
            alone = greedy_request(ids, max_tokens=6)
            alone.sampling.temperature, alone.sampling.seed = 1.0, 21 + j
            tokens, _, _ = stream_tokens(cluster.address, alone, root_ca=router_ca(cluster))
            assert [t for p in parts if p.index == j for t in p.token_ids] == tokens, j
    assert all(w.free_blocks == w.total_blocks for w in wait_blocks_free(cluster))
