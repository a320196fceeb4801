"""The decoder layer's element-wise chains as native CPU kernels (csrc/cpu_elementwise.cpp):
residual add + RMSNorm, RoPE in place, SiLU(gate) * up, one pass each instead of 3-10 torch ops.

Each is bitwise equal to the torch form in float32 and bfloat16 (same rounding points, the same
SLEEF exp as torch, the sum of squares in the order of torch's sum kernel, no FMA contraction), so
outputs do not change: float32 stays transformers-exact. Used on CPU wherever the build loads with
AVX-512 or AVX2 (the module's `isa()` says which); PDSERVE_DISABLE_CPU_ELEMENTWISE=1 keeps the torch
form.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

import torch

from engine.models.elementwise import TorchElementwise
from engine.native_build import try_build_native

SOURCE = Path(__file__).with_name("csrc") / "cpu_elementwise.cpp"
DISABLE_ENV = "PDSERVE_DISABLE_CPU_ELEMENTWISE"
PREFIX = "pdserve_cpu_elementwise"
# No -ffast-math and no contraction: each product and sum rounds where torch's kernels round.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")


@functools.cache
def load_cpu_elementwise() -> ModuleType | None:
    """The compiled module where it builds with its AVX-512 or AVX2 kernels, else None."""
    if os.environ.get(DISABLE_ENV):
        return None
    module = try_build_native(PREFIX, SOURCE, CFLAGS, "native CPU element-wise kernels")
    return module if module is not None and module.available() else None


class NativeCpuElementwise(TorchElementwise):
    """The native kernels behind the element-wise interface."""

    name = "native"
    rotates_in_place = True
    defers_residual = True  # a bf16 [64, 576] add was ~25 us a layer on its own

    def __init__(self, native: ModuleType):
        self.native = native

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual, out = self.native.add_rms_norm(h, delta, weight, eps)
        return residual, out

    def rope_qk_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.native.rope_(qk, cos, sin)

    def rope_qkv(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], n_heads: int,
                 n_kv: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if qkv.dim() != 2 or qkv.stride(1) != 1:  # the views below need contiguous rows
            return super().rope_qkv(qkv, rope, n_heads, n_kv, head_dim)
        q, k, v = self.native.rope_qkv(qkv, rope[0], rope[1], n_heads, n_kv, head_dim)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.native.silu_mul(gate_up)
