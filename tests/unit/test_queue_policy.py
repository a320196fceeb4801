"""The short_first prefill queue order (issue 16): fewest prompt tokens left first, an age bound so
nothing starves, preempted requests first, decodes before prefill chunks; fcfs unchanged. Plain
Python: the model-free driver of tests.unit.fakes, with a clock the test controls."""

from __future__ import annotations

import math
import random

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig, SchedulerConfig
from engine.request import FinishReason, Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerOutput
from serving.options import WorkerOptions, parse_worker_args
from tests.unit.fakes import expected_output, make_request, run_all, step


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_scheduler(clock: Clock, policy: str = "short_first", num_blocks: int = 64,
                   block_size: int = 4, budget: int = 32, max_seqs: int = 8,
                   chunk: int | None = None, age_bound: float = 4.0) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_model_len=4096, prefill_chunk_size=chunk, queue_policy=policy,
                             queue_age_bound_s=age_bound)
    return Scheduler(config, BlockManager(num_blocks, block_size, False), clock=clock)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [10 + (i * 7 + salt * 13) % 500 for i in range(n)]


def add(s: Scheduler, rid: str, n: int, arrival: float, max_tokens: int = 4) -> Request:
    r = make_request(rid, prompt(n, len(s.requests)), max_tokens)
    r.arrival_time = arrival
    s.add(r)
    return r


def order(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(x.request.request_id, x.num_tokens) for x in out.scheduled]


@pytest.mark.parametrize(("policy", "first"), [("short_first", "short"), ("fcfs", "long")])
def test_short_prompt_admitted_before_a_long_one_queued_earlier(policy, first):
    s = make_scheduler(Clock(2.0), policy, max_seqs=1)
    add(s, "long", 100, arrival=0.0)
    add(s, "short", 10, arrival=1.0)
    assert [rid for rid, _ in order(step(s))] == [first]


@pytest.mark.parametrize(("now", "first"), [
    (3.5, "mid"),  # nothing is over 4 s old: the shorter one
    (4.2, "old"),  # only "old" is overdue: it goes first despite its length
    (10.0, "old"),  # both overdue: the oldest first
])
def test_request_older_than_the_age_bound_goes_first_oldest_first(now, first):
    clock = Clock(3.0)
    s = make_scheduler(clock, max_seqs=1, age_bound=4.0)
    add(s, "old", 120, arrival=0.0)
    add(s, "mid", 100, arrival=0.5)
    short = add(s, "short", 10, arrival=2.0, max_tokens=1)
    assert order(step(s)) == [("short", 10)]
    assert short.is_finished
    clock.now = now
    assert order(step(s))[0][0] == first


def test_long_prompt_does_not_starve_behind_a_stream_of_short_ones():
    clock = Clock(0.0)
    s = make_scheduler(clock, max_seqs=1, budget=16, age_bound=4.0)
    long = add(s, "long", 40, arrival=0.0, max_tokens=1)
    for n in range(40):
        add(s, f"s{n}", 6, arrival=clock.now, max_tokens=1)
        step(s)
        if long.status is not RequestStatus.WAITING:
            break
        clock.now += 1.0
    assert long.status is not RequestStatus.WAITING and clock.now <= 5.0
    run_all(s)
    assert long.output_token_ids == expected_output(long.prompt_token_ids, 1)


def test_preempted_request_keeps_priority_over_shorter_prompts():
    s = make_scheduler(Clock(1.0), num_blocks=6, block_size=4, budget=64)
    old, new = add(s, "old", 8, 0.0, 12), add(s, "new", 8, 0.1, 12)
    step(s)  # both prefilled: 2 blocks each, 2 free
    later = add(s, "later", 4, 0.5, 2)
    preempted: list[Request] = []
    while not preempted:
        preempted = step(s).preempted
    assert preempted == [new] and s.waiting[0] is new
    admitted: list[str] = []
    while s.has_unfinished():
        for item in step(s).scheduled:
            if item.request is not old and item.request.request_id not in admitted:
                admitted.append(item.request.request_id)
    # "later" is shorter than the preempted "new", yet is admitted after it.
    assert admitted == ["new", "later"]
    assert new.output_token_ids == expected_output(new.prompt_token_ids, 12)
    assert later.output_token_ids == expected_output(later.prompt_token_ids, 2)


