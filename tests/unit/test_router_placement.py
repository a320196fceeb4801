from __future__ import annotations

from router.placement import PlacementPolicy
from router.registry import Role, Worker, WorkerLoad, WorkerRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def worker(wid: str, role: Role, free: int = 100, queued: int = 0) -> Worker:
    return Worker(wid, role, f"127.0.0.1:{hash(wid) % 1000 + 5000}", block_size=16,
                  max_model_len=8192,
                  load=WorkerLoad(queued_prompt_tokens=queued, free_blocks=free, total_blocks=100))


def make(clock: Clock | None = None) -> tuple[WorkerRegistry, PlacementPolicy]:
    registry = WorkerRegistry(heartbeat_timeout_s=3.0, clock=clock or Clock())
    return registry, PlacementPolicy(registry)


def test_prefill_goes_to_least_queued_and_load_is_charged_at_placement():
    registry, policy = make()
    registry.register(worker("p0", Role.PREFILL, queued=0))
    registry.register(worker("p1", Role.PREFILL, queued=100))
    picks = [policy.place_prefill(1500)[0].worker_id for _ in range(3)]
    # p0 takes the first long prompt; with 1500 tokens charged to it, p1 is next, and so on.
    assert picks == ["p0", "p1", "p0"]


def test_release_returns_the_charge():
    registry, policy = make()
    registry.register(worker("p0", Role.PREFILL))
    registry.register(worker("p1", Role.PREFILL, queued=10))
    placed, charge = policy.place_prefill(500)
    assert placed.worker_id == "p0"
    policy.release(charge)
    assert policy.place_prefill(5)[0].worker_id == "p0"


def test_decode_goes_to_most_free_blocks_that_fit():
    registry, policy = make()
    registry.register(worker("d0", Role.DECODE, free=40))
    registry.register(worker("d1", Role.DECODE, free=60))
    placed, charge = policy.place_decode(16 * 30)  # 30 blocks
    assert placed.worker_id == "d1" and charge.blocks == 30
    # d1 now has 30 effective free blocks, d0 has 40.
    assert policy.place_decode(16 * 35)[0].worker_id == "d0"
    assert policy.place_decode(16 * 35) is None  # nobody can hold 35 blocks any more


def test_dead_and_draining_workers_are_not_placed():
    clock = Clock()
    registry, policy = make(clock)
    registry.register(worker("d0", Role.DECODE, free=90))
    registry.register(worker("d1", Role.DECODE, free=10))
    clock.now += 2.0
    assert registry.heartbeat("d1", WorkerLoad(free_blocks=10, total_blocks=100))
    clock.now += 1.5  # d0 silent for 3.5 s > 3 s timeout
    assert policy.place_decode(16)[0].worker_id == "d1"
    assert [w.worker_id for w in registry.drop_dead()] == ["d0"]
    assert not registry.heartbeat("d0", WorkerLoad())  # unknown now: must re-register
    registry.heartbeat("d1", WorkerLoad(free_blocks=10, total_blocks=100), draining=True)
    assert policy.place_decode(16) is None


def test_colocated_workers_serve_both_roles_and_exclusions_apply():
    registry, policy = make()
    registry.register(worker("c0", Role.COLOCATED))
    registry.register(worker("p0", Role.PREFILL, queued=50))
    assert policy.place_decode(16)[0].worker_id == "c0"
    assert policy.place_prefill(10, exclude=frozenset({"c0"}))[0].worker_id == "p0"
    assert policy.place_prefill(10, exclude=frozenset({"c0", "p0"})) is None
