"""Tensor parallelism in one engine (engine.tensor_parallel, engine.tp_ranks): what each rank holds,
and TP 2 (two processes over gloo) against TP 1 — greedy float32 output token-identical with
chunked prefill, preemption, prefix hits and forked samples, every block back — and a rank that
dies taking the engine down at once rather than hanging it."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams
from engine.tensor_parallel import ShardPlan


def plan(heads: int, kv: int, size: int, vocab: int = 100) -> list[ShardPlan]:
    return [ShardPlan.of(heads, kv, 64, vocab, r, size) for r in range(size)]


def test_heads_split_by_kv_group_even_uneven_and_replicated():
    even = plan(4, 2, 2)
    assert [(p.q_heads, p.kv_heads) for p in even] == [(range(0, 2), range(0, 1)),
                                                       (range(2, 4), range(1, 2))]
    uneven = plan(9, 3, 2)  # the default model: 3 KV heads over 2 ranks
    assert [(p.q_heads, p.kv_heads) for p in uneven] == [(range(0, 3), range(0, 1)),
                                                         (range(3, 9), range(1, 3))]
    shared = plan(8, 2, 4)  # fewer KV heads than ranks: each KV head on two ranks
    assert [(p.q_heads, p.kv_heads) for p in shared] == [
        (range(0, 2), range(0, 1)), (range(2, 4), range(0, 1)),
        (range(4, 6), range(1, 2)), (range(6, 8), range(1, 2))]
    with pytest.raises(ValueError, match="cannot split 6 query heads over 1 KV heads"):
        plan(6, 1, 4)
    vocab = plan(6, 3, 3, vocab=10)
    assert [p.vocab for p in vocab] == [range(0, 4), range(4, 8), range(8, 10)]
    assert {p.vocab_shard for p in vocab} == {4}
    assert [p.intermediate for p in plan(4, 4, 3)] == [range(0, 21), range(21, 42),
                                                       range(42, 64)]


def make(model_dir, size: int, num_blocks: int = 256) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir), dtype="float32", tensor_parallel_size=size,
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=8,
                                  prefill_chunk_size=16)))


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 10
           ) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"r{i}")
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert engine.block_manager.usage().used == 0, "a block leaked"
    return done


@pytest.fixture(scope="module")
def prompts(workload_prompts) -> list[list[int]]:
    """Mixed lengths, two sharing a 48-token prefix (prefix hits on the second pass)."""
    base = workload_prompts[7][:48]
    return [workload_prompts[i][:n] for i, n in ((1, 5), (2, 70), (3, 33), (4, 120))] + \
        [base + workload_prompts[5][:9], base + workload_prompts[6][:20]]


@pytest.mark.parametrize("num_blocks", [256, 14])  # 14 blocks: requests are preempted
def test_tp2_greedy_equals_tp1_on_the_tiny_llama(tiny_llama_dir, prompts, num_blocks):
    one = make(tiny_llama_dir, 1, num_blocks)
    two = make(tiny_llama_dir, 2, num_blocks)
    try:
        for _ in range(2):  # the second pass hits the prefix cache
            assert greedy(two, prompts) == greedy(one, prompts)
        assert two.block_manager.prefix_hits > 0
        if num_blocks == 14:
            assert two.scheduler.num_preemptions > 0
    finally:
        two.close()


def test_tp2_greedy_equals_tp1_on_the_default_model_and_forks_copy_on_every_rank(
        default_model_dir, prompts):
    """SmolLM2 has 9 query heads over 3 KV heads: rank 0 holds 1 KV head, rank 1 holds 2."""
    one = make(default_model_dir, 1)
    two = make(default_model_dir, 2)
    try:
        assert greedy(two, prompts[:4]) == greedy(one, prompts[:4])
        forked = {}
        for engine in (one, two):
            leader = engine.new_request(prompts[2], SamplingParams(temperature=0, max_tokens=6),
                                        "lead")
            leader.forks_expected = 1
            engine.scheduler.add(leader)
            while not leader.output_token_ids:
                engine.step()
            assert engine.fork(engine.new_request(prompts[2], SamplingParams(
                temperature=0, max_tokens=6), "fork"), "lead")
            outs = {}
            while engine.has_unfinished_requests():
                outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            forked[engine is two] = outs
        assert forked[True] == forked[False] and forked[True]["fork"] == forked[True]["lead"]
    finally:
        two.close()


def test_a_dead_rank_fails_the_engine_at_once(tiny_llama_dir, prompts):
    engine = make(tiny_llama_dir, 2)
    try:
        greedy(engine, prompts[:1], max_tokens=2)
        rank = engine.runner.ranks._procs[0].proc
        rank.kill()
        rank.join(10)
        engine.add_request(prompts[1], SamplingParams(max_tokens=3), request_id="after")
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 is gone"):
            engine.step()
    finally:
        engine.close()


def test_what_tensor_parallelism_does_not_support_yet_is_refused():
    for bad in (dict(tensor_parallel_size=0), dict(tensor_parallel_size=2, device="cuda"),
                dict(tensor_parallel_size=2, async_scheduling=True)):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineConfig(**bad)


def test_workers_and_launch_take_tensor_parallel_per_role():
    from cli.cluster import _parser, launch_spec
    from launch.cluster import ClusterSpec, LocalCluster
    from serving.options import WorkerOptions, parse_worker_args

    options = parse_worker_args("decode", ["--router", "h:1", "--colocated", "-tp", "2"])
    assert options.role == "colocated" and options.tensor_parallel_size == 2
    for role in ("prefill", "decode"):
        assert WorkerOptions(role=role, router="h:1", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="CPU ranks without --async-scheduling"):
        WorkerOptions(role="colocated", router="h:1", tensor_parallel_size=2,
                      async_scheduling=True)
    assert ClusterSpec(prefill=0, decode=0, colocated=1, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--prefill-tp and --decode-tp are for prefill"):
        ClusterSpec(prefill=0, decode=0, colocated=1, decode_tp=2)
    with pytest.raises(ValueError, match="--decode-tp must be >= 1, got 0"):
        ClusterSpec(decode_tp=0)
    spec = launch_spec(_parser().parse_args(["launch", "-tp", "2", "--decode-tp", "1"]))
    assert [spec.tp_for(role) for role in ("prefill", "decode")] == [2, 1]
    worker_args = {role: LocalCluster(spec).worker_command(role)[1]
                   for role in ("prefill", "decode")}
    assert "--tensor-parallel-size" not in worker_args["decode"]
    prefill = worker_args["prefill"]
    assert prefill[prefill.index("--tensor-parallel-size") + 1] == "2"
