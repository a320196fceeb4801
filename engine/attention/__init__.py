"""One paged_attention interface with several implementations.

    paged_attention(q,                 # [num_tokens, n_heads, head_dim]
                    k_cache, v_cache,  # [num_blocks, block_size, n_kv_heads, head_dim]
                    block_table,       # [num_seqs, max_blocks] int32
                    seq_lens,          # [num_seqs] KV length including this step's tokens
                    query_start_loc,   # [num_seqs + 1]
                    *, scale, max_query_len, max_seq_len, out=None) -> Tensor

Query j of sequence i sits at position seq_lens[i] - q_len_i + j; the causal mask is bottom-right
aligned. Decode, chunked prefill and prefill are just different query lengths.
"""

from __future__ import annotations

from engine.attention.interface import (
    AttentionBackend,
    AttentionMetadata,
    get_attention_backend,
    write_kv_cache,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend", "write_kv_cache"]
