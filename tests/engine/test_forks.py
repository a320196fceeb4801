"""Samples of one prompt fork from the first one's KV (engine.forks): they share its blocks, copy
the one its prompt ends in, and compute only the prompt's last position. Their outputs must be
those of the same requests run on their own, and every block must come back."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams

BLOCK = 16


def make_engine(model_dir, async_scheduling: bool = False, num_blocks: int = 64) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir), dtype="float32", async_scheduling=async_scheduling,
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16,
                                  prefill_chunk_size=32)))


def samples(base: SamplingParams, n: int) -> list[SamplingParams]:
    """Sample j draws with seed + j, as the router's choices do."""
    return [dataclasses.replace(base, seed=None if base.seed is None else base.seed + j)
            for j in range(n)]


def run_forked(engine: LLMEngine, prompt: list[int], params: list[SamplingParams],
               late: bool = False) -> tuple[dict[str, list[int]], list[bool], int]:
    """Sample 0 computes the prompt; the others fork once its first token exists (`late`: after
    it finished). Returns each sample's tokens, whether each forked, and the most blocks used."""
    leader = engine.new_request(prompt, params[0], "s0")
    leader.forks_expected = len(params) - 1
    engine.scheduler.add(leader)
    waiting = [engine.new_request(prompt, p, f"s{j}") for j, p in enumerate(params) if j]
    forked: list[bool] = [False]
    tokens: dict[str, list[int]] = {}
    most_used = 0
    while engine.has_unfinished_requests() or waiting:
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        ready = leader.output_token_ids and (not late or leader.is_finished)
        while ready and waiting:
            forked.append(engine.fork(waiting.pop(0), "s0"))
        bm = engine.block_manager
        bm.check_integrity(engine.scheduler.block_holders())
        most_used = max(most_used, bm.usage().used)
    return tokens, forked, most_used


def run_alone(engine: LLMEngine, prompt: list[int], params: list[SamplingParams]
              ) -> dict[str, list[int]]:
    tokens = {}
    for j, p in enumerate(params):
        engine.add_request(prompt, p, request_id=f"s{j}")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
    return tokens


@pytest.mark.parametrize("prompt_len", [1, 16, 37])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_forked_samples_match_samples_run_alone(tiny_llama_dir, workload_prompts, prompt_len,
                                                async_scheduling):
    prompt = workload_prompts[3][:prompt_len]
    assert len(prompt) == prompt_len
    for base in (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                 SamplingParams(temperature=1.0, top_k=40, seed=7, max_tokens=12,
                                ignore_eos=True)):
        params = samples(base, 4)
        engine = make_engine(tiny_llama_dir, async_scheduling)
        forked_tokens, forked, _ = run_forked(engine, prompt, params)
        assert forked == [False, True, True, True]
        assert engine.scheduler.forks.num_forked == 3 and not engine.scheduler.forks
        bm = engine.block_manager
        assert bm.usage().used == 0, "a block leaked"
        assert forked_tokens == run_alone(make_engine(tiny_llama_dir, async_scheduling), prompt,
                                          params)
        if base.seed is not None:  # the seeds differ, so the samples do
            assert len({tuple(t) for t in forked_tokens.values()}) > 1


def test_forks_share_the_prompt_blocks(tiny_llama_dir, workload_prompts):
    """Four samples of a 100-token prompt (7 blocks, the last partial) hold 6 shared blocks and
    one block of their own each, not 7 each."""
    prompt = workload_prompts[5][:100]
    params = samples(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), 4)
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    _, forked, most_used = run_forked(engine, prompt, params)
    assert forked == [False, True, True, True]
    # 6 shared + 4 x 1 own (+ the source's hold on the leader's last block, if it was copied
    # while the leader still ran, it is the leader's own)
    assert most_used <= 6 + 4 + 1
    assert engine.block_manager.usage().used == 0


def test_a_sample_forks_after_its_source_finished(tiny_llama_dir, workload_prompts):
    """max_tokens 1: the first sample ends at its first token; its prompt's blocks are held
    for the others all the same."""
    prompt = workload_prompts[2][:40]
    params = samples(SamplingParams(temperature=1.0, seed=3, max_tokens=1), 3)
    engine = make_engine(tiny_llama_dir)
    tokens, forked, _ = run_forked(engine, prompt, params, late=True)
    assert forked == [False, True, True]
    assert tokens == run_alone(make_engine(tiny_llama_dir), prompt, params)
    assert engine.block_manager.usage().used == 0


def test_no_source_means_no_fork(tiny_llama_dir, workload_prompts):
    engine = make_engine(tiny_llama_dir)
    prompt = workload_prompts[1][:20]
    request = engine.new_request(prompt, SamplingParams(max_tokens=2), "x")
    assert engine.fork(request, "nobody") is False
    assert not request.block_ids and request.num_computed_tokens == 0
    # a source of another prompt does not serve it either
    other = engine.new_request(workload_prompts[2][:20], SamplingParams(max_tokens=2), "o")
    other.forks_expected = 1
    engine.scheduler.add(other)
    while not other.output_token_ids:
        engine.step()
    assert engine.fork(request, "o") is False
    engine.scheduler.add(request)  # what the caller does then: a request of its own
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.scheduler.forks) == 1  # still held for its fork, until its lease
    engine.scheduler.forks.release_all()
    assert engine.block_manager.usage().used == 0


def test_held_prompts_give_way_to_running_requests(tiny_llama_dir, workload_prompts):
    """A source whose fork never comes does not starve the cache: when blocks run out, sources
    are given up before any running request is preempted."""
    engine = make_engine(tiny_llama_dir, num_blocks=12)
    source = engine.new_request(workload_prompts[4][:90], SamplingParams(max_tokens=1), "src")
    source.forks_expected = 1
    engine.scheduler.add(source)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.scheduler.forks) == 1 and engine.block_manager.usage().used == 6
    engine.add_request(workload_prompts[6][:100], SamplingParams(max_tokens=60, ignore_eos=True,
                                                                 temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
        engine.block_manager.check_integrity(engine.scheduler.block_holders())
    assert len(engine.scheduler.forks) == 0 and engine.scheduler.num_preemptions == 0
    assert engine.block_manager.usage().used == 0
