"""engine.row_argmax against torch's argmax, its reference: the same index on every row — the
first of tied maxima, across blocks and in the tail, rows of -inf, rows holding NaN, strided
input, every dtype the sampler sees. Each test runs twice: with the native kernel where the CPU
builds it (AVX-512), and with the torch blocked form. Crafted rows are repeated past MIN_ROWS, so
the blocked form (not torch's, which serves fewer rows) answers."""

from __future__ import annotations

import pytest
import torch

from engine import row_argmax as row_argmax_module
from engine.native_build import cpu_flags
from engine.row_argmax import BLOCK, MIN_ROWS, load_native_argmax, row_argmax

WIDTHS = [1, 100, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1, 49152, 49152 + 37, 151936]


@pytest.fixture(autouse=True, params=["native", "blocked"])
def form(request, monkeypatch):
    if request.param == "native":
        if load_native_argmax() is None:
            # Where the CPU has AVX-512 the kernel must build: a silent fallback would hide a bug.
            assert "avx512f" not in cpu_flags().split(), "the native row argmax did not load"
            pytest.skip("no AVX-512 (or no compiler): the blocked form answers")
    else:
        monkeypatch.setattr(row_argmax_module, "load_native_argmax", lambda: None)
    return request.param


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


def test_the_kernel_refuses_what_it_cannot_read(form) -> None:
    if form == "blocked":
        pytest.skip("the kernel's own checks")
    native = load_native_argmax()
    with pytest.raises(RuntimeError, match="unit-stride"):
        native.row_argmax(torch.ones(4, 8).t())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native.row_argmax(torch.ones(4, 8, dtype=torch.float16))
    assert row_argmax(torch.ones(0, 8)).shape == (0,)


def test_the_sampler_reads_bf16_logits_as_they_are_only_for_argmax_rows(monkeypatch) -> None:
    """A batch of greedy rows that read nothing else of the logits picks from the model's bf16
    logits unwidened; any other batch (logprobs, temperature, processing) gets them widened
    to float32 first, so its logprobs and draws are those of float32 logits."""
    import torch.nn.functional as F

    from engine import sampler as sampler_module
    from engine.request import SamplingParams
    from engine.sampler import Sampler, SamplingBatch

    seen: list[torch.dtype] = []
    monkeypatch.setattr(sampler_module, "row_argmax",
                        lambda x: seen.append(x.dtype) or row_argmax(x))
    rows = MIN_ROWS + 3
    logits = torch.randn(rows, 3 * BLOCK + 17).bfloat16()
    greedy = [SamplingParams(temperature=0, max_tokens=1) for _ in range(rows)]
    tokens, _ = Sampler()(logits, SamplingBatch(greedy, [0] * rows))
    assert tokens == logits.float().argmax(dim=-1).tolist() and seen == [torch.bfloat16]
    seen.clear()
    with_logprobs = [SamplingParams(temperature=0, max_tokens=1, logprobs=2) for _ in range(rows)]
    tokens, logprobs = Sampler()(logits, SamplingBatch(with_logprobs, [0] * rows))
    assert seen == [torch.float32] and tokens == logits.float().argmax(dim=-1).tolist()
    expected = F.log_softmax(logits.float(), dim=-1)
    assert logprobs[0][tokens[0]] == pytest.approx(float(expected[0, tokens[0]]), abs=1e-6)
    seen.clear()
    biased = [SamplingParams(temperature=0, max_tokens=1, logit_bias={5: 100.0})] * rows
    tokens, _ = Sampler()(logits, SamplingBatch(biased, [0] * rows, [None] * rows))
    assert tokens == [5] * rows and seen == [torch.float32]
