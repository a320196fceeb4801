"""The model families beyond Llama through everything the engine and the cluster do: a tiny random
Qwen3 checkpoint (per-head q/k RMSNorm), built with transformers' own config class, against
transformers' greedy output — in the engine under chunked prefill of 16, preemption and prefix
hits, split over 2 tensor-parallel ranks, and through a 1P+1D cluster over the dist transport."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams
from tests.cluster.cluster_helpers import start_cluster, stream_all, wait_blocks_free
from tests.conftest import mixed_prompts, save_tiny_model
from tests.engine.hf_reference import hf_greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, default_model_dir):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "Qwen3ForCausalLM",
                           default_model_dir, seed=5, head_dim=32)


@pytest.fixture(scope="module")
def prompts(workload_prompts) -> list[list[int]]:
    """Mixed lengths, and two sharing a 64-token prefix (a prefix hit for the second)."""
    shared = workload_prompts[8][:64]
    return mixed_prompts(workload_prompts, 12)[::2] + [shared + [11, 12, 13],
                                                       shared + [21, 22]]


@pytest.fixture(scope="module")
def expected(qwen3_dir, prompts) -> list[list[int]]:
    return hf_greedy(qwen3_dir, prompts, MAX_TOKENS)


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert engine.block_manager.usage().used == 0
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_in_the_engine_equals_transformers(qwen3_dir, prompts, expected, tp):
    """Chunks of 16 and a cache small enough to preempt; TP 2 splits its 4 query heads over 2
    KV heads, one each."""
    engine = LLMEngine(EngineConfig(
        model=str(qwen3_dir), dtype="float32", tensor_parallel_size=tp,
        cache=CacheConfig(block_size=16, num_blocks=14),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                  prefill_chunk_size=16)))
    try:
        assert run(engine, prompts) == expected
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.prefix_hits > 0
    finally:
        engine.close()


def test_qwen3_through_a_disaggregated_cluster(tmp_path, qwen3_dir, prompts, expected):
    with start_cluster(tmp_path, prefill=1, decode=1, model=str(qwen3_dir), dtype="float32",
                       kv_transport="dist", router_args=("--local-prefill", "off")) as cluster:
        got = stream_all(cluster.address, prompts, concurrency=len(prompts))
        assert [g[:MAX_TOKENS] for g in got] == expected
        assert all(w.free_blocks == w.total_blocks for w in wait_blocks_free(cluster))
