"""Which running requests move, without processes: the move policy (drain, operator, rebalance)
over decode sites and live streams, the streams' bookkeeping, and the handover a target
reserves."""

from __future__ import annotations

import pytest

from router.policy.moves import DecodeSite, LiveStream, MovePolicy, RebalanceConfig
from router.request.live_streams import LiveStreams


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def site(worker_id: str, used: int, total: int = 100, leaving: str = "") -> DecodeSite:
    return DecodeSite(worker_id, total - used, total, 16, leaving)


def stream(rid: str, worker_id: str, tokens: int = 64, remaining: int = 100) -> LiveStream:
    return LiveStream(rid, worker_id, tokens, remaining, movable=True)


def test_a_draining_worker_hands_every_stream_to_the_others():
    policy = MovePolicy(RebalanceConfig(threshold=0))
    streams = [stream("a", "d0"), stream("b", "d0"), stream("c", "d1")]
    moves = policy.choose([site("d0", 10, leaving="drain"), site("d1", 90)], streams)
    assert {(m.request_id, m.cause) for m in moves} == {("a", "drain"), ("b", "drain")}
    operator = policy.choose([site("d0", 10), site("d1", 10, leaving="operator")], streams)
    assert [(m.request_id, m.cause) for m in operator] == [("c", "operator")]


def test_with_nowhere_to_go_nothing_moves():
    policy = MovePolicy()
    streams = [stream("a", "d0")]
    assert policy.choose([site("d0", 99, leaving="drain")], streams) == []
    assert policy.choose([site("d0", 99, leaving="drain"), site("d1", 0, leaving="operator")],
                         streams) == []
    assert policy.choose([site("d0", 99)], streams) == []  # full, but alone


def test_a_full_worker_moves_the_streams_that_grow_most_until_back_under_target():
    clock = Clock()
    policy = MovePolicy(RebalanceConfig(threshold=0.9, target=0.6, cooldown_s=1.0), clock)
    streams = [stream(f"r{i}", "d0", tokens=160, remaining=10 * i) for i in range(6)]
    # d0: 95 of 100 blocks used; each stream holds 10 blocks: 4 must go to reach 60
    moves = policy.choose([site("d0", 95), site("d1", 0)], streams)
    assert [m.request_id for m in moves] == ["r5", "r4", "r3", "r2"]
    assert {m.cause for m in moves} == {"rebalance"}
    assert policy.choose([site("d0", 95), site("d1", 0)], streams) == []  # cooling down
    clock.now += 1.5
    assert len(policy.choose([site("d0", 95), site("d1", 0)], streams)) == 4


def test_a_target_takes_only_what_keeps_it_under_target():
    policy = MovePolicy(RebalanceConfig(threshold=0.9, target=0.6))
    streams = [stream(f"r{i}", "d0", tokens=160) for i in range(6)]
    moves = policy.choose([site("d0", 95), site("d1", 45)], streams)  # room for 15 blocks
    assert len(moves) == 1
    assert policy.choose([site("d0", 95), site("d1", 55)], streams) == []
    assert policy.choose([site("d0", 80), site("d1", 0)], streams) == []  # under threshold


def test_rebalance_config_names_its_limits():
    with pytest.raises(ValueError, match="rebalance-threshold"):
        RebalanceConfig(threshold=1.5)
    with pytest.raises(ValueError, match="target"):
        RebalanceConfig(threshold=0.5, target=0.7)
    assert RebalanceConfig(threshold=0.9).target == pytest.approx(0.8)
    assert RebalanceConfig(threshold=0.1).target == pytest.approx(0.05)


def test_live_streams_ask_once_and_back_off_after_a_refusal():
    clock = Clock()
    streams = LiveStreams(clock)
    streams.open(stream("a", "d0"))
    streams.open(LiveStream("b", "d0", 10, 10, movable=False))  # constrained: never asked
    assert [s.request_id for s in streams.snapshot()] == ["a"]
    assert streams.ask("a", "drain") and not streams.ask("a", "drain")
    assert streams.snapshot() == []  # asked already
    streams.refused("a")
    assert streams.snapshot() == []
    clock.now += 3.0
    assert [s.request_id for s in streams.snapshot()] == ["a"]
    streams.grow("a", 5)
    assert streams.snapshot()[0].tokens == 69 and streams.snapshot()[0].remaining == 95
    assert streams.ask("a", "rebalance") and streams.close("a") == "rebalance"
    assert streams.close("a") == "" and streams.count("d0") == 1 and not streams.ask("z", "x")
