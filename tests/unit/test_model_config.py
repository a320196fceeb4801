"""What the engine reads from a checkpoint's config.json, without a model: the architectures it
runs, each layer's sliding window, and what it refuses by name."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig, ModelPathError

BASE = {"architectures": ["MistralForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2}


def config(**changes: object) -> ModelConfig:
    return ModelConfig.from_hf_dict({**BASE, **changes})


def test_each_layers_window_from_the_config():
    assert config().layer_windows == ()
    assert config(sliding_window=32).layer_windows == (32,) * 4  # Mistral: every layer
    mixed = config(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2)
    assert mixed.layer_windows == (8, None, 8, None)
    qwen2 = config(architectures=["Qwen2ForCausalLM"], sliding_window=16,
                   use_sliding_window=True, max_window_layers=3)
    assert qwen2.layer_windows == (None, None, None, 16)
    off = config(architectures=["Qwen2ForCausalLM"], sliding_window=16)  # not used
    assert off.layer_windows == () and off.sliding_window is None


def test_what_is_not_supported_is_named():
    with pytest.raises(ModelPathError, match="unsupported layer_types \\['chunked_attention'\\]"):
        config(sliding_window=8, layer_types=["chunked_attention"] * 4)
    with pytest.raises(ModelPathError, match="layer_types lists 2 layers, the model has 4"):
        config(sliding_window=8, layer_types=["full_attention"] * 2)
    with pytest.raises(ModelPathError, match="unsupported architecture 'GemmaForCausalLM'.*"
                                             "Qwen3ForCausalLM, Phi3ForCausalLM"):
        config(architectures=["GemmaForCausalLM"])
    assert config(architectures=["Qwen3ForCausalLM"]).qk_norm
    assert config(architectures=["Phi3ForCausalLM"]).fused_checkpoint
