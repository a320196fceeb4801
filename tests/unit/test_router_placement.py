from __future__ import annotations

import pytest

from pdserve_proto import pdserve_pb2 as pb
from router.fleet.registry import Role, Worker, WorkerLoad, WorkerRegistry
from router.policy.placement import PlacementPolicy


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
    clock = clock or Clock()
    registry = WorkerRegistry(heartbeat_timeout_s=3.0, clock=clock)
    return registry, PlacementPolicy(registry, clock=clock)


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


# ---- cache-aware placement ------------------------------------------------------------------
def _keys(tokens: list[int]) -> list[int]:
    from engine.block_manager import prefix_hashes

    return prefix_hashes(tokens, 16)


def test_prefill_prefers_the_worker_caching_the_prompt_start_against_its_queue():
    registry, policy = make()
    prompt = list(range(320))  # 20 blocks
    keys = _keys(prompt)
    registry.register(worker("p0", Role.PREFILL, queued=100))
    cached = worker("p1", Role.PREFILL, queued=200)
    cached.prefix_hashes = frozenset(keys[:16])  # 256 tokens cached
    registry.register(cached)
    placed, charge = policy.place_prefill(320, keys=keys)
    # p1: 200 queued + 64 to compute < p0: 100 + 320.
    assert placed.worker_id == "p1" and charge.prompt_tokens == 64
    policy.release(charge)
    loaded = worker("p1", Role.PREFILL, queued=500)
    loaded.prefix_hashes = frozenset(keys[:16])
    registry.register(loaded)
    assert policy.place_prefill(320, keys=keys)[0].worker_id == "p0"  # 564 > 420


def test_only_a_leading_run_of_cached_blocks_counts():
    registry, policy = make()
    keys = _keys(list(range(64)))
    w = worker("p0", Role.PREFILL)
    w.prefix_hashes = frozenset(keys[1:])  # everything but the first block: no usable prefix
    registry.register(w)
    assert policy.cached_tokens(registry.get("p0"), keys, 64) == 0
    w.prefix_hashes = frozenset(keys)
    assert policy.cached_tokens(w, keys, 64) == 63  # the last token is always computed


def test_a_placed_prompt_counts_as_cached_there_until_it_expires():
    clock = Clock()
    registry, policy = make(clock)
    keys = _keys(list(range(1024)))
    registry.register(worker("p0", Role.PREFILL))
    registry.register(worker("p1", Role.PREFILL))
    first, charge = policy.place_prefill(1024, keys=keys)
    policy.release(charge)
    # The same system prompt again: it follows the first before any digest reports it.
    assert policy.place_prefill(1024, keys=keys)[0].worker_id == first.worker_id
    clock.now += 60
    assert policy.cached_tokens(registry.get(first.worker_id), keys, 1024) == 0


def test_load_only_placement_ignores_prefix_caches():
    registry = WorkerRegistry(heartbeat_timeout_s=3.0, clock=Clock())
    policy = PlacementPolicy(registry, cache_aware=False)
    keys = _keys(list(range(320)))
    registry.register(worker("p0", Role.PREFILL, queued=100))
    cached = worker("p1", Role.PREFILL, queued=200)
    cached.prefix_hashes = frozenset(keys)
    registry.register(cached)
    assert policy.keys(list(range(320))) == []
    assert policy.place_prefill(320, keys=keys)[0].worker_id == "p0"


def test_decode_counts_cached_prompt_blocks_as_room():
    registry, policy = make()
    keys = _keys(list(range(320)))
    registry.register(worker("d0", Role.DECODE, free=50))
    cached = worker("d1", Role.DECODE, free=40)
    cached.prefix_hashes = frozenset(keys)  # 19 usable blocks cached
    registry.register(cached)
    assert policy.place_decode(400, keys=keys)[0].worker_id == "d1"


def test_site_inputs_report_the_best_pool_worker_and_the_decode_side():
    registry, policy = make()
    keys = _keys(list(range(320)))
    registry.register(worker("p0", Role.PREFILL, queued=1000))
    registry.register(worker("p1", Role.PREFILL, queued=700))
    decode = worker("d0", Role.DECODE, queued=30)
    decode.prefix_hashes = frozenset(keys[:4])
    decode.prefill_chunk_tokens = 32
    registry.register(decode)
    inputs = policy.site_inputs(320, registry.get("d0"), frozenset(), keys)
    assert (inputs.prompt_tokens, inputs.decode_cached_tokens, inputs.decode_queued_tokens,
            inputs.pool_tokens, inputs.decode_chunk_tokens) == (320, 64, 30, 1020, 32)
    assert policy.site_inputs(320, registry.get("d0"), frozenset({"p0", "p1"}),
                              keys).pool_tokens is None


