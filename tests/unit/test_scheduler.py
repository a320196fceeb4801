from __future__ import annotations

import random

from engine.request import FinishReason, RequestStatus
from tests.unit.fakes import (
    expected_output,
    fake_execute,
    make_request,
    make_scheduler,
    run_all,
    step,
)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [10 + (i * 7 + salt * 13) % 500 for i in range(n)]


def test_budget_and_max_seqs_respected_every_step():
    s = make_scheduler(num_blocks=256, budget=24, max_seqs=3)
    reqs = [make_request(f"r{i}", prompt(5 + 9 * i, i), max_tokens=6) for i in range(8)]
    for r in reqs:
        s.add(r)
    for out in run_all(s):
        assert out.num_batched_tokens <= 24
        assert len(out.scheduled) <= 3
        assert s.num_running <= 3
    for i, r in enumerate(reqs):
        assert r.output_token_ids == expected_output(prompt(5 + 9 * i, i), 6)
        assert r.finish_reason is FinishReason.LENGTH


def test_chunked_prefill_splits_prompt_and_samples_only_at_the_end():
    s = make_scheduler(num_blocks=64, budget=32, chunk=16)
    r = make_request("a", prompt(50), max_tokens=3)
    s.add(r)
    chunks = []
    for _ in range(4):
        out = step(s)
        (item,) = out.scheduled
        chunks.append((item.start, item.num_tokens, item.samples))
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]
    assert len(r.output_token_ids) == 1
    run_all(s)
    assert r.output_token_ids == expected_output(prompt(50), 3)


def test_running_decodes_are_scheduled_before_new_prefills():
    s = make_scheduler(num_blocks=128, budget=20, max_seqs=8)
    first = [make_request(f"d{i}", prompt(6, i), max_tokens=20) for i in range(3)]
    for r in first:
        s.add(r)
    step(s)  # prefill all three (18 tokens)
    s.add(make_request("long", prompt(100, 9), max_tokens=2))
    out = step(s)
    assert [x.request.request_id for x in out.scheduled[:3]] == ["d0", "d1", "d2"]
    assert all(x.num_tokens == 1 for x in out.scheduled[:3])
    assert out.scheduled[3].request.request_id == "long"
    assert out.scheduled[3].num_tokens == 17  # what the budget left
    run_all(s)


def test_new_request_admitted_as_soon_as_blocks_free():
    # 4 blocks of 4 tokens. a (9 prompt tokens, 4 outputs) holds 3 blocks; b needs 3 to start.
    s = make_scheduler(num_blocks=4, block_size=4, budget=32, prefix_caching=False)
    a, b = make_request("a", prompt(9, 1), max_tokens=4), make_request("b", prompt(9, 2), 4)
    s.add(a)
    s.add(b)
    for _ in range(4):
        out = step(s)
        assert [x.request for x in out.scheduled] == [a]
        assert b.status is RequestStatus.WAITING
    assert a.is_finished and s.block_manager.num_free_blocks == 4
    out = step(s)  # the very next step admits b
    assert [x.request for x in out.scheduled] == [b] and b.status is RequestStatus.RUNNING
    run_all(s)
    assert b.output_token_ids == expected_output(prompt(9, 2), 4)


def test_finished_requests_free_blocks_in_the_same_step():
    s = make_scheduler(num_blocks=32, prefix_caching=False)
    r = make_request("a", prompt(7), max_tokens=1)
    s.add(r)
    step(s)
    assert r.is_finished and r.block_ids == []
    assert s.block_manager.num_free_blocks == 32


def test_preemption_by_recompute_keeps_outputs_identical():
    s = make_scheduler(num_blocks=12, block_size=4, budget=64, max_seqs=8)
    reqs = [make_request(f"r{i}", prompt(10, i), max_tokens=14) for i in range(5)]
    for r in reqs:
        s.add(r)
    run_all(s)
    assert s.num_preemptions > 0
    for i, r in enumerate(reqs):
        assert r.output_token_ids == expected_output(prompt(10, i), 14)
    assert s.block_manager.num_free_blocks == 12


