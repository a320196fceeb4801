"""Linear layers with weights prepared once at load time for the device's fastest GEMM.

On CPU the weight is reordered into oneDNN's blocked layout, which keeps small-batch (decode)
matmuls near peak where a plain `F.linear` loses 2-4x; elsewhere it is a plain `F.linear`. On
AVX2 CPUs a native panel kernel takes the calls where it was measured faster
(engine.models.cpu_small_gemm: float32 steps of few rows with AVX2, beside oneDNN; every float32
and AVX512-BF16 bfloat16 step with AVX-512, alone).

On CPUs with AMX, bfloat16 calls of few rows go to the AMX GEMM (engine.models.amx_gemm), which
streams the weights once per call; larger ones to oneDNN. oneDNN's bfloat16 GEMM (its AMX
brgemm) runs 17-32 rows slower than 33: where it gets such a call (the AMX GEMM disabled), the
call is padded to 33 (`onednn_rows`). Calls of more than 64 rows (steps with prompt tokens) go in
with their rows rounded up to a multiple of 16, so that oneDNN meets few row counts: it builds
a primitive for every row count it has not met, which a step at a new count pays once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.amx_gemm import AmxRowGemm, amx_row_gemm
from engine.models.cpu_small_gemm import SmallRowGemm, load_cpu_small_gemm, takes
from engine.native_build import cpu_has_amx_bf16

# oneDNN picks the blocked layout for this many rows; any row count works with it afterwards.
_PACK_BATCH_HINT = 64
# oneDNN's AMX bfloat16 brgemm (torch 2.13, 2 threads, an Emerald Rapids Xeon) took 17-32 rows
# in 1.02-1.16x the time of 33 rows for the default model's four layer shapes together and
# 1.30-1.61x for its 49,152-wide lm_head (`python -m benchmarks.onednn_rows`: the shapes in turn,
# as a forward calls them): a step of 17-32 decodes pays less for 33 rows, the padding ignored.
# Measured nowhere else.
AMX_SLOW_ROWS = (17, 32)
AMX_PADDED_ROWS = 33
# oneDNN's first call at a row count it has not met builds that count's primitive: 3.6-6.5 ms
# per layer shape at 300-400 rows, the default model's four shapes 19-21 ms against 4-5.5 ms
# once built (bfloat16, 2 threads, the Emerald Rapids Xeon; every layer shares them, so a step
# pays it once). A served worker's prompt steps have a new count at nearly every step (the
# prompt plus however many decode). Rounding such calls up to a multiple of 16 rows (the AMX
# tile's height) keeps the counts few (a 2,048-token step: 128 of them) for at most 15 rows of
# padding, <6% from 256 rows up; offline_mixed bf16 read 1.03x with it. Decode steps (at most 64
# rows by default on CPU) keep their exact counts: 64 of them.
ROW_BUCKET = 16
BUCKETED_ABOVE = 64


def onednn_rows(rows: int, amx_bf16: bool) -> int:
    """The rows oneDNN's GEMM is given for a call of `rows` rows."""
    low, high = AMX_SLOW_ROWS
    if amx_bf16 and low <= rows <= high:
        return AMX_PADDED_ROWS
    if rows > BUCKETED_ABOVE:
        return -(-rows // ROW_BUCKET) * ROW_BUCKET
    return rows


def onednn_usable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and weight.dtype in (torch.float32, torch.bfloat16))


class Linear:
    """y = x W^T + b, W of shape [out_features, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed = False
        self.amx_bf16 = weight.dtype == torch.bfloat16 and weight.device.type == "cpu" \
            and cpu_has_amx_bf16()
        self.small_rows = _small_row_gemm(weight, bias) if pack else None
        if self.small_rows is not None and self.small_rows.max_rows is None:
            self.weight = None  # the kernel takes every call: no second copy
        elif pack and onednn_usable(weight):
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(),
                                                                       _PACK_BATCH_HINT)
                self.packed = True
            except RuntimeError:  # e.g. bf16 on a CPU without AVX512-BF16 / AVX-NE-CONVERT
                self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:  # the kernel's only; it takes rows of a matrix
            flat = self.small_rows(x.reshape(-1, self.in_features))
            return flat.reshape(*x.shape[:-1], self.out_features)
        if self.small_rows is not None and self.small_rows.fits(x):
            return self.small_rows(x)
        if self.packed:
            return self._onednn(x)
        return F.linear(x, self.weight, self.bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        padded = onednn_rows(rows, self.amx_bf16)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        y = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return y[:rows].view(*x.shape[:-1], self.out_features)


def _small_row_gemm(weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> SmallRowGemm | AmxRowGemm | None:
    """The few-row kernel's copy of a CPU weight, where the machine uses one for its dtype: the
    AMX GEMM for bfloat16 where the CPU has AMX, else the panel kernel."""
    if weight.device.type != "cpu":
        return None
    amx = amx_row_gemm(weight, bias)
    if amx is not None:
        return amx
    native = load_cpu_small_gemm()
    if native is None or not takes(native, weight.dtype):
        return None
    return SmallRowGemm(native, weight, bias)
