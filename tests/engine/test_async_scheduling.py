"""Async scheduling in the engine (EngineConfig.async_scheduling): step N+1 is scheduled and
launched before step N is read, its pending tokens taken from step N's samples on the device.
Outputs must be exactly the synchronous engine's, and every block must come back."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams

# On CUDA where present (and then part of `pytest -m gpu`: tests/conftest.py).
RUNS_ON_CUDA = True
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
        abort_after: dict[str, int] | None = None) -> dict[str, tuple]:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, request_id=str(i))
    done: dict[str, tuple] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort(rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.text, out.finish_reason,
                                        out.logprobs)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a block leaked"
    return done


def pair(model_dir, **config: object) -> dict[bool, LLMEngine]:
    return {on: LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device=DEVICE,
                                       async_scheduling=on, **config))
            for on in (False, True)}


def assert_same(a: dict[str, tuple], b: dict[str, tuple]) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        (ids_a, text_a, reason_a, lp_a), (ids_b, text_b, reason_b, lp_b) = a[rid], b[rid]
        assert (ids_a, text_a, reason_a) == (ids_b, text_b, reason_b), rid
        if lp_a is not None:
            for x, y in zip(lp_a, lp_b):
                assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-5 for k in x)


def mixed_params(prompt_token: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[prompt_token]),
            SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=9, ignore_eos=True,
                           logprobs=3),
            SamplingParams(temperature=0, max_tokens=15, stop=[" the"], ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=10, seed=5, ignore_eos=True)]


def test_async_engine_outputs_equal_the_synchronous_ones(tiny_llama_dir, workload_prompts):
    """Greedy, a stop token met mid-run, a stop string, seeded sampling with logprobs, and
    requests of 1..15 tokens finishing at different steps (each leaves a step's row behind)."""
    # Two engines live at once: each gets a small cache (on CUDA the default takes 90% of it).
    engines = pair(tiny_llama_dir, cache=CacheConfig(kv_cache_gb=0.25))
    prompts = [workload_prompts[i][:n] for i, n in enumerate((5, 33, 17, 48, 9, 26))]
    sync_out = run(engines[False], prompts, mixed_params(prompts[2][0]))
    async_out = run(engines[True], prompts, mixed_params(prompts[2][0]))
    assert_same(sync_out, async_out)


def test_async_engine_under_preemption_prefix_hits_and_aborts(tiny_llama_dir, workload_prompts):
    """A cache too small for every request (preemption by recompute, with a token pending), a
    prompt shared by several requests (prefix hits on blocks keyed under async steps), and an
    abort while a step holding the request is in flight."""
    shared = workload_prompts[4][:40]
    prompts = [shared + [11], shared + [12], workload_prompts[5][:30], shared + [11, 13],
               workload_prompts[6][:20]]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    engines = pair(tiny_llama_dir, cache=CacheConfig(num_blocks=7),  # 2 at a time: later
                   scheduler=SchedulerConfig(max_num_seqs=2))  # prompts hit earlier blocks
    sync_out = run(engines[False], prompts, params, abort_after={"0": 4})
    async_out = run(engines[True], prompts, params, abort_after={"0": 4})
    assert "0" not in sync_out and "0" not in async_out and len(async_out) == 4
    assert_same(sync_out, async_out)
    assert engines[True].scheduler.num_preemptions > 0
    assert engines[True].block_manager.prefix_hits > 0


@pytest.mark.skipif(DEVICE == "cuda", reason="the CUDA-graph test covers this natively")
def test_async_steps_through_static_decode_buffers(tiny_llama_dir, workload_prompts):
    """Async scheduling with the decode-graph buffers (eager on CPU, Triton interpreter): the
    pending tokens are copied into the static token buffer on the device."""
    prompts = [workload_prompts[i][:n] for i, n in enumerate((7, 19, 30))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 6, 8)]
    engines = pair(tiny_llama_dir, attention_backend="triton")
    engines[True].runner.enable_decode_graphs(8, engines[True].max_model_len, capture=False,
                                              num_sms=132)
    sync_out = run(engines[False], prompts, params)
    async_out = run(engines[True], prompts, params)
    assert_same(sync_out, async_out)
    assert engines[True].runner.graphs.replays
