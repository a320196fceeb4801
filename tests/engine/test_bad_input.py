"""Every bad-input class is a ValueError naming the field and its limit; the engine is unchanged."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, ModelPathError, SchedulerConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.request import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    # 20 blocks of 16 tokens = 320 tokens of KV; the model's context is 2048.
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                  cache=CacheConfig(num_blocks=20)))


def snapshot(engine: LLMEngine) -> tuple:
    s = engine.scheduler
    return (len(s.waiting), len(s.running), len(s.requests), engine.block_manager.num_free_blocks)


@pytest.mark.parametrize(
    ("prompt", "params", "expected"),
    [
        ("", SamplingParams(), "prompt must not be empty"),
        ([], SamplingParams(), "prompt must not be empty"),
        ([1, 2, 49152], SamplingParams(), "outside the vocabulary [0, 49152)"),
        ([1, -1], SamplingParams(), "outside the vocabulary [0, 49152)"),
        ([5] * 200, SamplingParams(max_tokens=1900), "exceeds max_model_len 2048"),
        ([5] * 300, SamplingParams(max_tokens=30), "whole KV cache holds 20"),
        ([5] * 10, SamplingParams(stop_token_ids=(60000,)), "stop_token_ids contains 60000"),
        ([5] * 10, {"max_tokens": 3}, "params must be SamplingParams"),
    ],
)
def test_bad_request_is_rejected_and_leaves_engine_unchanged(engine, prompt, params, expected):
    engine.add_request([7, 8, 9], SamplingParams(max_tokens=4))  # something in flight
    engine.step()
    before = snapshot(engine)
    with pytest.raises(ValueError) as err:
        engine.add_request(prompt, params)
    assert expected in str(err.value)
    assert snapshot(engine) == before
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.usage().used == 0


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.01}, "top_p must be in (0, 1]"),
        ({"top_k": 0}, "top_k must be -1 (disabled) or >= 1"),
        ({"top_k": -5}, "top_k must be -1 (disabled) or >= 1"),
    ],
)
def test_bad_sampling_parameters(kwargs, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_a_bad_prompt_in_a_batch_rejects_the_whole_batch(tiny_llama_dir):
    llm = LLM(config=EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                  cache=CacheConfig(num_blocks=20)))
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([[1, 2, 3], [4, 5], []], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == 20


def test_duplicate_request_id(engine):
    engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="dup")
    engine.abort("dup")


def test_bad_model_paths(tmp_path, tiny_llama_dir):
    with pytest.raises(ModelPathError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))
    with pytest.raises(ModelPathError, match="no config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelPathError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_bad_engine_configuration():
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        EngineConfig(dtype="float16")
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be >= max_num_seqs"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16)
    with pytest.raises(ValueError, match="block_size must be one of"):
        CacheConfig(block_size=12)
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction must be in \(0, 0.95\]"):
        CacheConfig(kv_cache_memory_fraction=1.5)
