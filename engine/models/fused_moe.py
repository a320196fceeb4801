"""Mixture-of-experts experts as grouped GEMMs in Triton: the (token, expert) pairs sorted by
expert and padded per expert to whole row blocks (`align`), so every program multiplies one block
of rows by one expert's weights — no gather of the tokens beforehand, no per-expert launch.

Two launches of one kernel: gate/up ([pairs, 2 I] from the tokens' rows of x), then — after
SiLU(gate) * up — down ([pairs, H], each row scaled by its routing weight); each token's k rows
are then summed in ascending expert order (transformers' order). Offsets are int64; padding rows
point past the last pair and are masked.

Capture-safe (CUDA graphs): nothing reads the device from the host. The row blocks are sized for
the most any routing can need (`max_blocks`), the blocks past the routing's own are padding only,
and their programs skip the multiply (the first row of a used block is always a real pair).

Tested against the loop in engine.models.moe under TRITON_INTERPRET=1 and, with `pytest -m gpu`,
on CUDA (tests/engine/test_fused_moe.py; every MoE family on CUDA with CUDA graphs in
tests/gpu/test_families_on_cuda.py, both passed on one H100 on 2026-11-27): the engine's MoE path
on CUDA, and on CPU where PDSERVE_TRITON_MOE=1."""

# Triton reads kernel annotations as specialization hints: the kernels' arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16  # rows (pairs) per program: every expert's rows padded to a multiple of it


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, pair_weights_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_pairs, n, k, top_k, stride_am, stride_be, stride_bn, stride_cm,
    A_PER_TOKEN: tl.constexpr, SCALE_ROWS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[pair, :] = A[row of pair] @ B[expert]^T (B [E, n, k]); A's row is the pair's token
    (A_PER_TOKEN: x) or the pair itself; rows scaled by their routing weight (SCALE_ROWS)."""
    block = tl.program_id(0)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    a_rows = (pairs // top_k if A_PER_TOKEN else pairs).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # a block past the routing's own holds padding only: no multiply (its stores are masked)
    k_stop = tl.where(tl.load(sorted_pairs_ptr + block * BLOCK_M) < num_pairs, k, 0)
    for k0 in range(0, k_stop, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
                    + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # fp32 math (the interpreter's bf16 dot is wrong; fp32 must not become TF32)
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if SCALE_ROWS:
        acc *= tl.load(pair_weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs[:, None].to(tl.int64) * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def max_blocks(num_pairs: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """The most row blocks any routing of `num_pairs` pairs over `num_experts` experts fills: each
    expert's run rounds up to whole blocks, and every block holds at least one pair."""
    return min(num_pairs, (num_pairs + num_experts * (block_m - 1)) // block_m)


def align(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (token * k + slot) sorted by expert, each expert's run padded to a multiple of
    `block_m` with `num_pairs` (masked), and each row block's expert; `max_blocks` blocks in
    all, those past the routing's own padding only (their expert: the last one)."""
    flat = experts.flatten()
    num_pairs, device = flat.numel(), experts.device
    order = torch.argsort(flat, stable=True)
    # bincount reads its input's maximum on the host on CUDA: a scatter-add does not
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    first = torch.cumsum(counts, 0) - counts  # each expert's first pair in `order`
    rank = torch.arange(num_pairs, device=device) - first[flat[order]]
    sorted_pairs[starts[flat[order]] + rank] = order
    block_ends = torch.cumsum(padded // block_m, 0)
    block_experts = torch.searchsorted(block_ends, torch.arange(blocks, device=device),
                                       right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, pair_weights: torch.Tensor,
            sorted_pairs: torch.Tensor, block_experts: torch.Tensor, top_k: int,
            per_token: bool, scale_rows: bool) -> None:
    n, k = b.shape[1], b.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, pair_weights, sorted_pairs, block_experts, c.shape[0], n, k, top_k,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        A_PER_TOKEN=per_token, SCALE_ROWS=scale_rows,
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1" or a.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The experts' weighted SwiGLU outputs summed per token: x [T, H], gate_up [E, 2 I, H],
    down [E, H, I], weights and experts [T, k] (engine.models.moe's routing)."""
    tokens, top_k = experts.shape
    if tokens == 0:
        return torch.zeros_like(x)
    # each token's experts in ascending order: its rows are summed in transformers' order
    experts, slots = torch.sort(experts, dim=-1)
    weights = weights.gather(1, slots).contiguous()
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    sorted_pairs, block_experts = align(experts, gate_up.shape[0])
    num_pairs, inter = tokens * top_k, down.shape[2]
    hidden = torch.empty((num_pairs, 2 * inter), dtype=x.dtype, device=x.device)
    _launch(x, gate_up, hidden, weights, sorted_pairs, block_experts, top_k, True, False)
    act = (F.silu(hidden[:, :inter]) * hidden[:, inter:]).contiguous()
    rows = torch.empty((num_pairs, x.shape[1]), dtype=x.dtype, device=x.device)
    _launch(act, down, rows, weights.flatten(), sorted_pairs, block_experts, top_k, False, True)
    rows = rows.view(tokens, top_k, -1)
    out = rows[:, 0].clone()
    for slot in range(1, top_k):
        out += rows[:, slot]
    return out
