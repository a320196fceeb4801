"""A decode worker's Outputs sessions (decode_worker.output_sessions), without a model: a step's
outputs leave in one batch, a request's end wakes the sender at once, and closing a session names
the requests still bound to it."""

from __future__ import annotations

import threading

import pytest

from decode_worker import output_sessions
from decode_worker.departures import Paused
from decode_worker.output_sessions import OutputSession, OutputSessions, QueueSink
from engine.engine import RequestOutput


def output(rid: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=rid, prompt_token_ids=[1, 2], new_token_ids=tokens[-1:],
                         new_text="", token_ids=tokens, text="", finished=finished,
                         finish_reason="length" if finished else None)


def wait_outcome(sink: output_sessions.SessionSink) -> BaseException | None:
    """How a DecodeInto handler's wait on `sink` ended: None, or what it raised."""
    try:
        sink.wait()
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test looks at
        return exc
    return None


def test_a_steps_outputs_wait_for_its_end_and_leave_together():
    session = OutputSession("s")
    a, b = session.bind("a"), session.bind("b")
    a.put(output("a", [5]))
    b.put(output("b", [6]))
    assert session.take(0.0) is not None  # nothing is held back from a sender that looks
    a.put(output("a", [5, 7]))
    b.put(output("b", [6, 8]))
    taken: list[list[output_sessions.Sent]] = []
    sender = threading.Thread(target=lambda: taken.append(session.take(30.0) or []))
    sender.start()
    sender.join(0.2)
    assert sender.is_alive()  # not woken mid-step
    session.wake()  # the step's outputs are all delivered
    sender.join(5.0)
    assert [(s.request_id, s.item.new_token_ids) for s in taken[0]] == [("a", [7]), ("b", [8])]


def test_a_requests_last_output_wakes_the_sender_and_its_wait_ends_once_sent():
    from decode_worker import service

    session = OutputSession("s")
    sink = session.bind("a")
    sink.note_admission(0.25)
    waiter = threading.Thread(target=sink.wait, daemon=True)
    waiter.start()
    sink.put(output("a", [5, 6], finished=True))
    taken = session.take(5.0)
    assert taken is not None and [s.request_id for s in taken] == ["a"]
    assert taken[0].sink.admission_s == 0.25
    waiter.join(0.2)
    assert waiter.is_alive()  # queued is not sent: DecodeInto answers after the message
    assert len(list(service._batches(taken))) == 1
    waiter.join(5.0)
    assert not waiter.is_alive() and sink.error is None
    assert session.close() == []  # it finished: nothing is left to abort


def test_a_paused_request_ends_its_wait_once_sent_and_is_not_aborted_with_the_session():
    from decode_worker import service

    session = OutputSession("s")
    sink = session.bind("a")
    waiter = threading.Thread(target=sink.wait, daemon=True)
    waiter.start()
    sink.put(Paused("a"))
    assert sink.paused
    taken = session.take(5.0)
    assert taken is not None and isinstance(taken[0].item, Paused)
    waiter.join(0.2)
    assert waiter.is_alive()  # its pause is not sent yet
    list(service._batches(taken))
    waiter.join(5.0)
    assert not waiter.is_alive() and sink.error is None
    assert session.close() == []


def test_nothing_more_of_a_request_is_sent_once_one_of_its_chunks_failed(monkeypatch):
    from decode_worker import service

    session = OutputSession("s")
    sink = session.bind("a")
    monkeypatch.setattr(service, "BATCH_BYTES", 20)
    huge = output("a", [7])  # a first chunk: its prompt's logprobs go with it
    huge.prompt_token_ids = [1, 2, 3, 4]
    huge.prompt_logprobs = [None] + [{t: -0.5 * t for t in range(2, 12)}] * 3
    sink.put(huge)
    sink.put(output("a", [7, 8], finished=True))  # a lagging sender takes both at once
    taken = session.take(5.0)
    assert taken is not None and len(taken) == 2
    assert list(service._batches(taken)) == []  # not a finish that hides the failure
    with pytest.raises(service.OutputTooLarge):
        sink.wait()
    sink.put(output("a", [7, 8, 9]))
    assert session.take(0.0) == []
    assert session.close() == []


def test_a_decode_into_call_that_ends_ends_its_wait_and_aborts_a_running_request():
    from decode_worker import service

    aborted: list[str] = []
    servicer = service.DecodeWorkerServicer.__new__(service.DecodeWorkerServicer)
    servicer.worker = type("Worker", (), {"abort_later": lambda self, rid: aborted.append(rid)})()
    session = OutputSession("s")
    running, finished, paused = session.bind("r"), session.bind("f"), session.bind("p")
    finished.put(output("f", [5], finished=True))  # queued, and its call was cancelled
    paused.put(Paused("p"))
    for sink in (running, finished, paused):
        servicer._call_ended(sink)
        with pytest.raises(RuntimeError, match="its DecodeInto call ended"):
            sink.wait()
    assert aborted == ["r", "f"]  # a paused request stays parked to move
    assert list(service._batches(session.take(0.0) or [])) == []
    assert session.close() == []