def test_a_worker_whose_kv_layout_its_peers_cannot_exchange_is_refused_at_registration():
    from dataclasses import replace

    import pytest

    from router.fleet.registry import KVLayoutMismatch

    fp32 = "layers=2 block_size=16 kv_heads=4 head_dim=8 dtype=float32"
    registry = WorkerRegistry()
    registry.register(replace(worker("d0", Role.DECODE), kv_layout=fp32, tensor_parallel_size=2))
    registry.register(replace(worker("p0", Role.PREFILL), kv_layout=fp32))  # TP may differ
    with pytest.raises(KVLayoutMismatch, match=r"prefill worker p1's KV cache is \[.*bfloat16\] "
                                                r"but decode worker d0's is"):
        registry.register(replace(worker("p1", Role.PREFILL),
                                  kv_layout=fp32.replace("float32", "bfloat16")))
    with pytest.raises(KVLayoutMismatch, match="block_size=32"):
        registry.register(replace(worker("d1", Role.DECODE),
                                  kv_layout=fp32.replace("16", "32")))
    # a colocated worker's KV never moves; a worker re-registering is not its own peer
    registry.register(replace(worker("c0", Role.COLOCATED), kv_layout="layers=9"))
    registry.register(replace(worker("d0", Role.DECODE), kv_layout=fp32))
    assert sorted(w.worker_id for w in registry.snapshot()) == ["c0", "d0", "p0"]


def test_a_worker_registers_its_prefill_chunk():
    """What conditional disaggregation counts a decode worker's steps by (0: not said)."""
    from router.fleet.registry_service import _worker

    def registered(**fields: object) -> Worker:
        return _worker(pb.RegisterRequest(worker_id="d0", role=pb.WORKER_ROLE_DECODE,
                                          address="127.0.0.1:1", block_size=16,
                                          max_model_len=2048, **fields))

    assert registered(prefill_chunk_tokens=32).prefill_chunk_tokens == 32
    assert registered().prefill_chunk_tokens == 0


class Refused(Exception):
    pass


class Context:
    def abort(self, code: object, message: str) -> None:
        raise Refused(code, message)


def test_registration_and_heartbeats_refuse_what_placement_cannot_use():
    """A worker of no context length would never be placed; a prefix digest beyond the proto's
    32,768 keys is refused, not held as a set of millions at every heartbeat."""
    import grpc

    from router.fleet.registry_service import MAX_PREFIX_KEYS, WorkerRegistryServicer

    servicer = WorkerRegistryServicer(WorkerRegistry(), "m", 0.5)
    fields = dict(worker_id="d0", role=pb.WORKER_ROLE_DECODE, address="127.0.0.1:1",
                  block_size=16, model="m")
    with pytest.raises(Refused, match="max_model_len >= 1"):
        servicer.Register(pb.RegisterRequest(**fields), Context())
    servicer.Register(pb.RegisterRequest(max_model_len=2048, **fields), Context())
    digest = pb.WorkerLoad(prefix=pb.PrefixDigest(block_hashes=range(MAX_PREFIX_KEYS + 1)))
    with pytest.raises(Refused) as info:
        servicer.Heartbeat(pb.HeartbeatRequest(worker_id="d0", load=digest), Context())
    assert info.value.args[0] is grpc.StatusCode.INVALID_ARGUMENT
    assert "load.prefix.block_hashes has 32769 keys; the limit is 32768" in info.value.args[1]
    within = pb.WorkerLoad(prefix=pb.PrefixDigest(block_hashes=range(MAX_PREFIX_KEYS)))
    assert servicer.Heartbeat(pb.HeartbeatRequest(worker_id="d0", load=within), Context()).known


def test_a_live_workers_id_is_not_taken_over_by_another_process():
    import dataclasses

    from router.fleet.registry import WorkerIdTaken

    clock = Clock()
    registry, _ = make(clock)
    first = worker("d0", Role.DECODE)
    registry.register(first)
    registry.register(dataclasses.replace(first))  # the same process again: renewed
    impostor = dataclasses.replace(first, address="127.0.0.1:9")
    with pytest.raises(WorkerIdTaken, match="held by a live worker at 127.0.0.1:"):
        registry.register(impostor)
    assert registry.get("d0").address == first.address
    clock.now += 3.5  # the first missed its heartbeats: the id is free again
    registry.register(impostor)
    assert registry.get("d0").address == "127.0.0.1:9"


def test_an_operators_drain_outlives_a_drop_for_missed_heartbeats():
    """A drained worker cut off for a moment and back again stays drained until undone."""
    clock = Clock()
    registry, _ = make(clock)
    registry.register(worker("d0", Role.DECODE))
    assert registry.drain("d0").operator_drained
    clock.now += 3.5
    assert [w.worker_id for w in registry.drop_dead()] == ["d0"]
    registry.register(worker("d0", Role.DECODE))  # the partition healed
    assert registry.get("d0").operator_drained
    assert not registry.drain("d0", drained=False).operator_drained
    clock.now += 3.5
    registry.drop_dead()
    registry.register(worker("d0", Role.DECODE))
    assert not registry.get("d0").operator_drained


@pytest.mark.parametrize(("address", "message"), [
    ("0.0.0.0:5000", "give the worker --advertise-host"),
    ("[::]:5000", "give the worker --advertise-host"),
    ("worker-host", "needs host:port"),
    ("worker-host:0", "needs host:port"),
])
def test_a_worker_address_the_router_cannot_call_is_refused(address, message):
    from router.fleet.registry_service import WorkerRegistryServicer

    servicer = WorkerRegistryServicer(WorkerRegistry(), "m", 0.5)
    request = pb.RegisterRequest(worker_id="d0", role=pb.WORKER_ROLE_DECODE, address=address,
                                 block_size=16, model="m", max_model_len=2048)
    with pytest.raises(Refused, match=message):
        servicer.Register(request, Context())
