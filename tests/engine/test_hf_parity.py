"""Greedy float32 output is token-identical to transformers `generate`: for a tiny random Llama and
for the default SmolLM2-135M, ≥20 mixed-length prompts as one batch, plain, with 16-token prefill
chunks, with a KV budget that forces preemption, and with prefix-cache hits."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm import LLM
from engine.request import SamplingParams
from tests.conftest import mixed_prompts
from tests.engine.hf_reference import hf_greedy

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def engine_for(model_dir, *, num_blocks=1024, chunk=None, budget=2048, prefix=True) -> LLM:
    return LLM(config=EngineConfig(
        model=str(model_dir), dtype="float32",
        cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, prefill_chunk_size=chunk),
    ))


@pytest.fixture(scope="module", params=["tiny-llama", "smollm2"])
def case(request, tiny_llama_dir, default_model_dir, workload_prompts):
    model_dir = tiny_llama_dir if request.param == "tiny-llama" else default_model_dir
    prompts = mixed_prompts(workload_prompts, 20)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW)


def token_ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_one_batch_matches_transformers(case):
    model_dir, prompts, expected = case
    assert token_ids(engine_for(model_dir).generate(prompts, GREEDY)) == expected


def test_chunked_prefill_of_16_matches(case):
    model_dir, prompts, expected = case
    llm = engine_for(model_dir, chunk=16, budget=256)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected


def test_preemption_keeps_output_identical(case):
    model_dir, prompts, expected = case
    # The longest request needs 27 blocks of 16; 40 blocks cannot hold the batch at once.
    llm = engine_for(model_dir, num_blocks=40, prefix=False)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 40


def test_prefix_cache_hits_give_the_same_output(case):
    model_dir, prompts, expected = case
    llm = engine_for(model_dir)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)  # every prompt of >16 tokens now hits the cache
    assert token_ids(first) == token_ids(second) == expected
    assert sum(o.num_cached_tokens for o in second) > 0
    assert all(o.num_cached_tokens == 0 for o in first[:1])
    assert llm.engine.block_manager.prefix_hit_rate > 0
