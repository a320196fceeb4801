"""The reservation table's safety rule for one-sided writes, without a model: a reservation's
blocks are released only when no write into them can still land. Each race is injected by hand,
in a fixed order, against a fake clock."""

from __future__ import annotations

import pytest

from decode_worker.reservations import LeaseState, ReservationTable
from engine.request import Request, SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[ReservationTable, list[str], Clock]:
    released: list[str] = []
    clock = Clock()
    table = ReservationTable(release=lambda r: released.append(r.request_id), clock=clock)
    return table, released, clock


def reserve(table: ReservationTable, rid: str, lease_s: float = 5.0) -> Request:
    request = Request(rid, [1, 2, 3], SamplingParams(max_tokens=4))
    table.add(request, lease_s)
    return request


def test_abort_during_a_write_waits_for_the_writer_then_frees():
    table, released, _ = make()
    reserve(table, "r1")
    table.begin_receive("r1", writer="prefill-0#1")
    assert table.abort("r1")  # the router gave up on the request mid-write
    assert released == [], "blocks freed while the writer may still write into them"
    assert table.writer_of("r1") == "prefill-0#1"
    assert table.end_receive("r1", ok=True) is False  # the write ended: now they go
    assert released == ["r1"] and "r1" not in table


def test_lease_expiry_during_a_write_does_not_free_and_restarts_after_it():
    table, released, clock = make()
    reserve(table, "r1", lease_s=5.0)
    table.begin_receive("r1", writer="prefill-0#1")
    clock.now = 60.0  # far past the lease while the write is in flight
    assert table.expire() == [] and released == []
    assert table.end_receive("r1", ok=True) is True  # KV complete: the lease starts again
    clock.now = 64.0
    assert table.expire() == []
    clock.now = 65.5
    assert table.expire() == ["r1"] and released == ["r1"]


def test_a_dead_writer_ends_only_its_own_writes():
    table, released, _ = make()
    for rid in ("a", "b", "c", "d"):
        reserve(table, rid)
    table.begin_receive("a", writer="prefill-0#1")
    table.begin_receive("b", writer="prefill-0#1")
    table.begin_receive("c", writer="prefill-1#2")  # another writer's write goes on
    assert table.writer_gone("prefill-0#1") == ["a", "b"]
    assert released == ["a", "b"]
    assert table.writer_of("c") == "prefill-1#2" and "d" in table
    assert table.writer_gone("prefill-0#1") == []  # a second close changes nothing
    assert table.writer_gone("") == []  # our own receives are never ended this way


def test_a_write_cannot_begin_on_blocks_that_are_not_reserved_now():
    table, released, clock = make()
    reserve(table, "r1", lease_s=1.0)
    clock.now = 2.0
    assert table.expire() == ["r1"]
    with pytest.raises(KeyError):  # the lease ran out first: the writer must not write
        table.begin_receive("r1", writer="prefill-0#1")
    reserve(table, "r2")
    table.abort("r2")
    with pytest.raises(KeyError):
        table.begin_receive("r2", writer="prefill-0#1")
    reserve(table, "r3")
    table.begin_receive("r3", writer="prefill-0#1")
    with pytest.raises(KeyError):  # one writer at a time
        table.begin_receive("r3", writer="prefill-1#2")
    assert table.writer_of("r3") == "prefill-0#1"


def test_a_failed_write_frees_and_a_ready_reservation_is_taken_once():
    table, released, _ = make()
    reserve(table, "bad")
    table.begin_receive("bad", writer="w#1")
    assert table.end_receive("bad", ok=False) is False and released == ["bad"]
    reserve(table, "good")
    table.begin_receive("good", writer="w#1")
    assert table.end_receive("good", ok=True)
    assert table.writer_of("good") is None  # READY: no write can land any more
    assert table.writer_gone("w#1") == []  # the mapping closing later frees nothing ready
    assert table.take_ready("good").request_id == "good"
    assert "good" not in table and released == ["bad"]
    assert LeaseState.READY.value == "ready"


def test_pieces_arrive_in_order_and_only_the_last_makes_the_kv_ready():
    table, released, clock = make()
    reserve(table, "r1", lease_s=5.0)
    table.begin_receive("r1", first_block=0)
    assert table.end_receive("r1", ok=True, more_after=4)  # blocks 0-3 landed, more to come
    with pytest.raises(ValueError, match="first_block is 2; request 'r1' has received 4 blocks"):
        table.begin_receive("r1", first_block=2)  # out of order: refused, nothing changes
    with pytest.raises(KeyError, match="no KV yet"):
        table.take_ready("r1")
    table.begin_receive("r1", first_block=4)
    assert table.end_receive("r1", ok=True)  # the last piece
    assert table.take_ready("r1").request_id == "r1" and released == []


def test_between_pieces_the_lease_runs_and_an_abort_frees_at_once():
    table, released, clock = make()
    reserve(table, "r1", lease_s=5.0)
    reserve(table, "r2", lease_s=5.0)
    for rid in ("r1", "r2"):
        table.begin_receive(rid)
        clock.now = 3.0
        table.end_receive(rid, ok=True, more_after=2)  # the lease restarts: until 8.0
    assert table.abort("r1") and released == ["r1"]  # no write in flight between pieces
    clock.now = 7.9
    assert table.expire() == []
    clock.now = 8.0  # the sender vanished after its first piece: the lease ends it
    assert table.expire() == ["r2"] and released == ["r1", "r2"]


def test_a_failed_piece_frees_the_reservation():
    table, released, _ = make()
    reserve(table, "r1")
    table.begin_receive("r1")
    table.end_receive("r1", ok=True, more_after=3)
    table.begin_receive("r1", first_block=3)
    assert table.end_receive("r1", ok=False) is False and released == ["r1"]


def test_only_the_transfer_presenting_the_reservations_secret_may_write():
    table, released, _ = make()
    request = Request("r1", [1, 2, 3], SamplingParams(max_tokens=4))
    table.add(request, 5.0, secret="the-routers-secret")
    with pytest.raises(PermissionError, match="wrong transfer secret"):
        table.begin_receive("r1", writer="rogue#1", secret="a-guess")
    with pytest.raises(PermissionError):
        table.begin_receive("r1")  # none at all
    assert table.writer_of("r1") is None and released == []  # still reserved, untouched
    table.begin_receive("r1", writer="prefill-0#1", secret="the-routers-secret")
    assert table.end_receive("r1", ok=True) and table.take_ready("r1") is request


def test_a_refused_piece_leaves_the_reservation_as_it_was_and_an_abort_still_frees():
    """Bytes refused before any was written (their MAC did not match): RESERVED again at the
    same place in the stream, lease restarted; with an abort meanwhile, freed at once."""
    table, released, clock = make()
    reserve(table, "r1", lease_s=5.0)
    reserve(table, "r2", lease_s=5.0)
    table.begin_receive("r2")  # receiving: its lease does not run
    table.begin_receive("r1")
    table.end_receive("r1", ok=True, more_after=2)
    table.begin_receive("r1", first_block=2)
    clock.now = 4.0
    assert table.refuse_receive("r1") is True and released == []
    assert table.writer_of("r1") is None
    with pytest.raises(ValueError, match="has received 2 blocks"):
        table.begin_receive("r1", first_block=3)  # the refused piece counted for nothing
    clock.now = 8.9
    assert table.expire() == []  # the lease restarted at the refusal: until 9.0
    assert table.abort("r2") and released == []
    assert table.refuse_receive("r2") is False and released == ["r2"]
    clock.now = 9.0
    assert table.expire() == ["r1"] and released == ["r2", "r1"]
