"""Every test here needs CUDA: marked `gpu` and skipped cleanly without a device, so
`pytest -m gpu` on a GPU machine runs them all and on a CPU machine reports them skipped."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not HAS_CUDA:
                item.add_marker(skip)


def gpu_count() -> int:
    return torch.cuda.device_count() if HAS_CUDA else 0
