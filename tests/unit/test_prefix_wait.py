"""Waiting prompts that share a prefix a running request is computing wait for it
(engine.prefix_wait), then compute only their own suffix; outputs never change and nothing
waits forever."""

from __future__ import annotations

import random

from engine.prefix_wait import MIN_SHARED_TOKENS, PrefixesInFlight
from engine.request import FinishReason
from tests.unit.fakes import expected_output, make_request, make_scheduler, run_all, step


def tokens(n: int, salt: int) -> list[int]:
    return [10 + (i * 7 + salt * 131) % 900 for i in range(n)]


SYSTEM = tokens(48, 0)  # 12 blocks of 4: more than MIN_SHARED_TOKENS


def computed_tokens(steps: list) -> int:
    return sum(item.num_tokens for out in steps for item in out.scheduled)


def test_prompts_arriving_together_compute_a_shared_prefix_once():
    s = make_scheduler(num_blocks=128, block_size=4, budget=256, max_seqs=8)
    prompts = [SYSTEM + tokens(10, i + 1) for i in range(4)]
    reqs = [make_request(f"r{i}", p, max_tokens=5) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add(r)
    first = step(s)
    assert [item.request.request_id for item in first.scheduled] == ["r0"]
    second = step(s)  # r0's blocks are cached now: the others take them and compute the rest
    assert {r.request_id for r in reqs[1:]} <= {i.request.request_id for i in second.scheduled}
    assert [r.num_cached_tokens for r in reqs[1:]] == [48, 48, 48]
    steps = [first, second, *run_all(s)]
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == expected_output(p, 5)
    assert s.block_manager.usage().used == 0
    # the shared 48 tokens once, four suffixes of 10, and four decodes of 4 more tokens each
    assert computed_tokens(steps) == 48 + 4 * 10 + 4 * 4


def test_a_chunked_owner_is_waited_for_until_the_shared_blocks_are_published():
    s = make_scheduler(num_blocks=128, block_size=4, budget=16, max_seqs=8)
    a = make_request("a", SYSTEM + tokens(6, 1), max_tokens=3)
    b = make_request("b", SYSTEM + tokens(6, 2), max_tokens=3)
    s.add(a)
    s.add(b)
    waited = 0
    while b.num_computed_tokens == 0 and s.has_unfinished():
        out = step(s)
        waited += any(item.request is b for item in out.scheduled) is False
    assert waited == 3  # 48 shared tokens at 16 a step
    assert b.num_cached_tokens == 48
    run_all(s)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 3)


def test_a_short_shared_stretch_is_computed_again_rather_than_waited_for():
    shared = tokens(MIN_SHARED_TOKENS - 4, 0)
    s = make_scheduler(num_blocks=128, block_size=4, budget=256, max_seqs=8)
    reqs = [make_request(f"r{i}", shared + tokens(10, i + 1), max_tokens=2) for i in range(3)]
    for r in reqs:
        s.add(r)
    assert len(step(s).scheduled) == 3
    run_all(s)


def test_without_prefix_caching_nothing_waits():
    s = make_scheduler(num_blocks=128, block_size=4, budget=256, prefix_caching=False)
    for i in range(3):
        s.add(make_request(f"r{i}", SYSTEM + tokens(10, i + 1), max_tokens=2))
    assert len(step(s).scheduled) == 3


def test_prompts_asking_for_prompt_logprobs_never_wait():
    s = make_scheduler(num_blocks=128, block_size=4, budget=256)
    s.add(make_request("a", SYSTEM + tokens(10, 1), max_tokens=2))
    s.add(make_request("b", SYSTEM + tokens(10, 2), max_tokens=2, prompt_logprobs=1))
    assert len(step(s).scheduled) == 2


def test_the_wait_ends_when_the_owner_is_aborted():
    s = make_scheduler(num_blocks=128, block_size=4, budget=16)
    a = make_request("a", SYSTEM + tokens(6, 1), max_tokens=3)
    b = make_request("b", SYSTEM + tokens(6, 2), max_tokens=3)
    s.add(a)
    s.add(b)
    step(s)
    assert b.num_computed_tokens == 0
    s.abort("a")
    out = step(s)
    assert [item.request for item in out.scheduled] == [b]
    assert b.num_cached_tokens == 16  # a's one step of blocks, cached before it was aborted
    run_all(s)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 3)
    assert s.block_manager.usage().used == 0


def test_a_waiting_prompt_does_not_hold_back_others_behind_it():
    s = make_scheduler(num_blocks=128, block_size=4, budget=256)
    s.add(make_request("a", SYSTEM + tokens(10, 1), max_tokens=2))
    s.add(make_request("b", SYSTEM + tokens(10, 2), max_tokens=2))
    s.add(make_request("c", tokens(60, 9), max_tokens=2))
    assert [item.request.request_id for item in step(s).scheduled] == ["a", "c"]


def test_in_flight_keys_are_the_owners_unpublished_prompt_blocks_only():
    s = make_scheduler(num_blocks=128, block_size=4, budget=16)
    a = make_request("a", SYSTEM + tokens(6, 1), max_tokens=3)
    s.add(a)
    step(s)  # 16 of a's tokens computed and published
    waiting = make_request("w", SYSTEM[:16] + tokens(40, 5), max_tokens=1)
    assert not PrefixesInFlight(s.block_manager, s.running).should_wait(waiting, 4)
    other = make_request("o", SYSTEM + tokens(6, 3), max_tokens=1)
    assert PrefixesInFlight(s.block_manager, s.running).should_wait(other, 4)


def test_random_shared_prefix_workload_keeps_outputs_and_integrity():
    rng = random.Random(11)
    s = make_scheduler(num_blocks=60, block_size=4, budget=24, max_seqs=6, chunk=10)
    expected = {}
    for n in range(150):
        p = tokens(rng.choice((32, 40, 56)), rng.randint(0, 2)) + tokens(rng.randint(1, 12), n)
        r = make_request(f"q{n}", p, max_tokens=rng.randint(1, 10))
        s.add(r)
        expected[r.request_id] = (r, expected_output(p, r.params.max_tokens))
        for _ in range(rng.randint(0, 2)):
            step(s)
        if rng.random() < 0.15:
            s.abort(rng.choice(list(expected)))
    run_all(s)
    assert s.block_manager.usage().used == 0
    for r, exp in expected.values():
        if r.finish_reason is not FinishReason.ABORT:
            assert r.output_token_ids == exp
