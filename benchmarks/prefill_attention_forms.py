"""One sequence's prefill attention on CPU, the forms side by side: the native causal prefill
kernel (csrc/prefill_attention.cpp, the engine's form where it builds: AVX-512, bf16 with
AVX512-BF16), SDPA's flash kernel over K/V heads expanded per query head (the engine's form
elsewhere), SDPA with `enable_gqa` (which takes SDPA's math path on CPU), and query tiles over
bmm (`_attend_prefill_tiled`, the form for soft-capped layers). With `--avx2-build` on an
AVX-512 machine, also the kernel as AVX2 machines build it (`-mno-avx512f`: fp32 only). Default
model's shapes (9 query heads, 3 K/V heads, d64); `--pairs` Q:K are a chunk of Q queries at the
end of K keys (Q == K: a whole prompt). Median ms per call over `--repeats`, the forms
alternating.

    python -m benchmarks.prefill_attention_forms [--pairs 256:256,512:512,256:768,512:1024,128:1024]
        [--dtypes float32,bfloat16] [--repeats 20] [--threads 2] [--avx2-build]
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention.cpu_kernel import build_prefill_kernel, load_prefill_kernel
from engine.attention.torch_paged import (
    _attend_causal_sdpa,
    _attend_prefill_tiled,
    native_prefill_runs,
)

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
FORM_NAMES = ("native kernel", "native kernel, AVX2 build", "sdpa, K/V expanded",
              "sdpa, enable_gqa", "query tiles")


def forms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, avx2_build: bool = False
          ) -> dict[str, Callable[[], object]]:
    """q: [lq, H, D]; k, v: [n_kv, L, D]. Each form writes or returns [lq, H, D]."""
    scale, out = HEAD_DIM ** -0.5, torch.empty_like(q)
    q_heads = q.transpose(0, 1)
    lq, seq_len = q.shape[0], k.shape[1]
    mask = torch.ones(lq, seq_len, dtype=torch.bool).tril_(seq_len - lq)

    def gqa_math() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_heads, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)

    calls = {"sdpa, K/V expanded": lambda: _attend_causal_sdpa(q_heads, k, v, scale, None),
             "sdpa, enable_gqa": gqa_math,
             "query tiles": lambda: _attend_prefill_tiled(q, k, v, scale, out)}
    k_rows, v_rows = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    builds = {"native kernel": load_prefill_kernel()}
    if avx2_build:
        builds["native kernel, AVX2 build"] = build_prefill_kernel(("-mno-avx512f",))
    for name, kernel in builds.items():
        if native_prefill_runs(kernel, q):
            calls[name] = functools.partial(kernel.causal_prefill_attention, q, k_rows, v_rows,
                                            scale, out, 0)
    return calls


def measure(lq: int, seq_len: int, dtype: torch.dtype, repeats: int, avx2_build: bool = False
            ) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(lq, HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(KV_HEADS, seq_len, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(KV_HEADS, seq_len, HEAD_DIM, generator=g).to(dtype)
    calls = forms(q, k, v, avx2_build)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(repeats + 2):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if i >= 2:  # the first calls allocate and warm caches
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default="256:256,512:512,256:768,512:1024,128:1024",
                   help="comma list of QUERIES:KEYS")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--avx2-build", action="store_true",
                   help="also time the kernel as AVX2 machines build it (an AVX-512 machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.pairs.split(",")]
    print(f"machine: {platform.machine()}, {args.threads} threads, torch {torch.__version__}; "
          f"ms per call, median of {args.repeats}")
    for dtype_name in args.dtypes.split(","):
        print(f"\n| dtype | queries × keys | {' | '.join(FORM_NAMES)} | SDPA / native |")
        print("|---|---|" + "---|" * (len(FORM_NAMES) + 1))
        for lq, seq_len in pairs:
            ms = measure(lq, seq_len, getattr(torch, dtype_name), args.repeats, args.avx2_build)
            cells = " | ".join(f"{ms[name]:.2f}" if name in ms else "-" for name in FORM_NAMES)
            native = ms.get("native kernel")
            ratio = f"{ms['sdpa, K/V expanded'] / native:.2f}x" if native else "-"
            print(f"| {dtype_name} | {lq} × {seq_len} | {cells} | {ratio} |")


if __name__ == "__main__":
    main()