@pytest.mark.parametrize(("policy", "arriving", "expected"), [
    # A short prompt arriving during a long prefill takes the budget ahead of its remainder.
    ("short_first", [("short", 8), ("long", 4)], [("short", 2), ("long", 8)]),
    ("fcfs", [("long", 8), ("short", 4)], [("long", 8), ("short", 4)]),
])
def test_a_short_prompt_gets_budget_before_a_long_prefills_remainder(policy, arriving,
                                                                       expected):
    s = make_scheduler(Clock(1.0), policy, budget=12, chunk=8)
    add(s, "long", 40, arrival=0.0)
    assert order(step(s)) == [("long", 8)]
    add(s, "short", 10, arrival=0.5)
    assert order(step(s)) == arriving
    assert order(step(s)) == expected


def test_age_bound_applies_to_running_prefills():
    clock = Clock(1.0)
    s = make_scheduler(clock, budget=12, chunk=8, age_bound=4.0)
    add(s, "long", 40, arrival=0.0)
    step(s)
    add(s, "short", 10, arrival=0.5)
    assert order(step(s)) == [("short", 8), ("long", 4)]
    clock.now = 4.2  # long is 4.2 s old, short 3.7 s
    assert order(step(s)) == [("long", 8), ("short", 2)]


def test_decodes_are_scheduled_before_prefill_chunks_in_running_order():
    s = make_scheduler(Clock(1.0), budget=16, chunk=8, max_seqs=4)
    add(s, "long", 40, arrival=0.0, max_tokens=10)
    step(s)
    add(s, "d1", 3, arrival=0.2, max_tokens=10)
    add(s, "d2", 2, arrival=0.3, max_tokens=10)
    assert order(step(s)) == [("d2", 2), ("d1", 3), ("long", 8)]  # outranked by both
    # Running is [long, d2, d1]: both decodes first, in that order, then the prefill chunk.
    assert order(step(s)) == [("d2", 1), ("d1", 1), ("long", 8)]
    assert [r.request_id for r in s.running] == ["long", "d2", "d1"]  # not reordered


def test_victim_already_scheduled_this_step_is_unscheduled_and_refunded():
    # The decode "short" is scheduled before the older prefill "long"; when long needs a block,
    # the newest running request (short) gives way as with fcfs, and its step is withdrawn.
    s = make_scheduler(Clock(1.0), num_blocks=8, block_size=4, budget=12, chunk=8)
    long = add(s, "long", 28, arrival=0.0, max_tokens=2)
    step(s)
    short = add(s, "short", 3, arrival=0.5, max_tokens=10)
    assert order(step(s)) == [("short", 3), ("long", 8)]
    assert order(step(s)) == [("short", 1), ("long", 8)]
    out = step(s)  # short's decode takes the last block; long's last chunk needs one more
    assert out.preempted == [short] and order(out) == [("long", 4)]
    assert short.status is RequestStatus.WAITING and short.block_ids == []
    run_all(s)
    assert long.output_token_ids == expected_output(long.prompt_token_ids, 2)
    assert short.output_token_ids == expected_output(short.prompt_token_ids, 10)


@pytest.mark.parametrize("policy", ["short_first", "fcfs"])
def test_random_workload_keeps_outputs_and_integrity(policy):
    rng = random.Random(11)
    clock = Clock(0.0)
    s = make_scheduler(clock, policy, num_blocks=30, budget=24, max_seqs=6, chunk=10,
                       age_bound=3.0)
    expected = {}
    for n in range(150):
        r = add(s, f"q{n}", rng.randint(1, 40), arrival=clock.now, max_tokens=rng.randint(1, 10))
        expected[r.request_id] = (r, expected_output(r.prompt_token_ids, r.params.max_tokens))
        for _ in range(rng.randint(0, 3)):
            step(s)
            clock.now += 0.5
        if rng.random() < 0.15:
            s.abort(rng.choice(list(expected)))
    run_all(s)
    assert s.block_manager.usage().used == 0 and s.num_waiting == 0
    for r, exp in expected.values():
        if r.finish_reason is not FinishReason.ABORT:
            assert r.output_token_ids == exp


