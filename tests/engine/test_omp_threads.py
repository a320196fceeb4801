"""One parallel thread per process (engine.omp_threads): a confined thread computes alone while
the others keep their thread count, and a passing build hands back its result or its error."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.omp_threads import _openmp, build_on_passing_thread, use_one_torch_thread
from tests.conftest import torch_threads


def in_thread(fn):
    got: list = []
    thread = threading.Thread(target=lambda: got.append(fn()))
    thread.start()
    thread.join(30)
    return got[0]


@pytest.mark.skipif(_openmp() is None, reason="torch's OpenMP runtime is not libgomp/libiomp")
def test_a_confined_thread_computes_alone_and_the_others_keep_their_count():
    def confined() -> tuple[int, float]:
        use_one_torch_thread()
        x = torch.arange(1_000_000, dtype=torch.float64)
        return torch.get_num_threads(), float((x * 2).sum())

    with torch_threads(2):
        assert in_thread(confined) == (1, 999999000000.0)  # it still computes
        assert in_thread(torch.get_num_threads) == 2  # a fresh thread gets the process's count
        assert torch.get_num_threads() == 2


def test_a_passing_build_returns_its_result_or_raises_its_error_here():
    built_on: list[str] = []

    def build() -> int:
        built_on.append(threading.current_thread().name)
        return 42

    assert build_on_passing_thread(build) == 42
    assert built_on == ["engine-build"]

    def broken() -> int:
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        build_on_passing_thread(broken)