def test_preempted_request_is_the_newest_and_goes_to_the_front():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, prefix_caching=False)
    old, new = make_request("old", prompt(8, 1), 12), make_request("new", prompt(8, 2), 12)
    s.add(old)
    s.add(new)
    step(s)  # both prefilled: 2 blocks each, 2 free
    s.add(make_request("later", prompt(4, 3), 2))
    preempted = []
    while not preempted:
        preempted = step(s).preempted
    assert preempted[0] is new
    assert s.waiting[0] is new and new.num_computed_tokens == 0 and new.block_ids == []
    run_all(s)
    assert new.output_token_ids == expected_output(prompt(8, 2), 12)


def test_prefix_cache_hit_after_first_request_finished():
    s = make_scheduler(num_blocks=64, block_size=4)
    shared = prompt(20)
    a = make_request("a", shared + [1, 2, 3], max_tokens=3)
    s.add(a)
    run_all(s)
    usage = s.block_manager.usage()
    assert usage.used == 0 and usage.cached >= 5
    b = make_request("b", shared + [4, 5], max_tokens=3)
    s.add(b)
    out = step(s)
    assert b.num_cached_tokens == 20
    assert out.scheduled[0].start == 20 and out.scheduled[0].num_tokens == 2
    run_all(s)
    assert b.output_token_ids == expected_output(shared + [4, 5], 3)
    assert s.block_manager.prefix_hits == 20


def test_prefix_cache_hit_shares_blocks_with_a_running_request():
    s = make_scheduler(num_blocks=64, block_size=4)
    shared = prompt(16, 5)
    a = make_request("a", shared + [7], max_tokens=10)
    s.add(a)
    step(s)
    b = make_request("b", shared + [8, 9], max_tokens=2)
    s.add(b)
    step(s)
    assert b.block_ids[:4] == a.block_ids[:4]
    assert all(s.block_manager.blocks[i].ref_count == 2 for i in a.block_ids[:4])
    run_all(s)
    assert s.block_manager.usage().used == 0


def test_full_prompt_hit_still_computes_the_last_token():
    s = make_scheduler(num_blocks=64, block_size=4)
    p = prompt(16, 3)
    s.add(make_request("a", p, max_tokens=2))
    run_all(s)
    b = make_request("b", p, max_tokens=2)
    s.add(b)
    out = step(s)
    assert b.num_cached_tokens == 12 and out.scheduled[0].num_tokens == 4
    run_all(s)
    assert b.output_token_ids == expected_output(p, 2)


def test_cached_blocks_are_evicted_lru_when_memory_is_needed():
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add(make_request("a", prompt(16, 1), max_tokens=1))
    run_all(s)
    assert s.block_manager.usage().cached == 4
    big = make_request("big", prompt(28, 2), max_tokens=4)  # needs all 8 blocks
    s.add(big)
    run_all(s)
    assert big.output_token_ids == expected_output(prompt(28, 2), 4)


def test_abort_anywhere_frees_everything():
    s = make_scheduler(num_blocks=40, block_size=4, budget=16, chunk=8)
    reqs = [make_request(f"r{i}", prompt(20, i), max_tokens=30) for i in range(5)]
    for r in reqs:
        s.add(r)
    s.abort("r4")  # still waiting
    step(s)  # r0 mid-prefill
    s.abort("r0")
    for _ in range(6):
        step(s)
    s.abort("r1")  # decoding
    assert s.abort("nope") is None
    run_all(s)
    assert all(r.is_finished for r in reqs)
    assert [r.finish_reason for r in reqs].count(FinishReason.ABORT) == 3
    assert s.block_manager.usage().used == 0 and s.block_manager.num_free_blocks == 40


