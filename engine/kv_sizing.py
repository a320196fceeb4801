"""How many KV blocks the cache gets: from the configured budget on CPU, and on CUDA from what
`gpu_memory_fraction` of the GPU leaves after the weights and an activation reserve (like vLLM's
gpu_memory_utilization). Called by the model runner once the weights are loaded."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.config import CacheConfig, ModelConfig, SchedulerConfig, kv_bytes_per_block


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# Memory a CUDA process uses outside torch's caching allocator, so torch.cuda.memory_reserved
# does not count it: the CUDA context, loaded kernel modules (Triton, cuBLAS), NCCL buffers.
CUDA_OVERHEAD_BYTES = 512 * 2**20


def num_kv_blocks(cache: CacheConfig, model: ModelConfig, dtype: torch.dtype,
                  device: torch.device, scheduler: SchedulerConfig | None = None,
                  graphs: bool = False) -> int:
    """How many blocks the KV cache gets. Called once the weights are loaded: on CUDA (with no
    num_blocks, kv_cache_gb or kv_cache_memory_fraction) the cache gets what `gpu_memory_fraction`
    of the GPU leaves after what this process holds and an activation reserve sized for
    `scheduler` (default: SchedulerConfig()) — with CUDA `graphs`, plus their own memory pool,
    which holds a decode step's activations apart from eager steps'; on CPU the fixed default
    (1 GiB)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = kv_bytes_per_block(model, cache.block_size, dtype.itemsize)
    if (device.type == "cuda" and cache.kv_cache_gb is None
            and cache.kv_cache_memory_fraction is None):
        return _cuda_kv_blocks(cache, model, dtype, device, scheduler or SchedulerConfig(),
                               per_block, graphs)
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    else:
        available = available_memory_bytes()
    blocks = cache.budget_bytes(available) // per_block
    if blocks < 1:
        raise ValueError(
            f"the KV cache budget holds no block: one block needs {per_block} bytes "
            f"(raise kv_cache_gb or kv_cache_memory_fraction)"
        )
    return int(blocks)


def activation_reserve_bytes(model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                             dtype_bytes: int) -> int:
    """GPU memory one step may need beyond the weights and the KV cache, at most.

    Layers run one after another without autograd, so only one layer's tensors are alive at a
    time. Per scheduled token that is the residual stream, the normed input and the layer output
    (3 x hidden), plus the wider of the MLP (gate_up [2 x intermediate], then SiLU and the product
    [intermediate each]: 4 x intermediate) and attention (qkv, then RoPE's temporaries, the rotated
    q and the output: (heads + 2 kv_heads) x head_dim + 4 x heads x head_dim), in the model dtype;
    plus RMSNorm's fp32 copies (8 bytes x hidden). Doubled: the caching allocator rounds sizes up
    and does not always reuse freed blocks of other sizes. Logits exist only for each request's
    last token (at most min(tokens, max_num_seqs) rows): the lm_head output, its fp32 copy and the
    sampler's fp32 temporaries (softmax, noise, sorted values with int64 indices, masks, scatter)
    come to about dtype + 32 bytes per vocabulary entry; logit processing (penalties: the
    processed copy, token counts for output and prompt, masks, the penalized rows' temporaries)
    adds up to 32 more. Not counted: a prompt whose logprobs are asked for adds up to
    engine.scheduler.PROMPT_LOGPROBS_CHUNK rows of fp32 logits and their log-softmax.
    """
    attention = ((model.num_heads + 2 * model.num_kv_heads) * model.head_dim
                 + 4 * model.num_heads * model.head_dim)
    widest = max(4 * model.intermediate_size, attention)
    per_token = dtype_bytes * (3 * model.hidden_size + widest) + 8 * model.hidden_size
    logits_rows = min(max_num_batched_tokens, max_num_seqs)
    return (2 * max_num_batched_tokens * per_token
            + logits_rows * model.vocab_size * (dtype_bytes + 64))


def cuda_kv_budget_bytes(total: int, reserved: int, free: int, reserve: int,
                         fraction: float) -> int:
    """Bytes for the KV cache on a GPU of `total` bytes, like vLLM's gpu_memory_utilization: the
    engine may use `fraction` of the GPU's total memory; this process already holds `reserved`
    (the weights, through torch's allocator) and keeps `reserve` for activations and memory
    outside torch; the cache is never larger than the `free` memory left after that reserve
    (other processes, e.g. workers sharing this GPU, hold the rest). Never negative."""
    return max(0, min(int(fraction * total) - reserved - reserve, free - reserve))


def _cuda_kv_blocks(cache: CacheConfig, model: ModelConfig, dtype: torch.dtype,
                    device: torch.device, scheduler: SchedulerConfig, per_block: int,
                    graphs: bool) -> int:
    # Blocks an earlier engine of this process freed but torch still caches would count as
    # ours (memory_reserved) though nothing uses them: hand them back first.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    seqs = scheduler.max_num_seqs
    reserve = CUDA_OVERHEAD_BYTES + activation_reserve_bytes(
        model, scheduler.max_num_batched_tokens, seqs, dtype.itemsize)
    if graphs:  # the largest bucket's decode step: max_num_seqs tokens, as many logits rows
        reserve += activation_reserve_bytes(model, seqs, seqs, dtype.itemsize)
    budget = cuda_kv_budget_bytes(total, reserved, free, reserve, cache.gpu_memory_fraction)
    if budget < per_block:
        gib = 2**30
        raise ValueError(
            f"the KV cache budget on {device} holds no block: gpu_memory_fraction "
            f"{cache.gpu_memory_fraction} of {total / gib:.2f} GiB, minus {reserved / gib:.2f} "
            f"GiB this process holds (weights), minus a {reserve / gib:.2f} GiB activation "
            f"reserve, within {free / gib:.2f} GiB free, leaves {budget} bytes; one block needs "
            f"{per_block} bytes (raise gpu_memory_fraction, lower max_num_batched_tokens, or "
            f"set kv_cache_gb)")
    return budget // per_block
