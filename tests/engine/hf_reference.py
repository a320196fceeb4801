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


def engine_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:  # noqa: ANN001 - an LLMEngine
    """The engine's greedy tokens for every prompt, all added at once and stepped to the end
    (what each family's test compares with `hf_greedy`)."""
    from engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]
