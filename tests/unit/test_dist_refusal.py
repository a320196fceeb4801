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
