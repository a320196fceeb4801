"""Which KV transport a (prefill, decode) pair gets, and which pairs are refused — plain Python,
no model, no GPU: the places are strings as the workers register them."""

from __future__ import annotations

import pytest

from kv_transfer.selection import KVPlace, TransportRefused, choose_transport, local_host_id
from router.fleet.registry import Role, Worker, WorkerLoad, WorkerRegistry
from router.policy.placement import PlacementPolicy

GPU0, GPU1 = "cuda:GPU-0a1b", "cuda:GPU-9f8e"


def place(wid: str, host: str = "hostA", device: str = "cpu", mode: str = "auto") -> KVPlace:
    return KVPlace(wid, host, device, mode)


@pytest.mark.parametrize("sender,receiver,expected", [
    (place("p", "hostA"), place("d", "hostA"), "shared"),  # same host, CPU
    (place("p", "hostA"), place("d", "hostB"), "dist"),  # other host, CPU: gloo
    (place("p", device=GPU0), place("d", device=GPU0), "shared"),  # one GPU: CUDA IPC
    (place("p", device=GPU0), place("d", device=GPU1), "shared"),  # two GPUs of one host
    (place("p", "hostA", GPU0), place("d", "hostB", GPU0), "dist"),  # other host: NCCL
    (place("p", device=GPU0, mode="dist"), place("d", device=GPU1), "dist"),  # forced
    (place("p", mode="dist"), place("d"), "dist"),  # forced on CPU, same host: gloo works
    (place("p", "hostA", mode="auto"), place("d", "hostA", mode="shared"), "shared"),
    (place("p", device=GPU0), place("d", device="cpu"), "shared"),  # GPU -> CPU copy
])
def test_transport_follows_where_the_workers_are(sender, receiver, expected):
    assert choose_transport(sender, receiver) == expected


@pytest.mark.parametrize("sender,receiver,reason", [
    (place("p", device=GPU0, mode="dist"), place("d", device=GPU0), "cannot put two ranks"),
    (place("p", device=GPU0), place("d", device=GPU0, mode="dist"), "cannot put two ranks"),
    (place("p", "hostA", mode="shared"), place("d", "hostB"), "needs both workers on one host"),
    (place("p", "hostA"), place("d", "hostB", mode="shared"), "needs both workers on one host"),
    (place("p", mode="shared"), place("d", mode="dist"), "forces --kv-transport shared"),
    (place("p", "hostA", GPU0), place("d", "hostB", "cpu"), "gloo"),
    (place("p", "", mode="shared"), place("d", ""), "needs both workers on one host"),
])
def test_placements_that_can_never_work_are_refused_naming_both_workers(sender, receiver,
                                                                        reason):
    with pytest.raises(TransportRefused) as refused:
        choose_transport(sender, receiver)
    assert reason in str(refused.value)
    assert "p -> d" in str(refused.value)


def test_unknown_mode_is_refused_and_host_id_is_stable(monkeypatch):
    with pytest.raises(ValueError, match="kv_transport must be one of"):
        place("p", mode="nccl")
    monkeypatch.delenv("PDSERVE_HOST_ID", raising=False)
    assert local_host_id() == local_host_id() != ""
    monkeypatch.setenv("PDSERVE_HOST_ID", "rack7-node3")
    assert local_host_id() == "rack7-node3"


def worker(wid: str, role: Role, host: str = "hostA", device: str = "cpu", mode: str = "auto"
           ) -> Worker:
    return Worker(wid, role, f"127.0.0.1:{5000 + len(wid)}", block_size=16, max_model_len=8192,
                  load=WorkerLoad(free_blocks=100, total_blocks=100), host_id=host,
                  kv_device=device, kv_transport=mode)


def test_router_places_only_pairs_that_can_move_kv():
    registry = WorkerRegistry()
    policy = PlacementPolicy(registry)
    registry.register(worker("p-gpu0", Role.PREFILL, device=GPU0, mode="dist"))
    registry.register(worker("p-gpu1", Role.PREFILL, device=GPU1, mode="dist"))
    registry.register(worker("d-gpu0", Role.DECODE, device=GPU0))
    decode = registry.get("d-gpu0")
    assert policy.refusal(registry.get("p-gpu0"), decode) is not None
    for _ in range(3):  # p-gpu0 is less loaded, but can never reach d-gpu0
        assert policy.place_prefill(10, decode=decode)[0].worker_id == "p-gpu1"
    assert policy.unpairable() is None


def test_no_workable_pair_is_reported_with_every_reason_and_broken_pairs_are_avoided():
    now = [100.0]
    registry = WorkerRegistry(clock=lambda: now[0])
    policy = PlacementPolicy(registry)
    registry.register(worker("p0", Role.PREFILL, device=GPU0, mode="dist"))
    registry.register(worker("d0", Role.DECODE, device=GPU0))
    why = policy.unpairable()
    assert why is not None and "p0 -> d0" in why and "two ranks on one GPU" in why
    assert policy.place_decode(100, roles=(Role.DECODE,), paired=True) is None
    registry.register(worker("p1", Role.PREFILL))  # a CPU prefill on the same host: shared
    registry.register(worker("d1", Role.DECODE))
    assert policy.unpairable() is None
    d1 = registry.get("d1")
    assert policy.place_prefill(10, decode=d1)[0].worker_id in ("p0", "p1")
    p1 = registry.get("p1")
    assert policy.transport(p1, d1) == "shared"
    # shared cannot work for this pair (its cache cannot be mapped from p1): dist instead
    policy.mark_broken(p1, d1, "shared", "cannot map d1's cache")
    assert policy.refusal(p1, d1) is None and policy.transport(p1, d1) == "dist"
    policy.mark_broken(p1, d1, "dist", "the pair group cannot form")
    assert policy.refusal(p1, d1) == "cannot map d1's cache; and the pair group cannot form"
    assert policy.place_prefill(10, decode=d1) is None or \
        policy.place_prefill(10, decode=d1)[0].worker_id != "p1"
    # the broken pair is forgotten when d1 comes back at another address (a restart, once its
    # old process has missed its heartbeats: until then the id is the old one's)
    now[0] += registry.heartbeat_timeout_s + 1
    registry.register(Worker("d1", Role.DECODE, "127.0.0.1:6001", 16, 8192,
                             load=WorkerLoad(free_blocks=100, total_blocks=100), host_id="hostA"))
    assert policy.refusal(registry.get("p1"), registry.get("d1")) is None


def test_nccl_errors_that_will_repeat_are_marked_permanent():
    from kv_transfer.dist.endpoints import will_repeat

    nccl = ("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN "
            "for details), NCCL version 2.27.3 ncclInvalidUsage: Duplicate GPU detected : rank 1 "
            "and rank 0 both on CUDA device 52000")
    assert will_repeat(RuntimeError(nccl))
    assert not will_repeat(RuntimeError("Connection closed by peer [127.0.0.1]:4242"))
    assert not will_repeat(TimeoutError("receiving KV (tag 3) timed out (30.0s)"))
