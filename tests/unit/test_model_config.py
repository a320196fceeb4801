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


def test_which_layers_are_mixtures_of_experts():
    mixtral = config(architectures=["MixtralForCausalLM"], num_local_experts=8,
                     num_experts_per_tok=2)
    assert mixtral.moe.num_experts == 8 and mixtral.moe.normalize_top_k
    assert mixtral.moe_layers == (True,) * 4
    qwen3 = config(architectures=["Qwen3MoeForCausalLM"], num_experts=16, num_experts_per_tok=4,
                   moe_intermediate_size=32, mlp_only_layers=[0], decoder_sparse_step=1)
    assert qwen3.moe_layers == (False, True, True, True) and not qwen3.moe.normalize_top_k
    assert qwen3.moe.intermediate_size == 32 and qwen3.qk_norm
    qwen2 = config(architectures=["Qwen2MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16, shared_expert_intermediate_size=24)
    assert qwen2.moe.shared_intermediate_size == 24 and qwen2.attention_bias  # qkv_bias: True
    assert qwen3.moe.shared_intermediate_size == 0
    assert not config(architectures=["Qwen2MoeForCausalLM"], num_experts=4, qkv_bias=False,
                      num_experts_per_tok=2, moe_intermediate_size=16).attention_bias
    every_other = config(architectures=["Qwen3MoeForCausalLM"], num_local_experts=4,
                         num_experts_per_tok=1, moe_intermediate_size=8, decoder_sparse_step=2)
    assert every_other.moe_layers == (False, True, False, True)
    with pytest.raises(ValueError, match="experts per token must be in \\[1, 4\\], got 5"):
        config(architectures=["MixtralForCausalLM"], num_local_experts=4,
               num_experts_per_tok=5)
