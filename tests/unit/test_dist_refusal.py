"""A dist transfer the receiver refuses (its reservation aborted or expired) keeps the pair: both
sides are in step and nothing was sent, so the next transfer needs no new rendezvous. Any other
failure still tears the pair down (kv_transfer.dist.endpoints.KVSender). Model-free, no peer: a
stub rendezvous store answers for the receiver."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kv_transfer.dist.endpoints import KVSender, pair_key
from kv_transfer.errors import TransferError


class Store:
    def __init__(self, answer: str | None):
        self.answer = answer

    def wait(self, keys: list[str], timeout: object) -> None:
        if self.answer is None:
            raise RuntimeError("Socket Timeout: the receiver never answered")

    def get(self, key: str) -> bytes:
        return self.answer.encode()

    def delete_key(self, key: str) -> bool:
        return True


def sender_with_pair(store: Store) -> tuple[KVSender, str, object]:
    sender = KVSender("prefill-0", "127.0.0.1", torch.device("cpu"), timeout_s=2.0)
    key = pair_key("prefill-0", "decode-0")
    pair = SimpleNamespace(generation=sender.registry.current_generation(key))
    sender.registry._pairs[key] = pair  # a pair already set up by an earlier transfer
    sender._store = lambda address: store  # type: ignore[method-assign]
    return sender, key, pair


def test_a_refused_transfer_keeps_the_pair():
    sender, key, pair = sender_with_pair(Store("error: no reservation for r#1 (aborted)"))
    with pytest.raises(TransferError, match="refused") as info:
        sender.send_packed("decode-0", "127.0.0.1:1", [], lambda generation, tag: None)
    assert not info.value.permanent
    assert sender.registry._pairs[key] is pair
    assert sender.registry.current_generation(key) == pair.generation


def test_a_receiver_that_never_answers_tears_the_pair_down():
    sender, key, pair = sender_with_pair(Store(None))
    with pytest.raises(TransferError, match="never answered"):
        sender.send_packed("decode-0", "127.0.0.1:1", [], lambda generation, tag: None)
    assert key not in sender.registry


def test_one_pairs_setup_holds_up_no_other_pair(monkeypatch):
    """A sender that died before its rendezvous holds its pair's setup for the whole timeout;
    the receiver's other senders get theirs meanwhile (one lock through every setup made them
    all wait, and time out behind it)."""
    import threading

    from kv_transfer.dist import pair as pair_module
    from kv_transfer.dist.pair import RECEIVER_RANK, PairRegistry

    stalled, release = threading.Event(), threading.Event()

    def create(store, key, generation, *args):  # noqa: ANN001, ANN202
        if key == "dead->d":
            stalled.set()
            release.wait(30)  # a rendezvous that never completes, until the test ends it
        return SimpleNamespace(key=key, generation=generation)

    monkeypatch.setattr(pair_module.PairGroup, "create", staticmethod(create))
    registry = PairRegistry(RECEIVER_RANK, torch.device("cpu"), "127.0.0.1")
    dead = threading.Thread(target=registry.get, args=(None, "dead->d", 0))
    dead.start()
    try:
        assert stalled.wait(10)
        got: list[object] = []
        other = threading.Thread(target=lambda: got.append(registry.get(None, "live->d", 3)))
        other.start()
        other.join(10)
        assert got and got[0].generation == 3  # while the dead sender's setup still waits
        assert registry.get(None, "live->d", 3) is got[0]  # set up once
    finally:
        release.set()
        dead.join(10)
