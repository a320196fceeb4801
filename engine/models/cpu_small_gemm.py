"""float32 linear layers at few rows on CPUs with AVX2 and no AVX-512 (csrc/cpu_small_gemm.cpp).

A decode step of 1-24 sequences is bound by streaming the weights; oneDNN's blocked fp32 GEMM
reached 45-65% of that bound there, a panel kernel that reads each weight once per 4 rows gets
closer (BENCHMARKS.md, "Linears at few rows"). Each such layer keeps a second copy of its weight,
packed for the kernel, beside oneDNN's (which serves every larger step): float32 linear weights
take twice their memory. Used where measured faster: AVX2 machines without AVX-512 (on AVX-512
machines oneDNN's own kernels were not compared against it, so they keep oneDNN).
PDSERVE_DISABLE_CPU_SMALL_GEMM=1 keeps oneDNN everywhere.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

import torch

from engine.native_build import cpu_flags, try_build_native

SOURCE = Path(__file__).with_name("csrc") / "cpu_small_gemm.cpp"
DISABLE_ENV = "PDSERVE_DISABLE_CPU_SMALL_GEMM"
PREFIX = "pdserve_cpu_small_gemm"
CFLAGS = ("-O3", "-march=native", "-fopenmp")
# Rows up to which the kernel beat oneDNN inside a decode step's linears (1-24 measured faster,
# 32 at parity, 64 and prefill steps slower).
MAX_ROWS = 24


def measured_machine() -> bool:
    """AVX2 and FMA without AVX-512: where the kernel was measured against oneDNN."""
    flags = cpu_flags().split()
    return "avx2" in flags and "fma" in flags and "avx512f" not in flags


def build_small_gemm() -> ModuleType | None:
    """The compiled module wherever it builds with its AVX2 + FMA kernel (the tests take it on
    any such machine), else None."""
    module = try_build_native(PREFIX, SOURCE, CFLAGS, "native CPU small-row GEMM")
    return module if module is not None and module.available() else None


@functools.cache
def load_cpu_small_gemm() -> ModuleType | None:
    """The compiled module where the policy uses it (see the module doc), else None."""
    if os.environ.get(DISABLE_ENV) or not measured_machine():
        return None
    return build_small_gemm()


class SmallRowGemm:
    """One weight packed for the kernel: `__call__(x)` for x of at most MAX_ROWS rows."""

    def __init__(self, native: ModuleType, weight: torch.Tensor, bias: torch.Tensor | None):
        self.native = native
        self.out_features = weight.shape[0]
        self.packed = native.pack(weight)
        self.bias = bias.contiguous() if bias is not None else None

    def fits(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.native.linear(x, self.packed, self.out_features, self.bias)
