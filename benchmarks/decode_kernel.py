"""Decode paged attention, GB/s of KV read: our Triton kernel (its own split choice) beside dense
SDPA over the same KV made contiguous (the floor a paged kernel should reach), per shape.

    python -m benchmarks.decode_kernel [--device cuda] [--dtype bfloat16] [--json OUT]
    python -m benchmarks.decode_kernel --device cpu --smoke     (tiny shapes, Triton interpreter)

Shapes (sequences x context, query/KV heads, head dim; block size 16): 64x2k, 256x1k, 16x8k,
4x32k, 1x64k at 32/8 heads d128 (Llama-3-8B's attention) and 128x512 at 9/3 heads d64
(SmolLM2-135M's). One decode token per sequence; KV blocks scattered at random. Each figure is
the median of `--reps` timed calls (CUDA events on a GPU) after warm-up; GB/s counts the K and V
bytes one call must read. The outputs are checked against the dense result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.gpu_clocks import GpuClockSampler

# (sequences, context, query heads, KV heads, head dim)
SHAPES = ((64, 2048, 32, 8, 128), (256, 1024, 32, 8, 128), (16, 8192, 32, 8, 128),
          (4, 32768, 32, 8, 128), (1, 65536, 32, 8, 128), (128, 512, 9, 3, 64))
SMOKE_SHAPES = ((2, 64, 4, 2, 16), (1, 128, 9, 3, 16))
BLOCK_SIZE = 16
TARGETS_GBPS = {"long_context": 2500.0, "small_heads": 1200.0}  # issue 15's, on an H100


def time_ms(fn: Callable[[], object], device: str, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    if device != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def one_shape(shape: tuple[int, ...], device: str, dtype: torch.dtype, reps: int) -> dict:
    from engine.attention.triton_paged import paged_attention_triton

    seqs, ctx, heads, kv_heads, dim = shape
    per_seq = ctx // BLOCK_SIZE
    blocks = seqs * per_seq
    k_cache = torch.randn(blocks, BLOCK_SIZE, kv_heads, dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks, device=device).view(seqs, per_seq).to(torch.int32)
    seq_lens = torch.full((seqs,), ctx, device=device, dtype=torch.int32)
    starts = torch.arange(seqs + 1, device=device, dtype=torch.int32)
    q = torch.randn(seqs, heads, dim, device=device, dtype=dtype)
    kwargs = {"scale": dim ** -0.5, "max_query_len": 1, "max_seq_len": ctx}

    def paged() -> torch.Tensor:
        return paged_attention_triton(q, k_cache, v_cache, table, seq_lens, starts, **kwargs)

    dense_k = k_cache[table.long()].reshape(seqs, ctx, kv_heads, dim).transpose(1, 2).contiguous()
    dense_v = v_cache[table.long()].reshape(seqs, ctx, kv_heads, dim).transpose(1, 2).contiguous()

    def dense() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q.view(seqs, heads, 1, dim), dense_k, dense_v, enable_gqa=True, scale=dim ** -0.5)

    error = (paged().float() - dense().view(seqs, heads, dim).float()).abs().max().item()
    kv_bytes = 2 * seqs * ctx * kv_heads * dim * k_cache.element_size()
    paged_ms, dense_ms = time_ms(paged, device, reps), time_ms(dense, device, reps)
    return {"seqs": seqs, "ctx": ctx, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
            "kv_mb": kv_bytes / 1e6, "paged_ms": paged_ms, "paged_gbps": kv_bytes / paged_ms / 1e6,
            "dense_ms": dense_ms, "dense_gbps": kv_bytes / dense_ms / 1e6,
            "max_abs_error": error}


def run(device: str, dtype: torch.dtype, smoke: bool, reps: int) -> list[dict]:
    rows = []
    for shape in SMOKE_SHAPES if smoke else SHAPES:
        rows.append(one_shape(shape, device, dtype, reps))
        print(json.dumps(rows[-1]), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, interpreter)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with GpuClockSampler() as clocks:  # a slowed GPU, not the kernel, may explain a figure
        rows = run(args.device, getattr(torch, args.dtype), args.smoke, args.reps)
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(json.dumps({"gpu_clocks": clocks.summary()}))
    if args.json:
        args.json.write_text(json.dumps({"device": name, "dtype": args.dtype, "rows": rows,
                                         "targets_gbps": TARGETS_GBPS,
                                         "gpu_clocks": clocks.summary()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
