"""Async scheduling's bookkeeping without a model: step N+1 is scheduled and "launched" before
step N is read (its sampled tokens pending), as LLMEngine._step_async does. Every output must
equal the synchronous schedule's, and no block may be freed while a step in flight holds it."""

from __future__ import annotations

import random

from engine.request import FinishReason, RequestStatus
from engine.scheduler import Scheduler, SchedulerOutput
from tests.unit.fakes import EOS, expected_output, make_request, make_scheduler, next_token


class FakeDevice:
    """Samples like tests.unit.fakes, but from the history the device sees: the known tokens
    plus the tokens it sampled that the host has not read yet."""

    def __init__(self) -> None:
        self.unread: dict[str, list[int]] = {}
        self.computed: dict[str, tuple[int, int]] = {}  # id -> (next position, preemptions)

    def launch(self, out: SchedulerOutput) -> list[int | None]:
        sampled: list[int | None] = []
        for item in out.scheduled:
            request = item.request
            done, preemptions = self.computed.get(request.request_id, (0, 0))
            if preemptions == request.num_preemptions and done:
                assert item.start == done, "a position computed twice, or skipped"
            self.computed[request.request_id] = (item.end, request.num_preemptions)
            history = (request.all_token_ids + self.unread.get(request.request_id, []))
            assert len(history) >= item.end, "a scheduled position has no token"
            token = next_token(history[:item.end]) if item.samples else None
            if token is not None:
                self.unread.setdefault(request.request_id, []).append(token)
            sampled.append(token)
        return sampled

    def read(self, out: SchedulerOutput, sampled: list[int | None]) -> None:
        for item, token in zip(out.scheduled, sampled):
            if token is not None:
                self.unread[item.request.request_id].pop(0)


def async_step(s: Scheduler, device: FakeDevice,
               flight: tuple[SchedulerOutput, list[int | None]] | None
               ) -> tuple[SchedulerOutput, list[int | None]] | None:
    out = s.schedule()
    launched = None if out.is_empty else (out, device.launch(out))
    s.mark_launched(out)
    if flight is not None:
        device.read(*flight)
        s.release_held()
        s.update(flight[0], flight[1], computed_at_launch=True)
    holders = list(s.requests.values()) + list(s.held_requests)
    s.block_manager.check_integrity(holders)
    return launched


def run_async(s: Scheduler) -> int:
    device, flight, steps = FakeDevice(), None, 0
    while s.has_unfinished() or flight is not None:
        flight = async_step(s, device, flight)
        steps += 1
        assert steps < 10_000, "no progress"
    return steps


def prompt(n: int, salt: int) -> list[int]:
    return [10 + (i * 7 + salt * 13) % 500 for i in range(n)]


def test_async_schedule_gives_the_synchronous_outputs_under_preemption_and_prefix_hits():
    rng = random.Random(3)
    preemptions = hits = 0
    for trial in range(6):
        s = make_scheduler(num_blocks=24, block_size=4, budget=24, max_seqs=6, chunk=8)
        shared = prompt(12, trial)
        reqs = []
        for i in range(10):
            body = shared + prompt(rng.randint(1, 20), 100 + i) if i % 2 else \
                prompt(rng.randint(1, 30), i + 10 * trial)
            reqs.append(make_request(f"r{i}", body, max_tokens=rng.randint(1, 24)))
        for r in reqs:
            s.add(r)
        run_async(s)
        for r in reqs:
            assert r.output_token_ids == expected_output(r.prompt_token_ids,
                                                         r.params.max_tokens)
            assert r.num_pending == 0
        assert s.block_manager.num_free_blocks == 24
        preemptions += s.num_preemptions
        hits += s.block_manager.prefix_hits
    assert preemptions > 0 and hits > 0, "the trials must preempt and hit the prefix cache"


def test_a_request_finished_while_its_next_step_runs_keeps_its_blocks_until_that_step_is_done():
    s = make_scheduler(num_blocks=16, block_size=4, budget=32)
    r = make_request("a", prompt(6, 0), max_tokens=2)
    s.add(r)
    device = FakeDevice()
    flight = async_step(s, device, None)  # the prompt, sampling token 1
    flight = async_step(s, device, flight)  # token 2 launched; token 1 read
    assert r.num_pending == 1 and len(r.output_token_ids) == 1
    out = s.schedule()  # token 3 is scheduled before token 2 is read ...
    assert [i.request for i in out.scheduled] == [r]
    launched = device.launch(out)
    s.mark_launched(out)
    device.read(*flight)
    s.release_held()
    s.update(flight[0], flight[1], computed_at_launch=True)  # ... which ends the request
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.LENGTH
    assert r.block_ids and list(s.held_requests) == [r], "the step in flight still writes"
    device.read(out, launched)
    s.mark_launched(SchedulerOutput())  # nothing in flight any more
    s.release_held()
    assert not r.block_ids and s.block_manager.num_free_blocks == 16


def test_abort_while_in_flight_and_eos_both_end_with_every_block_free():
    s = make_scheduler(num_blocks=32, block_size=4, budget=16, max_seqs=4)
    reqs = [make_request(f"r{i}", prompt(5 + i, i), max_tokens=30) for i in range(4)]
    stops_early = make_request("eos", prompt(9, 7), max_tokens=30)
    for r in [*reqs, stops_early]:
        s.add(r)
    device, flight = FakeDevice(), None
    for _ in range(4):
        flight = async_step(s, device, flight)
    s.abort("r1")  # between steps, while a step that holds it is in flight
    assert reqs[1].block_ids, "blocks stay with the step in flight"
    while s.has_unfinished() or flight is not None:
        flight = async_step(s, device, flight)
    assert s.block_manager.num_free_blocks == 32
    assert reqs[0].output_token_ids == expected_output(reqs[0].prompt_token_ids, 30)
    assert EOS not in reqs[0].output_token_ids or reqs[0].finish_reason is FinishReason.STOP


def test_a_paused_request_settles_only_after_the_step_in_flight_is_read():
    s = make_scheduler(num_blocks=16, block_size=4, budget=32)
    r = make_request("a", prompt(6, 0), max_tokens=10)
    s.add(r)
    device = FakeDevice()
    flight = async_step(s, device, None)
    flight = async_step(s, device, flight)  # token 2 in flight
    assert r.num_pending == 1
    assert s.pause("a") is None
    assert s.take_paused() == [], "a step in flight still computes it"
    flight = async_step(s, device, flight)  # schedules without it, reads token 2
    assert flight is None and r.num_pending == 0
    assert s.take_paused() == [r]
    assert r.num_computed_tokens == r.num_tokens - 1 and len(r.output_token_ids) == 2
    s.resume(r)
    run_async(s)
    assert r.output_token_ids == expected_output(prompt(6, 0), 10)
    assert s.block_manager.num_free_blocks == 16
