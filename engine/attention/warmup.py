"""Compile the Triton attention kernels at start, not inside the first users' requests.

Triton compiles a kernel variant the first time it meets a new combination of compile-time
constants (split count, query tile, dtype, head size, block size) and of integer arguments it
specialises on (equal to 1, divisible by 16). On an H100 that first meeting made the first run of
a workload 1.6-2.2x slower than the second. Running every variant a server will meet once, on tiny
inputs, at engine start moves that cost to start; Triton's on-disk cache then makes later starts
fast too. The block table's row stride (the batch's widest table) is not specialised on
(`do_not_specialize` in the kernel): an H200 run met a table 16 wide that the warm-up had not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.splits import MAX_SPLITS
from engine.attention.triton_paged import paged_attention_triton, write_kv_cache_triton
from engine.config import ModelConfig

# Token / sequence counts that hit each of Triton's integer specialisations (== 1, % 16 == 0,
# neither).
COUNTS = (1, 16, 3)
LayerKind = tuple[int | None, float | None]  # a layer's sliding window and attention soft cap


def layer_kinds(model_config: ModelConfig) -> list[LayerKind]:
    """The distinct (window, softcap) pairs the model's layers attend with, in layer order."""
    gemma = model_config.gemma
    softcap = gemma.attention_softcap if gemma else None
    return list(dict.fromkeys((window, softcap)
                              for window in model_config.layer_windows or (None,)))


def warm_up_attention(n_heads: int, n_kv: int, head_dim: int, block_size: int,
                      dtype: torch.dtype, device: torch.device, max_splits: int = MAX_SPLITS,
                      layer_kinds: Sequence[LayerKind] = ((None, None),)
                      ) -> list[tuple[str, int, int]]:
    """Run the KV write and the attention kernel once per variant; returns what ran as
    (kind, splits, count) — decode at every power-of-two split count, prefill unsplit — for
    each of `layer_kinds`, the (window, softcap) pairs the model's layers attend with (a sliding
    window and a soft cap are kernel variants of their own, and Triton specialises on the
    window's value)."""
    seq_len = 2 * block_size + 1
    blocks = max(COUNTS) * (seq_len // block_size + 1)
    k_cache = torch.zeros(blocks, block_size, n_kv, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    ran = []
    for count in COUNTS:
        kv = torch.zeros(count, n_kv, head_dim, dtype=dtype, device=device)
        slots = torch.arange(count, dtype=torch.int64, device=device)
        write_kv_cache_triton(kv, kv, k_cache, v_cache, slots)
        ran.append(("write", 1, count))
        for kind in layer_kinds:
            for splits in (1 << i for i in range(max_splits.bit_length())):
                _attend(count, 1, splits, n_heads, seq_len, k_cache, v_cache, kind)
                ran.append(("decode", splits, count))
            _attend(1, count, 1, n_heads, seq_len, k_cache, v_cache, kind)  # a prompt
            ran.append(("prefill", 1, count))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return ran


def _attend(num_seqs: int, q_len: int, splits: int, n_heads: int, seq_len: int,
            k_cache: torch.Tensor, v_cache: torch.Tensor, kind: LayerKind) -> None:
    device, dtype = k_cache.device, k_cache.dtype
    per_seq = seq_len // k_cache.shape[1] + 1
    table = torch.arange(num_seqs * per_seq, dtype=torch.int32, device=device)
    q = torch.zeros(num_seqs * q_len, n_heads, k_cache.shape[3], dtype=dtype, device=device)
    paged_attention_triton(
        q, k_cache, v_cache, table.view(num_seqs, per_seq),
        torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
        torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32, device=device),
        scale=1.0, max_query_len=q_len, max_seq_len=seq_len, num_kv_splits=splits,
        window=kind[0], softcap=kind[1])
