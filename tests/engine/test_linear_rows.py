"""The rows oneDNN's GEMM is given: on CPUs with AMX a bfloat16 call of 17-32 rows is padded to
33 (measured faster there), and on every CPU a call of more than 64 rows to a multiple of 16 (so
oneDNN builds few primitives); the padding never reaches the caller."""

from __future__ import annotations

import pytest
import torch

import engine.models.linear as linear_module
from engine.models.linear import AMX_PADDED_ROWS, Linear, onednn_rows


def test_amx_bf16_calls_of_17_to_32_rows_and_calls_past_64_rows_are_padded():
    assert [onednn_rows(r, True) for r in (1, 16, 17, 24, 32, 33, 64, 512)] == \
        [1, 16, 33, 33, 33, 33, 64, 512]
    assert [onednn_rows(r, False) for r in (1, 17, 32, 33, 64)] == [1, 17, 32, 33, 64]
    for amx in (True, False):
        assert [onednn_rows(r, amx) for r in (65, 80, 81, 256, 257, 270, 2047)] == \
            [80, 80, 96, 256, 272, 272, 2048]


@pytest.fixture
def onednn_bf16_linear(monkeypatch: pytest.MonkeyPatch):
    """A bfloat16 Linear on oneDNN's packed path (no panel kernel, no AMX GEMM) as on an AMX
    CPU, and the row counts oneDNN was called with."""
    monkeypatch.setattr(linear_module, "load_cpu_small_gemm", lambda: None)
    monkeypatch.setattr(linear_module, "amx_row_gemm", lambda weight, bias: None)
    monkeypatch.setattr(linear_module, "cpu_has_amx_bf16", lambda: True)
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16()
    layer = Linear(weight, bias)
    if not layer.packed:
        pytest.skip("oneDNN has no bfloat16 GEMM on this CPU")
    calls: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    return layer, weight, bias, calls


@pytest.mark.parametrize("shape", [(16, 64), (17, 64), (32, 64), (33, 64), (2, 12, 64),
                                   (65, 64), (3, 90, 64)])
def test_padded_calls_return_the_callers_rows_within_bf16_rounding(onednn_bf16_linear, shape):
    layer, weight, bias, calls = onednn_bf16_linear
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = layer(x)
    rows = x.numel() // 64
    assert y.shape == (*shape[:-1], 96) and y.dtype == torch.bfloat16
    assert calls == [AMX_PADDED_ROWS if 17 <= rows <= 32 else rows if rows <= 64
                     else -(-rows // 16) * 16]
    reference = x.double() @ weight.double().t() + bias.double()
    # bf16 output: one rounding of values up to ~8 in magnitude, plus the bias's
    assert (y.double() - reference).abs().max().item() < 0.07


def test_the_row_count_benchmark_times_exact_and_padded_counts():
    from benchmarks.onednn_rows import SHAPES, parse_rows, time_calls

    assert parse_rows("9-12") == [9, 10, 11, 12] and parse_rows("17") == [17]
    weight = torch.randn(*SHAPES["o"]).bfloat16()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    except RuntimeError:
        pytest.skip("oneDNN has no bfloat16 GEMM on this CPU")
    ms = time_calls({"o": packed}, [17, 33], repeats=1)
    assert set(ms) == {17, 33} and all(ms[m]["o"] > 0 for m in ms)
