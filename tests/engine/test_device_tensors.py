"""Host lists to tensors through numpy: the same values, dtypes and shapes as torch.tensor."""

from __future__ import annotations

import pytest
import torch

from engine.device_tensors import host_tensor, padded_host_tensor, to_device

CASES = [
    ([], torch.int64),
    ([0, -1, 2**62, -(2**63)], torch.int64),
    ([5, -7, 2**31 - 1], torch.int32),
    ([[1, 2, 3], [4, 5, 6]], torch.int32),
    ([0.1, -2.5, 1e-40, float("inf"), 3.4e38], torch.float32),
    ([True, False, True], torch.bool),
    ([1.5, 2.0], torch.float64),  # no numpy form here: torch.tensor itself
]


@pytest.mark.parametrize(("values", "dtype"), CASES)
def test_host_tensor_is_torch_tensor(values: list, dtype: torch.dtype) -> None:
    got, want = host_tensor(values, dtype), torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(to_device(values, dtype, torch.device("cpu")), want)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_padded_rows(dtype: torch.dtype) -> None:
    rows = [[3, 1, 4], [], [1, 5, 9, 2, 6], [5]]
    for width in (5, 8):
        want = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=dtype)
        got = padded_host_tensor(rows, width, dtype)
        assert got.dtype == dtype and torch.equal(got, want)


def test_a_row_wider_than_the_table_is_refused() -> None:
    with pytest.raises(ValueError):
        padded_host_tensor([[1, 2, 3]], 2, torch.int32)
