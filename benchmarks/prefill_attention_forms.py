"""One sequence's prefill attention on CPU, the forms side by side: the native causal prefill
kernel (csrc/prefill_attention.cpp, the engine's form where it builds: AVX-512, bf16 with
AVX512-BF16), SDPA's flash kernel over K/V heads expanded per query head (the engine's form
elsewhere), SDPA with `enable_gqa` (which takes SDPA's math path on CPU), and query tiles over
bmm (`_attend_prefill_tiled`, the form for soft-capped layers). With `--avx2-build` on an
AVX-512 machine, also the kernel as AVX2 machines build it (`-mno-avx512f`: fp32 only). On a CPU
with AMX, also the kernel built without it (its bf16 products on vdpbf16ps instead). Default
model's shapes (9 query heads, 3 K/V heads, d64); `--pairs` Q:K are a chunk of Q queries at the
end of K keys (Q == K: a whole prompt). Median ms per call over `--repeats`, the forms
alternating.

With `--against REV`, also the kernel's sources as they were at git revision REV, built the same
way (and its AVX2 build with `--avx2-build`), so a change to the kernel is timed before and after
in one process; the last columns are REV's time over this checkout's.

    python -m benchmarks.prefill_attention_forms [--pairs 256:256,512:512,256:768,512:1024,128:1024]
        [--dtypes float32,bfloat16] [--repeats 20] [--threads 2] [--avx2-build] [--against REV]
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from benchmarks.common import REPO, file_at
from engine.attention.cpu_kernel import (
    CFLAGS,
    NO_AMX_CFLAGS,
    PREFILL_PREFIX,
    PREFILL_SOURCE,
    build_prefill_kernel,
    load_prefill_kernel,
)
from engine.attention.torch_paged import _attend_causal_sdpa, _attend_prefill_tiled
from engine.native_build import build_native, cpu_has_amx_bf16

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
FORM_NAMES = ("native kernel", "native kernel, AVX2 build", "native kernel, no AMX",
              "sdpa, K/V expanded",
              "sdpa, enable_gqa", "query tiles")


def kernel_at(rev: str, extra_cflags: tuple[str, ...] = ()) -> ModuleType:
    """The prefill kernel as its sources (the .cpp and the headers beside it) were at git
    revision `rev`, built with this checkout's flags into a temporary folder."""
    csrc = PREFILL_SOURCE.parent.relative_to(REPO).as_posix()
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{csrc}"], cwd=REPO,
                             check=True, capture_output=True, text=True).stdout.split()
    folder = Path(tempfile.mkdtemp(prefix="prefill-kernel-at-"))
    for name in listing:
        if name == PREFILL_SOURCE.name or name.endswith(".h"):
            (folder / name).write_bytes(file_at(rev, f"{csrc}/{name}"))
    return build_native(PREFILL_PREFIX, folder / PREFILL_SOURCE.name, (*CFLAGS, *extra_cflags))


def kernel_builds(avx2_build: bool, against: str | None) -> dict[str, ModuleType | None]:
    """The native kernels to time, by form name."""
    builds = {"native kernel": load_prefill_kernel()}
    if cpu_has_amx_bf16():  # the kernel's vdpbf16ps products, as a build without AMX has them
        builds["native kernel, no AMX"] = build_prefill_kernel(NO_AMX_CFLAGS)
    if avx2_build:
        builds["native kernel, AVX2 build"] = build_prefill_kernel(("-mno-avx512f",))
    if against:
        builds[f"native kernel at {against}"] = kernel_at(against)
        if avx2_build:
            builds[f"native kernel, AVX2 build, at {against}"] = kernel_at(against,
                                                                          ("-mno-avx512f",))
    return builds


def forms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          builds: dict[str, ModuleType | None]) -> dict[str, Callable[[], object]]:
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
    for name, kernel in builds.items():  # each build that runs the dtype, whatever the policy
        if kernel is not None and kernel.supports(str(q.dtype).removeprefix("torch.")):
            calls[name] = functools.partial(kernel.causal_prefill_attention, q, k_rows, v_rows,
                                            scale, out, 0)
    return calls


def measure(lq: int, seq_len: int, dtype: torch.dtype, repeats: int,
            builds: dict[str, ModuleType | None]) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(lq, HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(KV_HEADS, seq_len, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(KV_HEADS, seq_len, HEAD_DIM, generator=g).to(dtype)
    calls = forms(q, k, v, builds)
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
    p.add_argument("--against", metavar="REV",
                   help="also time the kernel's sources at this git revision")
    args = p.parse_args()
    builds = kernel_builds(args.avx2_build, args.against)
    names = [*FORM_NAMES, *(name for name in builds if name not in FORM_NAMES)]
    torch.set_num_threads(args.threads)
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.pairs.split(",")]
    print(f"machine: {platform.machine()}, {args.threads} threads, torch {torch.__version__}; "
          f"ms per call, median of {args.repeats}")
    for dtype_name in args.dtypes.split(","):
        befores = list(names[len(FORM_NAMES):])
        print(f"\n| dtype | queries × keys | {' | '.join(names)} | SDPA / native |"
              + "".join(f" {name} / now |" for name in befores))
        print("|---|---|" + "---|" * (len(names) + 1 + len(befores)))
        for lq, seq_len in pairs:
            ms = measure(lq, seq_len, getattr(torch, dtype_name), args.repeats, builds)
            print(row(dtype_name, lq, seq_len, ms, names, befores))


def row(dtype_name: str, lq: int, seq_len: int, ms: dict[str, float], names: list[str],
        befores: list[str]) -> str:
    """One table row: every form's ms, SDPA over the native kernel, and each earlier build over
    the build of this checkout it corresponds to."""
    cells = " | ".join(f"{ms[name]:.2f}" if name in ms else "-" for name in names)
    native = ms.get("native kernel")
    line = f"| {dtype_name} | {lq} × {seq_len} | {cells} | "
    line += f"{ms['sdpa, K/V expanded'] / native:.2f}x |" if native else "- |"
    for before in befores:
        now = before.split(" at ")[0].rstrip(",")
        line += f" {ms[before] / ms[now]:.2f}x |" if before in ms and now in ms else " - |"
    return line


if __name__ == "__main__":
    main()