def test_random_workload_with_aborts_never_breaks_integrity():
    rng = random.Random(7)
    s = make_scheduler(num_blocks=30, block_size=4, budget=24, max_seqs=6, chunk=10)
    live: list[str] = []
    expected = {}
    for n in range(200):
        plen, mt = rng.randint(1, 30), rng.randint(1, 12)
        p = prompt(plen, rng.randint(0, 3))  # few salts: many prefix hits
        r = make_request(f"q{n}", p, max_tokens=mt)
        s.add(r)
        expected[r.request_id] = (r, expected_output(p, mt))
        live.append(r.request_id)
        for _ in range(rng.randint(0, 3)):
            step(s)
        if rng.random() < 0.2:
            s.abort(rng.choice(live))
    run_all(s)
    assert s.block_manager.usage().used == 0
    for r, exp in expected.values():
        if r.finish_reason is not FinishReason.ABORT:
            assert r.output_token_ids == exp


def test_eos_and_stop_token_ids_finish_with_stop():
    s = make_scheduler()
    p = prompt(6)
    first = expected_output(p, 1)[0]
    r = make_request("a", p, max_tokens=5, stop_token_ids=(first,))
    s.add(r)
    run_all(s)
    assert r.output_token_ids == [first] and r.finish_reason is FinishReason.STOP
    assert r.stop_reason == first


def test_prompts_asking_for_logprobs_share_one_steps_worth_of_logit_rows():
    """Each such position is a row of logits over the vocabulary: all of them together get at
    most PROMPT_LOGPROBS_CHUNK positions a step, and every request still finishes with its
    expected output."""
    from engine.scheduler import PROMPT_LOGPROBS_CHUNK

    scheduler = make_scheduler(num_blocks=2048, block_size=16, budget=4096, max_seqs=8)
    prompts = {f"lp{i}": list(range(100 + i, 100 + i + 400)) for i in range(3)}
    for rid, prompt in prompts.items():
        scheduler.add(make_request(rid, prompt, max_tokens=3, prompt_logprobs=0))
    scheduler.add(make_request("plain", list(range(7, 607)), max_tokens=3))
    steps = run_all(scheduler)
    for out in steps:
        rows = sum(s.num_tokens for s in out.scheduled
                   if s.request.params.prompt_logprobs is not None and s.num_tokens > 1)
        assert rows <= PROMPT_LOGPROBS_CHUNK
    assert sum(s.num_tokens for s in steps[0].scheduled) == PROMPT_LOGPROBS_CHUNK
    prompts["plain"] = list(range(7, 607))
    for rid, prompt in prompts.items():
        assert scheduler_output(steps, rid) == expected_output(prompt, 3)


def scheduler_output(steps: list, rid: str) -> list[int]:
    request = next(s.request for out in steps for s in out.scheduled if s.request.request_id == rid)
    return request.output_token_ids


def _sliding(release: bool = True, **kw: object):  # noqa: ANN202 - a Scheduler
    from engine.block_manager import BlockManager
    from engine.config import SchedulerConfig
    from engine.scheduler import Scheduler

    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=4096,
                             release_passed_blocks=release)
    return Scheduler(config, BlockManager(kw.get("num_blocks", 64), 4), release_window=6)


