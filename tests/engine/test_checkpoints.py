"""`--model PATH` takes any local Llama / Qwen2 / Qwen3 / Phi-3 / Mistral safetensors checkpoint:
sharded or not, tied or untied embeddings, attention bias, rope scaling, q/k norms, fused qkv and
gate/up weights. Greedy output matches transformers."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm import LLM
from engine.loader import safetensors_files
from engine.request import SamplingParams
from tests.conftest import mixed_prompts, save_tiny_model
from tests.engine.hf_reference import hf_greedy

VARIANTS = {
    "qwen2-bias-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "mistral-untied": ("MistralForCausalLM", {"tie_word_embeddings": False, "head_dim": 32,
                                              "sliding_window": None}),
    "llama-sharded": ("LlamaForCausalLM", {"max_shard_size": "2MB"}),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
    "qwen3-untied-tp": ("Qwen3ForCausalLM", {"tie_word_embeddings": False}),
    "phi3-fused": ("Phi3ForCausalLM", {"pad_token_id": 0}),
    "llama3-rope-bias": ("LlamaForCausalLM", {
        "attention_bias": True, "num_key_value_heads": 1,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_variant_matches_transformers(variant, tmp_path, default_model_dir,
                                                 workload_prompts):
    arch, overrides = VARIANTS[variant]
    model_dir = save_tiny_model(tmp_path, arch, default_model_dir, seed=3, **overrides)
    if variant == "llama-sharded":
        assert len(safetensors_files(model_dir)) > 1
    prompts = mixed_prompts(workload_prompts, 20)[::4]  # 5 prompts, 3 to 300 tokens
    expected = hf_greedy(model_dir, prompts, 8)
    llm = LLM(config=EngineConfig(model=str(model_dir), dtype="float32",
                                  cache=CacheConfig(num_blocks=256)))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [o.token_ids for o in outputs] == expected


def test_bfloat16_runs_and_mostly_agrees_with_float32(tiny_llama_dir, workload_prompts):
    prompts = mixed_prompts(workload_prompts, 6)
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(config=EngineConfig(model=str(tiny_llama_dir), dtype=dtype,
                                      cache=CacheConfig(num_blocks=128)))
        outs[dtype] = [o.token_ids[0] for o in llm.generate(prompts, params)]
    same = sum(a == b for a, b in zip(outs["float32"], outs["bfloat16"]))
    assert same >= 4  # bf16 rounding may flip a near tie, not most first tokens


@pytest.mark.parametrize("change, refusal", [
    ({"rope_type": "yarn"}, "unsupported rope_type 'yarn'"),
    ({"rope_type": "longrope"}, "longrope needs short_factor and long_factor of 8 values"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
])
def test_what_the_engine_cannot_run_is_refused_at_load(change, refusal, tmp_path,
                                                       default_model_dir):
    import json

    model_dir = save_tiny_model(tmp_path, "Phi3ForCausalLM", default_model_dir, pad_token_id=0)
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["rope_parameters"] = {**config.get("rope_parameters", {}), **change}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=refusal):
        LLM(config=EngineConfig(model=str(model_dir), dtype="float32",
                                cache=CacheConfig(num_blocks=16)))
