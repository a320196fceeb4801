"""The split-KV choice as a pure function: the counts the H100 measurements favoured."""

from __future__ import annotations

import pytest

from engine.attention.splits import MAX_SPLITS, pick_num_splits

H100_SMS = 132


@pytest.mark.parametrize("seqs,kv_heads,seq_len,splits", [
    (64, 8, 2048, 1),  # 512 programs: the GPU is full without splitting
    (256, 8, 1024, 1),
    (16, 8, 8192, 4),  # measured best: 4 splits (2,679 GB/s vs 1,631 auto before)
    (4, 8, 32768, 16),  # measured best: 16 splits
    (1, 8, 65536, 64),  # one very long sequence: past the former cap of 16
    (1, 8, 300, 1),  # too short to split: each split needs >= 256 keys
    (1, 8, 1024, 4),  # capped by length: 1024 / 256
])
def test_decode_splits_fill_the_gpu_but_never_below_the_minimum_keys(seqs, kv_heads, seq_len,
                                                                      splits):
    assert pick_num_splits(seqs, kv_heads, 1, seq_len, H100_SMS) == splits


def test_no_split_for_prefill_or_without_sms_and_always_a_power_of_two():
    assert pick_num_splits(4, 8, 16, 65536, H100_SMS) == 1  # chunks of prefill: not split
    assert pick_num_splits(4, 8, 1, 65536, 0) == 1
    for seqs in range(1, 300, 7):
        for seq_len in (1, 255, 256, 4000, 70000, 10**6):
            n = pick_num_splits(seqs, 8, 1, seq_len, H100_SMS)
            assert 1 <= n <= MAX_SPLITS and n & (n - 1) == 0
