"""bfloat16 linear layers at few rows on Intel's AMX tiles (csrc/amx_gemm.cpp).

A decode step's linears are bound by streaming the weights. On an AMX Xeon, the vdpbf16ps panel
kernel (engine.models.cpu_small_gemm) is compute bound above a few rows and oneDNN's AMX GEMM is
no faster at 1-32 rows; this kernel streams each weight once per call with the tile products far
ahead of memory (BENCHMARKS.md, "On the AMX Xeon: the prefill kernel's products and the decode
steps' linears on the AMX tiles"). `engine.models.linear` gives it the bfloat16 calls of at most
AMX_GEMM_MAX_ROWS rows where the CPU has AMX; oneDNN keeps the larger ones.
PDSERVE_DISABLE_AMX_GEMM=1 leaves those calls to the earlier forms.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

import torch

from engine.native_build import cpu_has_amx_bf16, try_build_native

SOURCE = Path(__file__).with_name("csrc") / "amx_gemm.cpp"
DISABLE_ENV = "PDSERVE_DISABLE_AMX_GEMM"
PREFIX = "pdserve_amx_gemm"
CFLAGS = ("-O3", "-march=native", "-fopenmp")
# The most rows a call may have to take the kernel: every decode step at the CPU default of 64
# sequences. Whole decode steps of the default model against oneDNN (Emerald Rapids, 2
# threads): 1.29-1.32x faster at 1-16 sequences, 1.12-1.21x at 24-32; 1.07-1.11x at 48-64 in two
# later invocations (an earlier one read 0.91-1.08x at 48 and parity at 64). Above 64 the
# evidence conflicts (whole steps 1.07x at 96 and parity at 128; the linears alone, lm_head
# left out, 0.88x at 96 in `benchmarks.amx_gemm_sources`). From ~48 rows on the kernel is bound
# by the tile unit, which the two vCPUs there share (one thread is as fast as two).
AMX_GEMM_MAX_ROWS = 64


@functools.cache
def load_amx_gemm() -> ModuleType | None:
    """The compiled module where the CPU has AMX and the process was granted the tiles, else
    None."""
    if os.environ.get(DISABLE_ENV) or not cpu_has_amx_bf16():
        return None
    module = try_build_native(PREFIX, SOURCE, CFLAGS, "AMX bfloat16 GEMM")
    return module if module is not None and module.available() else None


class AmxRowGemm:
    """One bfloat16 weight packed for the kernel: `__call__(x)` for the x it `fits`."""

    def __init__(self, native: ModuleType, weight: torch.Tensor, bias: torch.Tensor | None,
                 max_rows: int = AMX_GEMM_MAX_ROWS):
        self.native = native
        self.max_rows = min(max_rows, native.max_rows())
        self.out_features, self.in_features = weight.shape
        self.packed = native.pack(weight)
        self.bias = bias.contiguous() if bias is not None else None

    def fits(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype == torch.bfloat16 and x.shape[0] <= self.max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self.native.linear(x, self.packed, self.out_features, self.in_features, self.bias)


def amx_row_gemm(weight: torch.Tensor, bias: torch.Tensor | None) -> AmxRowGemm | None:
    """The kernel's copy of a CPU bfloat16 weight, where this machine runs it."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    native = load_amx_gemm()
    return AmxRowGemm(native, weight, bias) if native is not None else None
