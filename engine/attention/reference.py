"""Naive fp32 paged attention: the ground truth every other backend is tested against."""

from __future__ import annotations

import torch


def paged_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, scale: float, max_query_len: int,
    max_seq_len: int, out: torch.Tensor | None = None, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`window`: a query at position p sees keys p - window + 1 .. p (sliding window);
    `softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2)."""
    del max_query_len, max_seq_len  # the reference walks every sequence in full
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // n_kv
    result = torch.empty_like(q) if out is None else out
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_i = q[starts[i]:starts[i + 1]].float()  # [lq, H, D]
        lq = q_i.shape[0]
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[i, :num_blocks].long()
        k_i = k_cache[blocks].reshape(-1, n_kv, k_cache.shape[3])[:seq_len].float()
        v_i = v_cache[blocks].reshape(-1, n_kv, v_cache.shape[3])[:seq_len].float()
        k_i = k_i.repeat_interleave(group, dim=1)  # [S, H, D]
        v_i = v_i.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_i, k_i) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - lq, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden.unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        result[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v_i).to(q.dtype)
    return result
