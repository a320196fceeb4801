"""n samples of a prompt, without a model: the engine's fork sources (held prompt blocks, shared by
reference count, the last block copied) and the router's fork groups (who leads, who waits, what
a retry keeps)."""

from __future__ import annotations

import threading

import grpc
import pytest

from engine.block_manager import BlockManager
from engine.forks import ForkSources
from engine.request import Request, SamplingParams
from pdserve_proto import pdserve_pb2 as pb
from router.frontdoor.choices import choice_forks
from router.frontdoor.validation import Job
from router.request.calls import CallScope, RouterError
from router.request.events import continuation, handover
from router.request.forks import ForkGroup, ForkSource, fork_roles


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prompt_request(rid: str, length: int, bm: BlockManager) -> Request:
    """A request whose `length`-token prompt is computed in blocks of `bm`."""
    request = Request(rid, list(range(100, 100 + length)), SamplingParams())
    assert bm.allocate_slots(request, length)
    request.num_computed_tokens = length
    return request


@pytest.mark.parametrize("length, shared", [(37, 2), (32, 1), (1, 0)])
def test_a_fork_shares_the_prompt_and_copies_the_block_it_ends_in(length, shared):
    bm = BlockManager(num_blocks=16, block_size=16)
    sources = ForkSources(bm, Clock())
    leader = prompt_request("a", length, bm)
    leader.forks_expected = 2
    sources.hold(leader)
    assert leader.forks_expected == 0 and len(sources) == 1
    forks = [Request(f"a{j}", list(leader.prompt_token_ids), SamplingParams()) for j in (1, 2)]
    for fork in forks:
        copies = sources.take("a", fork)
        assert copies == [(leader.block_ids[shared], fork.block_ids[shared])]
        assert fork.block_ids[:shared] == leader.block_ids[:shared]
        assert fork.block_ids[shared] not in leader.block_ids
        assert fork.num_computed_tokens == length - 1  # its first step: the last position
        bm.check_integrity([leader, *forks[:forks.index(fork) + 1], *sources.holders()])
    assert len(sources) == 1  # spent, held until its copies are made
    sources.release_spent()
    assert len(sources) == 0 and sources.num_forked == 2
    for request in (leader, *forks):
        bm.free(request)
    assert bm.usage().used == 0


def test_a_request_that_lost_its_blocks_holds_nothing():
    """Async scheduling: preempted while its last chunk ran, it samples with no blocks."""
    bm = BlockManager(num_blocks=8, block_size=4)
    sources = ForkSources(bm, Clock())
    leader = Request("a", list(range(10)), SamplingParams())
    leader.forks_expected = 2
    sources.hold(leader)
    assert len(sources) == 0 and leader.forks_expected == 0


def test_a_source_outlives_its_request_until_its_lease_ends():
    bm = BlockManager(num_blocks=8, block_size=4)
    clock = Clock()
    sources = ForkSources(bm, clock, lease_s=5.0)
    leader = prompt_request("a", 10, bm)
    leader.forks_expected = 1
    sources.hold(leader)
    bm.free(leader)  # it finished: its prompt's 3 blocks stay held
    assert bm.usage().used == 3
    clock.now = 4.9
    sources.expire()
    assert bm.usage().used == 3
    clock.now = 5.0
    sources.expire()
    assert bm.usage().used == 0 and len(sources) == 0
    late = Request("a1", list(leader.prompt_token_ids), SamplingParams())
    assert sources.take("a", late) is None and not late.block_ids


