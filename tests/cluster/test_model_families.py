"""The model families beyond Llama through everything the engine and the cluster do: tiny random
Qwen3 (per-head q/k RMSNorm), Phi-3 (fused qkv and gate/up weights), Mistral with a sliding window,
Qwen2 with sliding and full layers mixed, and the mixtures of experts Mixtral, Qwen3-MoE and
Qwen2-MoE (a shared expert beside the routed ones) —
checkpoints built with transformers' own config classes, against transformers' greedy output: in
the engine under chunked prefill of 16, preemption and prefix hits, split over 2 tensor-parallel
ranks, under async scheduling, and through a 1P+1D cluster over each transport."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams
from tests.cluster.cluster_helpers import start_cluster, stream_all, wait_blocks_free
from tests.engine.hf_reference import engine_greedy
from tests.model_families import MAX_TOKENS

pytestmark = pytest.mark.slow


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    outputs = engine_greedy(engine, prompts, MAX_TOKENS)
    assert engine.block_manager.usage().used == 0
    return outputs


@pytest.mark.parametrize(("tp", "async_scheduling"), [(1, False), (2, False), (1, True)],
                         ids=["tp1", "tp2", "async"])
def test_the_family_in_the_engine_equals_transformers(family_dir, family_prompt_ids,
                                                      family_expected, tp, async_scheduling):
    """Chunks of 16 and a cache small enough to preempt; TP 2 splits the 4 query heads over 2
    KV heads, one each (Phi-3's fused weights read as each rank's rows of every part); async
    scheduling prepares step N+1 while step N runs."""
    engine = LLMEngine(EngineConfig(
        model=str(family_dir), dtype="float32", tensor_parallel_size=tp,
        async_scheduling=async_scheduling, cache=CacheConfig(block_size=16, num_blocks=14),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                  prefill_chunk_size=16)))
    try:
        assert run(engine, family_prompt_ids) == family_expected
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.prefix_hits > 0
    finally:
        engine.close()


@pytest.mark.parametrize("transport", ["shared", "dist"])
def test_the_family_through_a_disaggregated_cluster(tmp_path, family_dir, family_prompt_ids,
                                                    family_expected, transport):
    with start_cluster(tmp_path, prefill=1, decode=1, model=str(family_dir), dtype="float32",
                       kv_transport=transport, router_args=("--local-prefill", "off")) as cluster:
        got = stream_all(cluster.address, family_prompt_ids,
                         concurrency=len(family_prompt_ids))
        assert [g[:MAX_TOKENS] for g in got] == family_expected
        assert all(w.free_blocks == w.total_blocks for w in wait_blocks_free(cluster))


def test_the_family_scores_a_prompt_as_transformers_does(family_dir, family_prompt_ids):
    """Logits, not only greedy tokens: every prompt position's log-probability of the next prompt
    token (computed in chunks of 16, so windows and chunk edges cross) within 1e-4 of
    transformers' float32 log-softmax."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = max(family_prompt_ids, key=len)
    engine = LLMEngine(EngineConfig(
        model=str(family_dir), dtype="float32", cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, prefill_chunk_size=16)))
    engine.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0), request_id="p")
    got = None
    while engine.has_unfinished_requests():
        got = next((o.prompt_logprobs for o in engine.step() if o.finished), got)
    model = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    worst = max(abs(got[p][prompt[p]] - expected[p - 1, prompt[p]].item())
                for p in range(1, len(prompt)))
    assert worst < 1e-4, worst