def test_scheduler_config_fields_are_validated():
    assert SchedulerConfig().queue_policy == "fcfs" and SchedulerConfig().queue_age_bound_s == 4.0
    assert EngineConfig().scheduler.queue_policy == "fcfs"  # the offline engine stays fcfs
    with pytest.raises(ValueError, match="queue_policy must be one of fcfs, short_first, got 'x'"):
        SchedulerConfig(queue_policy="x")
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="queue_age_bound_s must be > 0"):
            SchedulerConfig(queue_age_bound_s=bad)
    cuda = SchedulerConfig.for_device("cuda", queue_policy="short_first", queue_age_bound_s=2.0)
    assert (cuda.max_num_batched_tokens, cuda.queue_policy, cuda.queue_age_bound_s) == (
        8192, "short_first", 2.0)


def test_worker_flags_parse_validate_and_reach_the_scheduler_config(monkeypatch):
    import torch

    import serving.worker_main as worker_main

    default = parse_worker_args("prefill", ["--router", "h:1"])
    assert (default.queue_policy, default.queue_age_bound_s) == ("short_first", 4.0)
    options = parse_worker_args("prefill", ["--router", "h:1", "--queue-policy", "fcfs",
                                            "--queue-age-bound-s", "2.5"])
    assert (options.queue_policy, options.queue_age_bound_s) == ("fcfs", 2.5)
    with pytest.raises(SystemExit):
        parse_worker_args("prefill", ["--router", "h:1", "--queue-policy", "lifo"])
    with pytest.raises(ValueError, match="--queue-policy must be one of fcfs, short_first"):
        WorkerOptions(role="prefill", router="h:1", queue_policy="lifo")
    with pytest.raises(ValueError, match="queue_age_bound_s must be > 0, got 0"):
        WorkerOptions(role="prefill", router="h:1", queue_age_bound_s=0)
    monkeypatch.setattr(worker_main, "LLMEngine", lambda config, launcher=None: config)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    config = worker_main.build_engine(options)
    assert (config.scheduler.queue_policy, config.scheduler.queue_age_bound_s) == ("fcfs", 2.5)


def test_a_colocated_cpu_worker_takes_vllm_serves_cpu_step_budget(monkeypatch):
    import torch

    import serving.worker_main as worker_main

    def budget(role: str, *extra: str) -> int | None:
        return parse_worker_args(role, ["--router", "h:1", *extra]).step_budget

    assert budget("colocated") == 2048
    assert budget("colocated", "--device", "cuda") is None  # the engine's CUDA default
    assert budget("prefill") is None and budget("decode") is None  # the engine's 512
    assert budget("colocated", "--max-num-batched-tokens", "512") == 512
    monkeypatch.setattr(worker_main, "LLMEngine", lambda config, launcher=None: config)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    for role, expected in (("colocated", 2048), ("decode", 512), ("prefill", 512)):
        options = parse_worker_args(role, ["--router", "h:1"])
        config = worker_main.build_engine(options)
        assert config.scheduler.max_num_batched_tokens == expected


def test_a_decode_worker_prefills_in_small_chunks_unless_told_otherwise(capsys):
    def chunk(role: str, *extra: str) -> int | None:
        return parse_worker_args(role, ["--router", "h:1", *extra]).chunk_size

    assert chunk("decode") == 32 and chunk("decode", "--device", "cuda") == 512
    assert chunk("prefill") is None  # the whole step budget
    assert chunk("decode", "--prefill-chunk-size", "64") == 64
    with pytest.raises(SystemExit):  # a usage error, not a traceback
        chunk("decode", "--prefill-chunk-size", "0")
    assert "--prefill-chunk-size must be >= 1" in capsys.readouterr().err