def test_no_fork_for_another_prompt_or_without_room():
    bm = BlockManager(num_blocks=3, block_size=4)
    sources = ForkSources(bm, Clock())
    leader = prompt_request("a", 10, bm)  # all 3 blocks
    leader.forks_expected = 1
    sources.hold(leader)
    other = Request("b", [1, 2, 3], SamplingParams())
    assert sources.take("a", other) is None and not other.block_ids
    same = Request("a1", list(leader.prompt_token_ids), SamplingParams())
    assert sources.take("a", same) is None  # no free block for its copy: nothing taken
    assert not same.block_ids and same.num_computed_tokens == 0
    bm.check_integrity([leader, *sources.holders()])
    assert sources.reclaimable() == 0 and not sources.release_reclaimable()  # leader holds them
    bm.free(leader)
    assert sources.reclaimable() == 3 and sources.release_reclaimable()
    assert bm.usage().used == 0 and len(sources) == 0


def test_followers_wait_for_the_leader_to_publish_or_give_up():
    scope = CallScope(30.0)
    group = ForkGroup(followers=2)
    got: list[ForkSource | None] = []
    waiters = [threading.Thread(target=lambda: got.append(group.wait(scope))) for _ in range(2)]
    for w in waiters:
        w.start()
    group.publish(ForkSource("decode-0", "req-1"))
    group.give_up()  # too late: the first word stands
    for w in waiters:
        w.join(5)
    assert got == [ForkSource("decode-0", "req-1")] * 2
    lone = ForkGroup(followers=1)
    lone.give_up()
    assert lone.wait(scope) is None


def test_a_cancelled_request_stops_waiting_for_its_leader():
    scope = CallScope(30.0)
    scope.cancel()
    with pytest.raises(RouterError) as ended:
        ForkGroup(followers=1).wait(scope)
    assert ended.value.code is grpc.StatusCode.CANCELLED


def test_roles_follow_the_choice_order_and_skip_prompt_logprobs():
    roles = fork_roles(num_prompts=2, n=3)
    assert [r.sample for r in roles] == [0, 1, 2, 0, 1, 2]
    assert roles[0].group is roles[2].group and roles[0].group is not roles[3].group
    assert [r.leads for r in roles[:3]] == [True, False, False]
    assert roles[0].group.followers == 2
    assert choice_forks(1, pb.SamplingOptions(), 4) == [None] * 4
    with_logprobs = pb.SamplingOptions(prompt_logprobs=1)
    assert choice_forks(2, with_logprobs, 4) == [None] * 4  # only a whole prefill computes them
    assert all(r is not None for r in choice_forks(2, pb.SamplingOptions(), 4))


def test_a_retry_keeps_leading_only_while_its_prompt_is_unchanged():
    leader, follower = fork_roles(num_prompts=1, n=2)
    job = Job("r", "w", [1, 2, 3], SamplingParams(max_tokens=8), fork=leader)
    assert continuation(job, [], 2).fork is leader  # the prefill failed: it leads again
    assert continuation(job, [7], 2).fork is None  # its continuation's prompt is longer
    moved = continuation(continuation(job, [7], 2), [8, 9], 3)
    assert moved.token_ids == [1, 2, 3, 7, 8, 9] and moved.params.max_tokens == 5
    assert moved.params.continued_tokens == 3  # penalties and seeds count them as output
    sample = Job("r", "w1", [1, 2, 3], SamplingParams(max_tokens=8), fork=follower)
    assert continuation(sample, [], 1).fork is follower
    assert continuation(sample, [], 2).fork is None  # a retry prefills on its own


def test_a_moved_request_asks_its_target_for_no_prompt_logprobs():
    # they went out with the first token; a target asked for them built a list per step
    job = Job("r", "w", [1, 2, 3], SamplingParams(max_tokens=8, prompt_logprobs=1))
    moved = handover(job, [7])
    assert moved.token_ids == [1, 2, 3] and moved.params.prompt_logprobs is None
    assert moved.params.max_tokens == 8 and moved.params.continued_tokens == 0
    later = handover(job, [7, 8, 9])
    assert later.token_ids == [1, 2, 3, 7, 8] and later.params.prompt_logprobs is None
    assert later.params.max_tokens == 6 and later.params.continued_tokens == 2
