"""engine.row_argmax against torch's argmax, its reference: the same index on every row — the
first of tied maxima, across blocks and in the tail, rows of -inf, rows holding NaN, strided
input, every dtype the sampler sees. Crafted rows are repeated past MIN_ROWS, so the blocked
form (not torch's, which serves fewer rows) answers."""

from __future__ import annotations

import pytest
import torch

from engine.row_argmax import BLOCK, MIN_ROWS, row_argmax

WIDTHS = [1, 100, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1, 49152, 49152 + 37, 151936]


def many(x: torch.Tensor) -> torch.Tensor:
    """`x`'s rows repeated to at least MIN_ROWS rows."""
    return torch.cat([x] * -(-MIN_ROWS // x.shape[0]))


def assert_same(x: torch.Tensor) -> None:
    got = row_argmax(x)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", WIDTHS)
def test_random_rows_match_torch(dtype: torch.dtype, cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    for rows in (0, 1, 7, MIN_ROWS, 33, 64):
        assert_same(torch.randn(rows, cols, generator=gen).to(dtype))


@pytest.mark.parametrize("cols", WIDTHS)
def test_ties_give_the_first_index(cols: int) -> None:
    gen = torch.Generator().manual_seed(1)
    # Few distinct values: every row's maximum appears many times, in many blocks.
    assert_same(torch.randint(0, 3, (MIN_ROWS + 8, cols), generator=gen).float())
    assert_same(torch.randint(0, 3, (MIN_ROWS + 8, cols), generator=gen).to(torch.bfloat16))


def test_the_maximum_at_block_edges_in_two_blocks_and_in_the_tail() -> None:
    cols = 5 * BLOCK + 300
    x = torch.zeros(8, cols)
    x[0, BLOCK - 1] = 1.0  # last column of a block
    x[1, BLOCK] = 1.0  # first column of the next
    x[2, 3 * BLOCK + 5] = x[2, BLOCK + 7] = 2.0  # tied in two blocks: the earlier wins
    x[3, cols - 1] = 1.0  # last column, in the tail
    x[4, 5 * BLOCK] = x[4, 4 * BLOCK + 9] = 1.0  # tied between the last block and the tail
    x[5, 5 * BLOCK + 1] = x[5, cols - 2] = 1.0  # tied inside the tail
    x[6] = float("-inf")  # every column masked: torch answers 0
    x[7] = float("inf")
    assert_same(many(x))


def test_rows_holding_nan_follow_torch() -> None:
    x = torch.randn(4, 3 * BLOCK)
    x[1, 2 * BLOCK + 3] = float("nan")
    x[2, 10] = x[2, BLOCK + 10] = float("nan")
    x[3] = float("-inf")
    assert_same(many(x))


def test_strided_and_sliced_input() -> None:
    base = torch.randn(2 * MIN_ROWS, 4 * BLOCK + 11)
    assert_same(base[::2])  # rows strided: still a row-wise view
    assert_same(base[:, 5:])  # columns offset
    assert_same(base.t().contiguous().t())  # last dim not unit-stride


def test_the_sampler_picks_greedy_rows_with_it() -> None:
    from engine.request import SamplingParams
    from engine.sampler import Sampler, SamplingBatch

    rows = MIN_ROWS + 3
    logits = torch.randint(0, 4, (rows, 3 * BLOCK + 17)).float()
    params = [SamplingParams(temperature=0, max_tokens=1) for _ in range(rows)]
    tokens, _ = Sampler()(logits, SamplingBatch(params, [0] * rows))
    assert tokens == logits.argmax(dim=-1).tolist()
