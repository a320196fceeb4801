"""The KV-transfer path on its own: two real processes, real gloo, a TCPStore rendezvous hosted by
the receiver, per-layer packing, bounded waits, and a broken pair rebuilt on next use."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tests.cluster import kv_peers


def run_pair(plan: list[str]) -> list[tuple]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    recv = ctx.Process(target=kv_peers.receiver, args=(queue, plan), daemon=True)
    recv.start()
    kind, port = queue.get(timeout=60)
    assert kind == "port"
    send = ctx.Process(target=kv_peers.sender, args=(port, plan), daemon=True)
    send.start()
    results = [queue.get(timeout=60) for _ in plan]
    for proc in (send, recv):
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            pytest.fail(f"{proc.name} did not exit")
    assert recv.exitcode == 0 and send.exitcode == 0
    return results


def test_blocks_arrive_intact_at_the_receivers_own_block_ids():
    (result,) = run_pair(["recv"])
    assert result[0] == "ok"
    assert result[2] == pytest.approx(kv_peers.expected_checksum(), rel=1e-9)
    layer_bytes = 2 * len(kv_peers.DST_BLOCKS) * kv_peers.BLOCK_SIZE * kv_peers.KV_HEADS * 8 * 4
    assert result[3] == kv_peers.LAYERS * layer_bytes


def test_timeout_when_the_peer_never_sends_then_the_rebuilt_pair_works():
    timeout, again = run_pair(["timeout", "recv"])
    assert timeout[0] == "error" and "timed out" in timeout[2]
    assert again[0] == "ok"
    assert again[2] == pytest.approx(kv_peers.expected_checksum(), rel=1e-9)


def test_a_sender_dying_mid_transfer_is_an_error_then_a_new_sender_gets_through():
    """The receiver sees the peer vanish during a transfer: TransferError, pair torn down; a
    restarted sender (new process, same id) rendezvouses under the next generation and its
    transfer arrives intact."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    recv = ctx.Process(target=kv_peers.receiver, args=(queue, ["recv", "recv"]), daemon=True)
    recv.start()
    kind, port = queue.get(timeout=60)
    dying = ctx.Process(target=kv_peers.sender, args=(port, ["die"]), daemon=True)
    dying.start()
    broken = queue.get(timeout=60)
    dying.join(timeout=30)
    assert dying.exitcode == 1
    assert broken[0] == "error"
    restarted = ctx.Process(target=kv_peers.sender, args=(port, ["send"], 1), daemon=True)
    restarted.start()
    again = queue.get(timeout=60)
    for proc in (restarted, recv):
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert again[0] == "ok"
    assert again[2] == pytest.approx(kv_peers.expected_checksum(), rel=1e-9)


def test_bytes_that_do_not_match_their_mac_are_refused_and_nothing_is_written():
    """The real KVReceiver/KVSender over gloo, each transfer announced with a MAC (the control
    call, here a queue): forged bytes under the real bytes' MAC, and the real bytes under a MAC of
    a guessed secret, are received but refused before anything is written (the cache stays all
    zeros); the pair stays in step, and the honest transfer after them lands intact."""
    ctx = mp.get_context("spawn")
    queue, control = ctx.Queue(), ctx.Queue()
    plan = ["forged", "wrong-key", "honest"]
    recv = ctx.Process(target=kv_peers.checked_receiver, args=(queue, control, len(plan)),
                       daemon=True)
    recv.start()
    kind, port = queue.get(timeout=60)
    send = ctx.Process(target=kv_peers.checked_sender, args=(port, control, plan), daemon=True)
    send.start()
    results = [queue.get(timeout=60) for _ in plan]
    for proc in (send, recv):
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert results[0] == ("refused", 0.0, 0.0)
    assert results[1] == ("refused", 0.0, 0.0)
    outcome, whole, landed = results[2]
    assert outcome == "ok" and whole > 0
    assert landed == pytest.approx(kv_peers.expected_checksum(), rel=1e-9)