def test_a_last_chunk_the_session_never_sent_fails_its_wait():
    session = OutputSession("s")
    sink = session.bind("a")
    sink.put(output("a", [5, 6], finished=True))
    assert session.close() == []
    with pytest.raises(RuntimeError, match="closed before request a's last chunk was sent"):
        sink.wait()
    late = OutputSession("t")
    after_close = late.bind("b")
    late.close()
    after_close.put(output("b", [7], finished=True))  # the session closed under it
    with pytest.raises(RuntimeError, match="closed before request b's last chunk"):
        after_close.wait()


def test_a_failed_request_raises_in_its_wait_and_sends_nothing():
    session = OutputSession("s")
    sink = session.bind("a")
    sink.put(RuntimeError("aborted"))
    with pytest.raises(RuntimeError, match="aborted"):
        sink.wait()
    assert session.take(0.0) == []


def test_closing_names_the_requests_still_bound_and_ends_the_sender():
    session = OutputSession("s")
    session.bind("a").put(output("a", [5]))
    session.bind("b")
    refused = session.bind("c")
    refused.detach()
    assert session.close() == ["a", "b"]
    assert session.take(5.0) is None
    session.push(output_sessions.Sent("a", output("a", [5, 6]), refused))
    assert session.take(0.0) is None  # outputs after the close go nowhere
    with pytest.raises(ValueError, match="closed"):
        session.bind("d")


def test_a_stalled_request_times_out(monkeypatch):
    monkeypatch.setattr(output_sessions, "STALL_TIMEOUT_S", 0.05)
    sink = OutputSession("s").bind("a")
    with pytest.raises(TimeoutError, match="no output"):
        sink.wait()
    with pytest.raises(TimeoutError, match="no output"):
        next(QueueSink().drain())


def test_sessions_by_id_replace_and_close():
    sessions = OutputSessions()
    with pytest.raises(ValueError, match="1 to 64 characters"):
        sessions.open("")
    with pytest.raises(ValueError, match="1 to 64 characters, got 65"):
        sessions.open("x" * 65)
    first, orphans = sessions.open("s")
    assert orphans == []
    first.bind("a")
    second, orphans = sessions.open("s")
    assert orphans == ["a"] and sessions.get("s") is second
    assert sessions.close(first) == []  # already replaced: the open one stays
    assert sessions.get("s") is second
    assert sessions.close(second) == [] and sessions.get("s") is None


def test_the_queue_sink_streams_until_the_end():
    sink = QueueSink()
    sink.put(output("a", [5]))
    sink.put(output("a", [5, 6], finished=True))
    sink.put(output("a", [5, 6, 7]))  # never read: the stream ended
    assert [o.new_token_ids for o in sink.drain()] == [[5], [6]]
    failing = QueueSink()
    failing.put(RuntimeError("gone"))
    with pytest.raises(RuntimeError, match="gone"):
        list(failing.drain())


def test_a_steps_chunks_split_below_the_message_limit_and_an_oversized_one_fails_alone(
        monkeypatch):
    from decode_worker import service

    session = OutputSession("s")
    sinks = {rid: session.bind(rid) for rid in ("a", "b", "c", "big")}
    monkeypatch.setattr(service, "BATCH_BYTES", 20)  # two 8-byte chunks fit, not three
    for rid in ("a", "b"):
        sinks[rid].put(output(rid, [5, 6]))
    huge = output("big", [7], finished=True)  # a first chunk: its prompt's logprobs go with it
    huge.prompt_token_ids = [1, 2, 3, 4]
    huge.prompt_logprobs = [None] + [{t: -0.5 * t for t in range(2, 12)}] * 3
    sinks["big"].put(huge)  # its last: queued, but the sender cannot send it
    sinks["c"].put(output("c", [8]))
    ended: list[BaseException | None] = []
    waiter = threading.Thread(target=lambda: ended.append(wait_outcome(sinks["big"])),
                              daemon=True)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # queued is not sent
    taken = session.take(5.0)
    assert taken is not None
    batches = list(service._batches(taken))
    assert [[part.request_id for part in b.chunks] for b in batches] == [["a", "b"], ["c"]]
    assert all(b.ByteSize() <= 20 for b in batches)
    waiter.join(5.0)
    # its call says why, not a success with the chunk lost
    assert isinstance(ended[0], service.OutputTooLarge)
    assert "a chunk of request big is" in str(ended[0])
    assert session.close() == ["a", "b", "c"]  # the others go on


def test_a_chunk_that_cannot_be_encoded_fails_its_request_alone():
    from decode_worker import service

    session = OutputSession("s")
    good, bad = session.bind("good"), session.bind("bad")
    broken = output("bad", [5])
    broken.new_token_ids = ["not a token id"]  # type: ignore[list-item]
    batches = list(service._batches([output_sessions.Sent("bad", broken, bad),
                                     output_sessions.Sent("good", output("good", [6]), good)]))
    assert [[p.request_id for p in b.chunks] for b in batches] == [["good"]]
    with pytest.raises(RuntimeError, match="could not be encoded"):
        bad.wait()
