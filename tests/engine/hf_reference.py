"""Greedy reference outputs from transformers `generate`, one prompt at a time (no padding)."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
              attn_implementation: str | None = None) -> list[list[int]]:
    """`attn_implementation` "eager" for models whose SDPA path drops a feature (Gemma 2's
    attention soft-capping)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation).eval()
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=2)
            outputs.append(out[0, len(ids):].tolist())
    return outputs
