"""Prompt logprobs (SamplingParams.prompt_logprobs): every prompt token's log-probability given
the tokens before it, plus the top k, equal to transformers' log-softmax over the prompt in
float32 — in one step, in chunks of 16, for a prompt whose prefix is cached (it is computed, not
served from the cache), under preemption and under async scheduling."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def compute(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)

    return compute


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, request_id=str(i))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return done


def check(prompt: list[int], got: list, k: int, reference: torch.Tensor) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        row = reference[p - 1]
        entry = got[p]
        assert abs(entry[prompt[p]] - row[prompt[p]].item()) < 1e-4, p
        top = row.topk(k).indices.tolist()
        assert set(entry) == set(top) | {prompt[p]}, p
        for token, value in entry.items():
            assert abs(value - row[token].item()) < 1e-4


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_equal_transformers(tiny_llama_dir, workload_prompts, hf_logprobs, chunk):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                    cache=CacheConfig(num_blocks=128),
                                    scheduler=SchedulerConfig(prefill_chunk_size=chunk)))
    prompts = [workload_prompts[0][:70], workload_prompts[1][:9], workload_prompts[2][:1]]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k, ignore_eos=True)
              for k in (2, 0, 5)]
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    done = run(engine, prompts + [workload_prompts[3][:40]], params + [plain])
    for i, prompt in enumerate(prompts):
        check(prompt, done[str(i)].prompt_logprobs, params[i].prompt_logprobs,
              hf_logprobs(prompt))
    assert done["3"].prompt_logprobs is None
    # A prompt whose first 64 tokens are now cached computes them again for their logprobs.
    again = run(engine, [prompts[0]], [params[0]])["0"]
    assert again.num_cached_tokens == 0
    check(prompts[0], again.prompt_logprobs, 2, hf_logprobs(prompts[0]))
    assert run(engine, [prompts[0]], [plain])["0"].num_cached_tokens == 64


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_under_preemption_and_async_scheduling(tiny_llama_dir, workload_prompts,
                                                               hf_logprobs, async_scheduling):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                    async_scheduling=async_scheduling,
                                    cache=CacheConfig(num_blocks=5),
                                    scheduler=SchedulerConfig(max_num_seqs=2,
                                                              prefill_chunk_size=16)))
    prompts = [workload_prompts[4][:30], workload_prompts[5][:40], workload_prompts[6][:20]]
    params = [SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=1, ignore_eos=True)
              for _ in prompts]
    done = run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        check(prompt, done[str(i)].prompt_logprobs, 1, hf_logprobs(prompt))
