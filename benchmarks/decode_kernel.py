"""Decode paged attention, GB/s of KV read: our Triton kernel (its own split choice) beside dense
SDPA over the same KV made contiguous (the floor a paged kernel should reach), per shape.

    python -m benchmarks.decode_kernel [--device cuda] [--dtype bfloat16] [--json OUT]
    python -m benchmarks.decode_kernel --device cpu --smoke     (tiny shapes, Triton interpreter)

Shapes (sequences x context, query/KV heads, head dim; block size 16): 64x2k, 256x1k, 16x8k,
4x32k, 1x64k at 32/8 heads d128 (Llama-3-8B's attention) and 128x512 at 9/3 heads d64
(SmolLM2-135M's). One decode token per sequence; KV blocks scattered at random. Each figure is
the median of `--reps` timed calls (CUDA events on a GPU) after warm-up; GB/s counts the K and V
bytes one call must read. The outputs are checked against the dense result.

On a GPU each call is timed twice: launched from Python (`*_ms`), and replayed from a CUDA graph
captured around it (`*_graph_ms`), the way decode steps run with `--cuda-graphs` (on by default on
CUDA). At the small shapes a launch from Python costs more host time than the kernel takes on the
GPU, so only the graph figure is the kernel's. Before every timed call a 512 MiB buffer is zeroed,
so that no call finds the KV in the GPU's L2 (50 MB at 128x512 d64; the L2 holds 50-60 MB):
figures before 2026-11-28 evening were taken without either. `--sweep-splits` adds, per shape,
the graph figure at every forced split-KV count (the kernel's own choice is `splits`).
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


L2_FLUSH_BYTES = 512 << 20  # more than any GPU's L2 (H100 50 MB, H200 60 MB, B200 126 MB)


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
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        flush.zero_()  # evicts the last call's KV; gives the host a head start on the launch
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def as_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` captured in a CUDA graph (after a warm-up call on a side stream, which compiles and
    allocates); the returned callable replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def shape_calls(shape: tuple[int, ...], device: str, dtype: torch.dtype
                ) -> tuple[Callable[[int | None], torch.Tensor], Callable[[], torch.Tensor], int]:
    """For one shape: the paged kernel (given a forced split count or None for its own), dense
    SDPA over the same KV made contiguous, and the bytes of K and V one call reads."""
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

    def paged(splits: int | None = None) -> torch.Tensor:
        return paged_attention_triton(q, k_cache, v_cache, table, seq_lens, starts,
                                      num_kv_splits=splits, **kwargs)

    dense_k = k_cache[table.long()].reshape(seqs, ctx, kv_heads, dim).transpose(1, 2).contiguous()
    dense_v = v_cache[table.long()].reshape(seqs, ctx, kv_heads, dim).transpose(1, 2).contiguous()

    def dense() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q.view(seqs, heads, 1, dim), dense_k, dense_v, enable_gqa=True,
            scale=dim ** -0.5).view(seqs, heads, dim)

    return paged, dense, 2 * seqs * ctx * kv_heads * dim * k_cache.element_size()


def one_shape(shape: tuple[int, ...], device: str, dtype: torch.dtype, reps: int,
              sweep_splits: bool = False) -> dict:
    from engine.attention.splits import MAX_SPLITS, pick_num_splits

    paged, dense, kv_bytes = shape_calls(shape, device, dtype)
    error = (paged().float() - dense().float()).abs().max().item()
    seqs, ctx, heads, kv_heads, dim = shape
    row = {"seqs": seqs, "ctx": ctx, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
           "kv_mb": kv_bytes / 1e6, "max_abs_error": error}
    timed = {"paged": paged, "dense": dense}
    if device == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        row["splits"] = pick_num_splits(seqs, kv_heads, 1, ctx, sms)
        try:  # a capture that fails costs its columns, not the run
            timed |= {"paged_graph": as_graph(paged), "dense_graph": as_graph(dense)}
        except RuntimeError as exc:
            row["graph_error"] = str(exc)[:300]
    for name, fn in timed.items():
        row[f"{name}_ms"] = time_ms(fn, device, reps)
        row[f"{name}_gbps"] = kv_bytes / row[f"{name}_ms"] / 1e6
    if sweep_splits and device == "cuda":
        counts = [1 << i for i in range(MAX_SPLITS.bit_length())]
        try:
            row["paged_graph_gbps_by_splits"] = {
                n: kv_bytes / time_ms(as_graph(lambda n=n: paged(n)), device, reps) / 1e6
                for n in counts}
        except RuntimeError as exc:
            row["sweep_error"] = str(exc)[:300]
    return row


def run(device: str, dtype: torch.dtype, smoke: bool, reps: int,
        sweep_splits: bool = False) -> list[dict]:
    rows = []
    for shape in SMOKE_SHAPES if smoke else SHAPES:
        rows.append(one_shape(shape, device, dtype, reps, sweep_splits))
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
    parser.add_argument("--sweep-splits", action="store_true",
                        help="also time every forced split-KV count (CUDA graphs)")
    args = parser.parse_args(argv)
    with GpuClockSampler() as clocks:  # a slowed GPU, not the kernel, may explain a figure
        rows = run(args.device, getattr(torch, args.dtype), args.smoke, args.reps,
                   args.sweep_splits)
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(json.dumps({"gpu_clocks": clocks.summary()}))
    if args.json:
        args.json.write_text(json.dumps({"device": name, "dtype": args.dtype, "rows": rows,
                                         "targets_gbps": TARGETS_GBPS,
                                         "gpu_clocks": clocks.summary()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
