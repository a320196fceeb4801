"""The start-up warm-up runs every attention-kernel variant a server meets (under the interpreter
here: it checks the calls are well-formed; on a GPU it is what compiles them)."""

from __future__ import annotations

import torch

from engine.attention.warmup import COUNTS, warm_up_attention

# On CUDA where present (and then part of `pytest -m gpu`: tests/conftest.py).
RUNS_ON_CUDA = True


def test_warm_up_covers_every_split_count_and_integer_specialisation():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ran = warm_up_attention(n_heads=4, n_kv=2, head_dim=16, block_size=16,
                            dtype=torch.float32, device=device, max_splits=4)
    assert {(k, s) for k, s, _ in ran} == {("write", 1), ("decode", 1), ("decode", 2),
                                           ("decode", 4), ("prefill", 1)}
    for kind in ("write", "decode", "prefill"):
        assert {c for k, _, c in ran if k == kind} == set(COUNTS)
