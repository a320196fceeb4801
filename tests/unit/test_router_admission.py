"""Router reliability pieces without processes: the bounded queue, suspects, the migration
continuation, and locating invalid UTF-8 in a raw request."""

from __future__ import annotations

import threading
import time

import pytest

from engine.request import SamplingParams, StructuredOutput
from pdserve_proto import pdserve_pb2 as pb
from router.frontdoor.lenient import MAX_REQUEST_BYTES, Unparsable, find_bad_utf8, lenient
from router.frontdoor.validation import Job
from router.policy.admission import Admission, LeftQueue, QueueFull
from router.policy.placement import Suspects
from router.request.calls import RouterError
from router.request.events import continuation as _continuation


def _far() -> float:
    return time.monotonic() + 30


def test_admission_runs_up_to_the_limit_queues_then_refuses_at_once():
    admission = Admission(max_running=2, max_queued=1)
    never = threading.Event()
    admission.enter(_far(), never)
    admission.enter(_far(), never)
    entered = threading.Event()
    waiter = threading.Thread(target=lambda: (admission.enter(_far(), never), entered.set()))
    waiter.start()
    while admission.queued == 0:
        time.sleep(0.01)
    with pytest.raises(QueueFull, match="--max-queued"):
        admission.enter(_far(), never)
    assert not entered.is_set()
    admission.leave()
    waiter.join(5)
    assert entered.is_set() and admission.running == 2 and admission.queued == 0
    admission.leave()
    admission.leave()
    assert admission.idle()


def test_a_queued_request_leaves_on_its_deadline_or_cancel_without_a_slot():
    admission = Admission(max_running=1, max_queued=4)
    never = threading.Event()
    admission.enter(_far(), never)
    with pytest.raises(LeftQueue) as left:
        admission.enter(time.monotonic() + 0.1, never)
    assert left.value.reason == "deadline"
    cancelled = threading.Event()
    threading.Timer(0.1, cancelled.set).start()
    with pytest.raises(LeftQueue) as left:
        admission.enter(_far(), cancelled)
    assert left.value.reason == "cancelled"
    assert admission.running == 1 and admission.queued == 0


def test_admission_is_first_come_first_served():
    admission = Admission(max_running=1, max_queued=8)
    never = threading.Event()
    admission.enter(_far(), never)
    order: list[int] = []

    def wait(i: int) -> None:
        admission.enter(_far(), never)
        order.append(i)
        admission.leave()

    threads = []
    for i in range(5):
        threads.append(threading.Thread(target=wait, args=(i,)))
        threads[-1].start()
        while admission.queued < i + 1:
            time.sleep(0.01)
    admission.leave()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3, 4]


def test_suspects_expire_after_their_ttl():
    now = [0.0]
    suspects = Suspects(3.0, clock=lambda: now[0])
    suspects.add("decode-0")
    assert suspects.current() == {"decode-0"}
    now[0] = 3.5
    assert suspects.current() == frozenset()


def test_continuation_moves_streamed_tokens_into_the_prompt():
    job = Job("r", "r#1", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0))
    assert _continuation(job, [], 1) is job
    moved = _continuation(job, [7, 8, 9], 2)
    assert moved.token_ids == [1, 2, 3, 7, 8, 9] and moved.params.max_tokens == 7
    assert moved.worker_request_id == "r#1.2" and moved.request_id == "r"
    at_least = Job("r", "r#1", [1], SamplingParams(max_tokens=10, min_tokens=6, prompt_logprobs=2))
    moved = _continuation(at_least, [7, 8], 2)
    assert (moved.params.min_tokens, moved.params.prompt_logprobs) == (4, None)
    constrained = Job("r", "r#1", [1], SamplingParams(max_tokens=10, structured_output=(
        StructuredOutput("json_object"))))
    assert _continuation(constrained, [], 2).params == constrained.params  # nothing streamed
    with pytest.raises(RouterError, match="cannot continue elsewhere"):
        _continuation(constrained, [7], 2)


def test_invalid_utf8_is_located_by_field_path():
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(stop=["ok", "XY"]))
    data = request.SerializeToString().replace(b"XY", b"\xff\xfe")
    assert find_bad_utf8(data, pb.GenerateRequest.DESCRIPTOR) == "sampling.stop[1]"
    parsed = lenient(pb.GenerateRequest)(data)
    assert isinstance(parsed, Unparsable) and "sampling.stop[1]" in parsed.reason
    chat = pb.GenerateRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content="QQ")])).SerializeToString()
    assert find_bad_utf8(chat.replace(b"QQ", b"\xc3("), pb.GenerateRequest.DESCRIPTOR) == \
        "chat.messages[0].content"


def test_oversized_requests_are_refused_before_parsing():
    parsed = lenient(pb.GenerateRequest)(b"\0" * (MAX_REQUEST_BYTES + 1))
    assert isinstance(parsed, Unparsable) and str(MAX_REQUEST_BYTES) in parsed.reason
    ok = lenient(pb.GenerateRequest)(pb.GenerateRequest(prompt="hi").SerializeToString())
    assert ok.prompt == "hi"


# ---- which queued request gets the next slot -----------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _queue_three(admission: Admission, costs: list[int], clock: _Clock) -> list[int]:
    """Queue requests of `costs` prompt tokens behind one running; free slots one at a time
    and return the costs in the order they got in."""
    order: list[int] = []
    never = threading.Event()
    threads = []
    for cost in costs:
        far = clock.now + 1e6  # deadlines are times of the admission's clock
        t = threading.Thread(target=lambda c=cost, f=far: (admission.enter(f, never, 0.01, c),
                                                           order.append(c)))
        t.start()
        threads.append(t)
        while admission.queued < len(threads):
            time.sleep(0.005)
        clock.now += 1.0  # each waits one clock second longer than the next
    for admitted in range(1, len(costs) + 1):
        admission.leave()  # one slot at a time: the next leaves once this one is taken
        deadline = time.monotonic() + 30
        while len(order) < admitted:
            assert time.monotonic() < deadline, f"request {admitted} was never admitted"
            time.sleep(0.005)
    for t in threads:
        t.join(5)
    return order


def test_short_first_gives_the_slot_to_the_shortest_prompt():
    clock = _Clock()
    admission = Admission(max_running=1, max_queued=8, clock=clock, age_bound_s=60)
    admission.enter(clock.now + 1e6, threading.Event())
    assert _queue_three(admission, [1800, 90, 400], clock) == [90, 400, 1800]


def test_an_old_request_goes_first_whatever_its_size():
    clock = _Clock()
    admission = Admission(max_running=1, max_queued=8, clock=clock, age_bound_s=2.5)
    admission.enter(_far(), threading.Event())
    # 1800 has waited 3 clock seconds (> 2.5) when the first slot frees: it goes first.
    assert _queue_three(admission, [1800, 90, 400], clock) == [1800, 90, 400]


def test_fcfs_keeps_arrival_order():
    clock = _Clock()
    admission = Admission(max_running=1, max_queued=8, clock=clock, policy="fcfs")
    admission.enter(clock.now + 1e6, threading.Event())
    assert _queue_three(admission, [1800, 90, 400], clock) == [1800, 90, 400]


def test_bad_queue_settings_name_the_flag():
    with pytest.raises(ValueError, match="--queue-policy"):
        Admission(1, 1, policy="lifo")
    with pytest.raises(ValueError, match="--queue-age-bound-s"):
        Admission(1, 1, age_bound_s=0)
