"""Every model family beyond Llama on CUDA (issue 32's GPU part): the tiny checkpoints of
tests/model_families.py — Qwen3, Phi-3, Mistral and Qwen2 with sliding windows, Gemma 2 and 3
(windows and soft-capping), Mixtral, Qwen3-MoE and Qwen2-MoE — through the Triton attention
kernel's windows and soft-capping and the Triton MoE kernel, in float32, greedy tokens equal to
transformers' (on the CPU), under chunked prefill of 16, preemption and prefix hits, eager and
with CUDA graphs, async scheduling and fused kernels all on."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from tests.engine.hf_reference import engine_greedy
from tests.model_families import MAX_TOKENS

PATHS = {"eager": {"cuda_graphs": False, "async_scheduling": False, "fused_kernels": False},
         "all": {"cuda_graphs": True, "async_scheduling": True, "fused_kernels": True}}


@pytest.mark.parametrize("paths", list(PATHS))
def test_the_family_on_cuda_equals_transformers(family_dir, family_prompt_ids,
                                                family_expected, paths):
    engine = LLMEngine(EngineConfig(
        model=str(family_dir), dtype="float32", device="cuda", **PATHS[paths],
        cache=CacheConfig(block_size=16, num_blocks=14),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                  prefill_chunk_size=16)))
    try:
        assert engine.runner.attention.name == "triton"
        assert all(layer.moe is None or layer.moe.backend == "triton"
                   for layer in engine.runner.model.layers)  # the default on CUDA
        assert engine_greedy(engine, family_prompt_ids, MAX_TOKENS) == family_expected
        assert engine.block_manager.usage().used == 0
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.prefix_hits > 0
    finally:
        engine.close()
        del engine
        torch.cuda.empty_cache()