def test_a_sliding_only_model_lets_go_of_the_blocks_every_window_has_passed():
    """Window 6, a step budget of 8, blocks of 4: once decoding, a request holds only the blocks
    from (computed - 8 - 6 + 1) on; released ids stay in place; the output is unchanged."""
    s = _sliding()
    r = make_request("a", prompt(20), max_tokens=40)
    s.add(r)
    while len(r.output_token_ids) < 30:
        step(s)
        first_needed = r.num_computed_tokens - 8 - 6 + 1
        if len(r.output_token_ids) > 1 and first_needed > 0:
            assert r.num_released_blocks == first_needed // 4
        held = len(r.block_ids) - r.num_released_blocks
        assert s.block_manager.usage().used == held
    assert r.num_released_blocks > 5 and len(r.block_ids) == -(-r.num_computed_tokens // 4)
    run_all(s)
    assert r.output_token_ids == expected_output(prompt(20), 40)
    assert s.block_manager.usage().used == 0  # freeing skips what was released


def test_released_blocks_serve_others_and_a_preempted_request_starts_whole():
    """Four blocks for two requests: with release the pair fits where it would preempt; a
    preemption after releases frees only what is held."""
    s = _sliding(num_blocks=12)
    a, b = make_request("a", prompt(10, 1), max_tokens=30), make_request("b", prompt(10, 2), 30)
    s.add(a)
    s.add(b)
    run_all(s)
    assert a.output_token_ids == expected_output(prompt(10, 1), 30)
    assert b.output_token_ids == expected_output(prompt(10, 2), 30)
    assert s.num_preemptions == 0
    keep = _sliding(release=False, num_blocks=12)
    a2, b2 = make_request("a", prompt(10, 1), max_tokens=30), make_request("b", prompt(10, 2), 30)
    keep.add(a2)
    keep.add(b2)
    run_all(keep)
    assert keep.num_preemptions > 0 and a2.num_released_blocks == 0
    assert a2.output_token_ids == a.output_token_ids


def test_a_prompt_held_for_its_samples_stays_held_while_its_request_lets_go():
    """The prompt's blocks are held apart for the samples that will fork (engine.forks) when it
    is computed: the request's own releases later leave them held."""
    s = _sliding()
    r = make_request("a", prompt(20), max_tokens=30)
    r.forks_expected = 1
    s.add(r)
    for _ in range(25):
        out = s.schedule()
        s.update(out, fake_execute(out))
        s.block_manager.check_integrity(s.block_holders())  # the held prompt's holder too
    (holder,) = s.forks.holders()
    assert r.num_released_blocks > 0 and holder.block_ids == r.block_ids[:5]
    assert all(s.block_manager.blocks[b].ref_count == 1 for b in holder.block_ids)


def test_a_paused_request_is_detached_with_its_kv_whole_and_resumes_unchanged():
    s = make_scheduler(num_blocks=32, block_size=4)
    moving, staying = make_request("m", prompt(9), max_tokens=12), make_request("s", prompt(5, 1))
    s.add(moving)
    s.add(staying)
    assert s.pause("m") == "its prompt is still being computed"  # nothing to move yet
    for _ in range(4):
        step(s)
    assert s.pause("m") is None and s.pause("m") == "not running here"
    assert moving.status is RequestStatus.PAUSED
    before = list(moving.output_token_ids)
    step(s)  # the batch runs without it
    assert moving.output_token_ids == before
    (parked,) = s.take_paused()
    assert parked is moving and moving.status is RequestStatus.DETACHED
    assert "m" not in s.requests and moving.block_ids  # out of the scheduler, blocks held
    assert moving.num_computed_tokens == moving.num_tokens - 1  # every position but the last
    s.resume(moving)
    run_all(s)
    assert moving.output_token_ids == expected_output(prompt(9), 12)
    assert s.block_manager.num_free_blocks == 32


def test_a_request_recomputing_after_a_preemption_cannot_pause_until_its_kv_is_whole():
    # Preempted, it recomputes its prompt and its output in chunks: parked in between, it would
    # move with positions never computed (the target then decoded over missing KV).
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, chunk=4, prefix_caching=False)
    old, new = make_request("old", prompt(8, 1), 12), make_request("new", prompt(8, 2), 12)
    s.add(old)
    s.add(new)
    while not new.num_preemptions:
        step(s)
    s.abort("old")  # room to recompute
    refused = 0
    while new.num_computed_tokens < new.num_known_tokens - 1:
        if new.status is RequestStatus.RUNNING and new.num_computed_tokens >= 8:
            assert s.pause("new") == "its KV is still being recomputed after a preemption"
            refused += 1
        step(s)
    assert refused and s.pause("new") is None
    (parked,) = s.take_paused()
    assert parked.num_computed_tokens == parked.num_tokens - 1


def test_a_request_that_finishes_or_is_aborted_while_pausing_is_never_parked():
    s = make_scheduler(num_blocks=32, block_size=4)
    a, b = make_request("a", prompt(6), max_tokens=20), make_request("b", prompt(6, 2))
    s.add(a)
    s.add(b)
    step(s)
    assert s.pause("a") is None and s.pause("b") is None
    s.abort("a")
    assert a.is_finished and s.take_paused() == [b]
    s.block_manager.free(b)  # what a decode worker does once b's KV has moved
    assert s.block_manager.num_free_blocks == 32
