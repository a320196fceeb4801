"""The fused fp32 RMSNorm must stay bitwise equal to transformers' three-op form."""

from __future__ import annotations

import pytest
import torch

from engine.models.elementwise import rms_norm


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("rows", [1, 5, 64, 513])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_form_bitwise(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    assert torch.equal(rms_norm(x, weight, 1e-5), _reference(x, weight, 1e-5))
