"""Linear layers through a native panel GEMM on AVX2 CPUs (csrc/cpu_small_gemm.cpp).

A decode step of 1-24 sequences is bound by streaming the weights; oneDNN's blocked fp32 GEMM
reached 45-65% of that bound there, a panel kernel that reads each weight once per tile of rows
gets closer (BENCHMARKS.md, "Linears at few rows"). Where it is used, as measured against oneDNN
inside the default model's steps:
- float32, the AVX2 form (tiles of 4 rows; AMD EPYC Zen 3): steps of at most 24 rows; oneDNN
  was at parity at 32 and faster above. Such a layer keeps its packed copy beside oneDNN's,
  which serves the larger steps: float32 linear weights take twice their memory.
- float32, the AVX-512 form (tiles of 8 rows; AMD EPYC Zen 4): 1.1-1.5x oneDNN in decode steps
  of 1-192 rows and 1.01-1.05x in prefill-sized products; bfloat16 with AVX512-BF16 (vdpbf16ps):
  1.05-1.55x in decode steps of 1-128 rows and 1.12-1.17x in prefill-sized products. The kernel
  takes every call and the layer keeps no oneDNN copy.
- bfloat16 on a CPU with AMX (Intel Xeon, Emerald Rapids measured): oneDNN's AMX GEMM wins from
  about 8 rows up (0.73-0.86x the kernel's time at 12-32 rows, 0.14-0.20x in prefill-sized
  products), the kernel below (1.15-1.49x at 1-4 rows). There the AMX GEMM
  (engine.models.amx_gemm) takes those few-row calls instead where it loads, faster than both;
  without it such a layer keeps both copies, this kernel taking at most 8 rows.
PDSERVE_DISABLE_CPU_SMALL_GEMM=1 keeps oneDNN everywhere.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

import torch

from engine.native_build import cpu_flags, cpu_has_amx_bf16, try_build_native

SOURCE = Path(__file__).with_name("csrc") / "cpu_small_gemm.cpp"
DISABLE_ENV = "PDSERVE_DISABLE_CPU_SMALL_GEMM"
PREFIX = "pdserve_cpu_small_gemm"
CFLAGS = ("-O3", "-march=native", "-fopenmp")
# Rows up to which the AVX2 form beat oneDNN inside a decode step's linears (1-24 measured
# faster, 32 at parity, 64 and prefill steps slower). The AVX-512 forms (float32, and bfloat16
# with AVX512-BF16) beat oneDNN at every size measured and have no limit, except bfloat16 where
# the CPU has AMX: at parity with oneDNN's AMX GEMM at 8 rows, slower above.
AVX2_MAX_ROWS = 24
AMX_BF16_MAX_ROWS = 8


def measured_machine() -> bool:
    """AVX2 and FMA (the AVX2 form, or the AVX-512 form where the CPU has AVX-512): where the
    kernel was measured against oneDNN."""
    flags = cpu_flags().split()
    return "avx2" in flags and "fma" in flags


def takes(native: ModuleType, dtype: torch.dtype) -> bool:
    """Whether the build computes linears of this dtype."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native.bf16_available())


def max_rows(native: ModuleType, dtype: torch.dtype) -> int | None:
    """The most rows a call may have to take the kernel; None: any number."""
    if dtype == torch.bfloat16 and cpu_has_amx_bf16():
        return AMX_BF16_MAX_ROWS
    return AVX2_MAX_ROWS if native.max_tile_rows() == 4 and dtype == torch.float32 else None


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
    """One weight packed for the kernel: `__call__(x)` for the x it `fits`."""

    def __init__(self, native: ModuleType, weight: torch.Tensor, bias: torch.Tensor | None):
        self.native = native
        self.dtype = weight.dtype
        self.max_rows = max_rows(native, weight.dtype)
        self.out_features, self.in_features = weight.shape
        self.packed = native.pack(weight)
        self.bias = bias.contiguous() if bias is not None else None

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.dtype == self.dtype
                and (self.max_rows is None or x.shape[0] <= self.max_rows))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.native.linear(x, self.packed, self.out_features, self.in_features, self.bias)
