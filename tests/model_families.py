"""The tiny random checkpoints of every model family beyond Llama that the family tests build
(tests/cluster/test_model_families.py on CPU, tests/gpu/test_families_on_cuda.py on CUDA), and the
prompts they run: one table, so both prove the same models. tests/conftest.py builds them as the
fixtures `family_dir` (one per family), `family_prompt_ids` and `family_expected`."""

from __future__ import annotations

MAX_TOKENS = 8  # greedy tokens per prompt

# Sliding windows of 24 keys against prompts of up to 80 tokens: chunks, decodes and prefix hits
# all cross a window's edge (Mistral: every layer; Qwen2: layer 1 of 2, from max_window_layers).
FAMILIES = {"qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
            "phi3": ("Phi3ForCausalLM", {"pad_token_id": 0}),
            "mistral-sliding": ("MistralForCausalLM", {"sliding_window": 24}),
            "qwen2-mixed-sliding": ("Qwen2ForCausalLM", {"use_sliding_window": True,
                                                         "sliding_window": 24,
                                                         "max_window_layers": 1}),
            # Mixtures of experts: 4 experts, 2 per token (Qwen3-MoE: layer 0 dense)
            "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4,
                                               "num_experts_per_tok": 2}),
            "qwen3-moe": ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 48,
                                                  "norm_topk_prob": True, "head_dim": 32,
                                                  "mlp_only_layers": [0]}),
            # Qwen2-MoE: a shared expert beside the routed ones, its sigmoid gate; q/k/v bias;
            # the top k not renormalised
            "qwen2-moe": ("Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 48,
                                                  "shared_expert_intermediate_size": 64,
                                                  "mlp_only_layers": [0]}),
            # Gemma 3: sandwich norms, GELU-tanh, scaled embeddings, q/k norms, a sliding layer
            # with its own RoPE base and a global one, soft-capped logits
            "gemma3": ("Gemma3ForCausalLM", {"head_dim": 32, "query_pre_attn_scalar": 24,
                                             "sliding_window": 24,
                                             "layer_types": ["sliding_attention",
                                                             "full_attention"],
                                             "final_logit_softcapping": 30.0}),
            # Gemma 2: the same, no q/k norms, one RoPE, attention scores soft-capped (a cap of
            # 5 so the random scores reach the tanh's bend)
            "gemma2": ("Gemma2ForCausalLM", {"head_dim": 32, "query_pre_attn_scalar": 24,
                                             "sliding_window": 24,
                                             "layer_types": ["sliding_attention",
                                                             "full_attention"],
                                             "attn_logit_softcapping": 5.0,
                                             "final_logit_softcapping": 30.0})}


def family_prompts(workload_prompts: list[list[int]]) -> list[list[int]]:
    """Mixed lengths, and two sharing a 64-token prefix (a prefix hit for the second)."""
    from tests.conftest import mixed_prompts  # (tests.conftest imports this module)

    shared = workload_prompts[8][:64]
    return mixed_prompts(workload_prompts, 12)[::2] + [shared + [11, 12, 13],
                                                       shared + [21, 22]]
