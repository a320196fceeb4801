"""Backend selection and the step metadata shared by every paged_attention implementation."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

PagedAttentionFn = Callable[..., torch.Tensor]


@dataclass
class AttentionMetadata:
    """Describes one ragged step; built once per step by the model runner, used by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset of each new token
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    # Host-side copies, so CPU paths can plan without reading tensors back.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # Split-KV count fixed by the caller (CUDA graphs: one per captured bucket); None lets the
    # kernel choose from max_seq_len.
    num_kv_splits: int | None = None


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's K/V ([num_tokens, n_kv_heads, head_dim]) at their slots."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


class AttentionBackend:
    """What the model runner holds: `prepare` once per step, then one call per layer with the
    paged_attention interface. Stateless implementations ignore `prepare`."""

    def __init__(self, fn: PagedAttentionFn, name: str):
        self._fn = fn
        self.name = name
        # How this step's K/V reach the cache: the backend's own kernel, else index_copy.
        self.write_kv: Callable[..., None] = getattr(fn, "write_kv", write_kv_cache)
        # Backends that can attend a fresh prompt straight from this step's K/V say so.
        self._takes_new_kv = bool(getattr(fn, "takes_new_kv", False))

    def prepare(self, block_table: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                block_size: int) -> None:
        prepare = getattr(self._fn, "prepare", None)
        if prepare is not None:
            prepare(block_table, query_lens, seq_lens, block_size)

    def __call__(self, *args: torch.Tensor,
                 new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                 num_kv_splits: int | None = None, window: int | None = None,
                 softcap: float | None = None, **kwargs: object) -> torch.Tensor:
        for name, value in (("window", window), ("softcap", softcap)):
            if value is not None:  # sliding window, logit soft-capping: every backend has both
                kwargs[name] = value
        if self._takes_new_kv:
            kwargs["new_kv"] = new_kv
        if num_kv_splits is not None:  # only the Triton kernel takes it (graphs need Triton)
            kwargs["num_kv_splits"] = num_kv_splits
        return self._fn(*args, **kwargs)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks the Triton kernel for CUDA tensors when available, else the torch path."""
    if name == "reference":
        from engine.attention.reference import paged_attention_reference

        return AttentionBackend(paged_attention_reference, "reference")
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend 'triton' needs a CUDA device, or "
                             "TRITON_INTERPRET=1 to run the kernels on CPU")
        try:
            from engine.attention.triton_paged import paged_attention_triton
        except ImportError as exc:
            if name == "triton":
                raise ValueError(f"attention_backend 'triton' is not available: {exc}") from exc
        else:
            return AttentionBackend(paged_attention_triton, "triton")
    from engine.attention.torch_paged import TorchPagedAttention

    return AttentionBackend(TorchPagedAttention(), "torch")
