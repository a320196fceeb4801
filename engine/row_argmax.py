"""The index of each row's maximum, as `x.argmax(dim=-1)` gives it, faster on CPU at many rows.

torch's CPU argmax walks each row as (value, index) pairs without vectors: a decode step's greedy
pick over 128 rows of a 49,152-token vocabulary took 3-4 ms, while `amax` over the same logits
takes ~0.3 ms. So on CPU each row is split into blocks of BLOCK columns: `amax` gives every
block's maximum, the first block holding the row's maximum is found among those few values, and
torch's argmax runs over that one block only. The answer is torch's exactly: the first index of
the maximum; a row holding NaN (which torch counts as the maximum) is left to torch's argmax.
Other devices keep torch's argmax.

Where the CPU has AVX-512, a native kernel (engine/csrc/row_argmax.cpp) answers instead, for
float32 and bfloat16 rows of any count: two vector passes over each row, the second in cache.
On an Emerald Rapids Xeon (2 threads, SmolLM2's vocabulary) float32 took 0.008 / 0.043 / 0.51 ms
at 1 / 8 / 64 rows against the blocked form's 0.10 / 0.51 / 0.73; bfloat16 rows, read as they
are, 0.43 ms at 64 rows against 1.57 for widening them and the blocked form.
PDSERVE_DISABLE_NATIVE_ARGMAX=1 keeps the torch forms.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

import torch

from engine.native_build import try_build_native

BLOCK = 1024  # columns per block: whole rows of amax stay vectorized, one block's argmax is cheap
# Below this many rows torch's argmax is as fast or faster inside a decode step (the blocked
# form's handful of small ops cost ~0.1-0.25 ms there): measured on Zen 4, float32 and bfloat16,
# 1-48 rows of SmolLM2's vocabulary; the crossover sat between 16 and 24.
MIN_ROWS = 24
SOURCE = Path(__file__).with_name("csrc") / "row_argmax.cpp"
PREFIX = "pdserve_row_argmax"
CFLAGS = ("-O3", "-march=native", "-fopenmp")
DISABLE_ENV = "PDSERVE_DISABLE_NATIVE_ARGMAX"
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def load_native_argmax() -> ModuleType | None:
    """The compiled kernel where it builds with AVX-512, else None."""
    if os.environ.get(DISABLE_ENV):
        return None
    module = try_build_native(PREFIX, SOURCE, CFLAGS, "native CPU row argmax")
    return module if module is not None and module.available() else None


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a 2-D tensor [rows, cols], int64 [rows]."""
    rows, cols = x.shape
    if x.device.type == "cpu" and x.dtype in NATIVE_DTYPES and cols and x.stride(-1) == 1:
        native = load_native_argmax()
        if native is not None:
            return native.row_argmax(x)
    return blocked_argmax(x)


def blocked_argmax(x: torch.Tensor) -> torch.Tensor:
    """The torch form: `amax` over blocks, torch's argmax inside the one block that holds the
    maximum."""
    rows, cols = x.shape
    if x.device.type != "cpu" or cols < 2 * BLOCK or rows < MIN_ROWS or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    full = cols // BLOCK
    head = x[:, :full * BLOCK].view(rows, full, BLOCK)  # splits only the last dim: a view
    tail = x[:, full * BLOCK:]
    block_max = head.amax(dim=-1)
    if tail.shape[1]:
        block_max = torch.cat([block_max, tail.amax(dim=-1, keepdim=True)], dim=1)
    row_max = block_max.amax(dim=-1, keepdim=True)
    if bool(torch.isnan(row_max).any()):  # NaN never equals itself: torch's rule applies
        return x.argmax(dim=-1)
    # The first block holding the row's maximum (argmax of the few 0/1 flags is first-wins).
    block = (block_max == row_max).to(torch.uint8).argmax(dim=-1)
    in_block = head[torch.arange(rows), block.clamp(max=full - 1)].argmax(dim=-1)
    index = block * BLOCK + in_block
    if tail.shape[1]:
        index = torch.where(block == full, full * BLOCK + tail.argmax(dim=-1), index)
    return index
