"""A model whose every layer slides (Mistral with a sliding window) lets go of the KV blocks every
window has passed while its requests decode: the engine's greedy output still equals
transformers', with and without async scheduling, fewer blocks are held (requests that would
preempt each other fit), and a model with any full-attention layer keeps every block."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from tests.conftest import save_tiny_model
from tests.engine.hf_reference import engine_greedy, hf_greedy

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, default_model_dir):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-mistral-w16"), "MistralForCausalLM",
                           default_model_dir, seed=7, sliding_window=16)


@pytest.fixture(scope="module")
def prompts(workload_prompts) -> list[list[int]]:
    return [p[:n] for p, n in zip(workload_prompts, (40, 55, 70, 23))]


def run(model_dir, prompts: list[list[int]], release: bool, async_scheduling: bool = False
        ) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), dtype="float32", async_scheduling=async_scheduling,
        cache=CacheConfig(block_size=16, num_blocks=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4,
                                  release_passed_blocks=release)))
    outputs = engine_greedy(engine, prompts, MAX_TOKENS)
    assert engine.block_manager.usage().used == 0
    return outputs, engine


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_released_blocks_change_no_token(mistral_dir, prompts, async_scheduling):
    expected = hf_greedy(mistral_dir, prompts, MAX_TOKENS)
    released, engine = run(mistral_dir, prompts, True, async_scheduling)
    assert released == expected
    assert engine.block_manager.released_early > 0
    kept, whole = run(mistral_dir, prompts, False, async_scheduling)
    assert kept == expected and whole.block_manager.released_early == 0
    # 16 blocks of 16 tokens for 4 requests reaching 71..118 tokens: holding every block they
    # preempt each other; letting go of the passed ones they need not
    assert whole.scheduler.num_preemptions > engine.scheduler.num_preemptions


def test_a_model_with_a_full_attention_layer_keeps_every_block(tmp_path, default_model_dir,
                                                               prompts):
    mixed = save_tiny_model(tmp_path / "qwen2-mixed", "Qwen2ForCausalLM", default_model_dir,
                            seed=7, use_sliding_window=True, sliding_window=16,
                            max_window_layers=1)
    _, engine = run(mixed, prompts[:2], True)
    assert engine.model_config.release_window is None
    assert engine.block_manager.released_early == 0
