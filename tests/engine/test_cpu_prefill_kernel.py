"""The native causal prefill-attention kernel (engine/attention/csrc/prefill_attention.cpp)
against a float64 reference: whole prompts and chunks after a prefix, lengths on both sides of its
16-query tiles and 32-key chunks (1 to 700), GQA groups 1/3/4/8, head dims 64 and 128, sliding
windows, strided rows (q, k and v as slices of wider projections), the build machines without
AVX512-BF16 or AMX compile, its refusals, and its place in the torch paged-attention path. On a
CPU with AMX the bf16 tests run its AMX products, and the build without them is tested beside it.

Tolerances: float32 within 1e-5. In bfloat16 the kernel rounds each probability to bf16 before
the V product (as SDPA's bf16 flash kernel does) and the result to bf16 once; with unit-variance
inputs the outputs are below ~1.5 in size, and the bound asserted is 2e-2 absolute (2.5 bf16 ulps
at 1.0; 8e-3 measured at 256 and 512 queries).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention.cpu_kernel import NO_AMX_CFLAGS, load_cpu_kernel, load_prefill_kernel
from engine.attention.torch_paged import native_prefill_runs, plan_attention, run_planned_attention
from tests.conftest import torch_threads
from tests.native_builds import has, prefill_variant

HEADS = {1: (4, 4), 3: (9, 3), 4: (8, 2), 8: (16, 2)}  # group: (heads, kv heads)
BF16_ATOL = 2e-2


@pytest.fixture(scope="module")
def kernel():
    native = load_prefill_kernel()
    if native is None:
        pytest.skip("the prefill kernel needs AVX-512 or AVX2 + FMA, and a C++ compiler")
    return native


def make_case(lq, length, group, dim, dtype, seed=0, wide=True):
    """q, k, v as slices of wider rows (a fused projection's layout) when `wide`."""
    heads, kv = HEADS[group]
    g = torch.Generator().manual_seed(seed)
    extra = 3 if wide else 0
    q = torch.randn(lq, heads + extra, dim, generator=g)[:, :heads].to(dtype)
    k = torch.randn(length, kv + extra, dim, generator=g)[:, :kv].to(dtype)
    v = torch.randn(length, kv + extra, dim, generator=g)[:, :kv].to(dtype)
    return q, k, v


def reference(q, k, v, scale, window=0):
    """float64: query i at position len - lq + i sees keys up to it (the last `window`)."""
    lq, heads, _ = q.shape
    length, kv = k.shape[0], k.shape[1]
    group = heads // kv
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double()
    scores = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    q_pos = torch.arange(length - lq, length).unsqueeze(1)
    k_pos = torch.arange(length).unsqueeze(0)
    hidden = k_pos > q_pos
    if window:
        hidden |= k_pos <= q_pos - window
    probs = torch.softmax(scores.masked_fill(hidden, -math.inf), -1)
    return torch.einsum("hqk,khd->qhd", probs, vd.repeat_interleave(group, 1))


def check(kernel, lq, length, group, dim, dtype, window=0):
    q, k, v = make_case(lq, length, group, dim, dtype)
    out = torch.full_like(q, float("nan"))
    kernel.causal_prefill_attention(q, k, v, dim ** -0.5, out, window)
    expected = reference(q, k, v, dim ** -0.5, window)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    else:
        assert (out.double() - expected).abs().max().item() <= BF16_ATOL


@pytest.fixture(scope="module")
def avx2_build(kernel):
    """What a machine with AVX2 and FMA but no AVX-512 (Zen 2/3, Haswell to Comet Lake)
    compiles: built here where this machine's own build is the AVX-512 one."""
    if not has("avx512f"):
        pytest.skip("this machine's own build is that build")
    return prefill_variant("-mno-avx512f")


PROMPTS_AND_CHUNKS = [(1, 1), (15, 15), (16, 16), (17, 17), (33, 33), (256, 256), (300, 300),
                      (5, 40), (64, 700), (31, 96)]


@pytest.mark.parametrize("lq, length", PROMPTS_AND_CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_and_chunks_after_a_prefix(kernel, lq, length, dtype):
    if not kernel.supports(str(dtype).removeprefix("torch.")):
        pytest.skip(f"this machine's build has no {dtype} path")
    check(kernel, lq, length, 3, 64, dtype)


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_split_across_threads(kernel, dtype, threads):
    if not kernel.supports(str(dtype).removeprefix("torch.")):
        pytest.skip(f"this machine's build has no {dtype} path")
    with torch_threads(threads):
        for lq, length in ((300, 300), (64, 700), (5, 40)):
            check(kernel, lq, length, 3, 64, dtype)


@pytest.mark.parametrize("group", sorted(HEADS))
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_groups_and_head_dims(kernel, group, dim, dtype):
    if not kernel.supports(str(dtype).removeprefix("torch.")):
        pytest.skip(f"this machine's build has no {dtype} path")
    check(kernel, 50, 83, group, dim, dtype)


@pytest.mark.parametrize("lq, length, window", [(17, 17, 5), (200, 500, 64), (64, 64, 1),
                                                (40, 40, 40), (3, 100, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_windows(kernel, lq, length, window, dtype):
    if not kernel.supports(str(dtype).removeprefix("torch.")):
        pytest.skip(f"this machine's build has no {dtype} path")
    check(kernel, lq, length, 3, 64, dtype, window)


def test_the_avx2_build_runs_float32_only_and_matches_the_reference(avx2_build):
    assert avx2_build.supports("float32") and not avx2_build.supports("bfloat16")
    for lq, length in PROMPTS_AND_CHUNKS:
        check(avx2_build, lq, length, 3, 64, torch.float32)
    for group in sorted(HEADS):
        for dim in (64, 128):
            check(avx2_build, 50, 83, group, dim, torch.float32)
    for lq, length, window in [(17, 17, 5), (200, 500, 64), (64, 64, 1), (3, 100, 7)]:
        check(avx2_build, lq, length, 3, 64, torch.float32, window)
    q, k, v = make_case(4, 4, 3, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="does not support BFloat16"):
        avx2_build.causal_prefill_attention(q, k, v, 0.125, torch.empty_like(q), 0)


def test_bf16_is_built_exactly_where_the_cpu_has_it(kernel):
    assert kernel.supports("float32")
    assert kernel.supports("bfloat16") == has("avx512_bf16")
    assert not kernel.supports("float16")


def test_the_build_without_avx512_bf16_keeps_float32_and_refuses_bf16(kernel):
    """What an AVX-512 machine without AVX512-BF16 (Skylake, Ice Lake) compiles."""
    if not has("avx512_bf16"):
        pytest.skip("this machine's own build is that build")
    variant = prefill_variant("-mno-avx512bf16")
    assert variant.supports("float32") and not variant.supports("bfloat16")
    check(variant, 40, 70, 3, 64, torch.float32)
    q, k, v = make_case(4, 4, 3, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="does not support BFloat16"):
        variant.causal_prefill_attention(q, k, v, 0.125, torch.empty_like(q), 0)


def test_bad_shapes_are_refused(kernel):
    q, k, v = make_case(4, 8, 3, 64, torch.float32, wide=False)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        kernel.causal_prefill_attention(q[..., :32], k[..., :32], v[..., :32], 0.1,
                                        out[..., :32].contiguous(), 0)
    with pytest.raises(RuntimeError, match="len >= lq"):
        kernel.causal_prefill_attention(q, k[:2], v[:2], 0.1, out, 0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel.causal_prefill_attention(q, k.double(), v, 0.1, out, 0)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        kernel.causal_prefill_attention(q, k, v, 0.1, out, -1)


class _FakeBuild:
    """A prefill build that runs both dtypes, with or without AMX products."""

    def __init__(self, amx: bool) -> None:
        self.amx = amx

    def supports(self, dtype: str) -> bool:
        return dtype in ("float32", "bfloat16")

    def uses_amx(self) -> bool:
        return self.amx


def test_with_amx_bf16_prompts_go_to_the_kernel_only_where_its_products_run_on_amx(monkeypatch):
    """Where the CPU has AMX, a build whose bf16 products are vdpbf16ps loses to SDPA's flash
    kernel (on oneDNN's AMX GEMMs): bf16 prompts go to SDPA then, float32 ones stay with it."""
    from engine.attention import torch_paged

    bf16, fp32 = (torch.empty(1, 1, 64, dtype=d) for d in (torch.bfloat16, torch.float32))
    monkeypatch.setattr(torch_paged, "cpu_has_amx_bf16", lambda: True)
    assert native_prefill_runs(_FakeBuild(amx=True), bf16)
    assert not native_prefill_runs(_FakeBuild(amx=False), bf16)
    assert native_prefill_runs(_FakeBuild(amx=False), fp32)
    monkeypatch.setattr(torch_paged, "cpu_has_amx_bf16", lambda: False)
    assert native_prefill_runs(_FakeBuild(amx=False), bf16)
    assert not native_prefill_runs(None, fp32)
    assert not native_prefill_runs(_FakeBuild(amx=True), torch.empty(1, 1, 96))


def test_with_amx_products_the_kernel_takes_chunks_from_16_queries():
    from engine.attention.torch_paged import (
        PREFILL_KERNEL_CHUNK_MIN,
        PREFILL_KERNEL_CHUNK_MIN_AMX,
        prefill_kernel_chunk_min,
    )

    bf16, fp32 = (torch.empty(1, 1, 64, dtype=d) for d in (torch.bfloat16, torch.float32))
    assert prefill_kernel_chunk_min(_FakeBuild(amx=True), bf16) == PREFILL_KERNEL_CHUNK_MIN_AMX
    assert prefill_kernel_chunk_min(_FakeBuild(amx=True), fp32) == PREFILL_KERNEL_CHUNK_MIN
    assert prefill_kernel_chunk_min(_FakeBuild(amx=False), bf16) == PREFILL_KERNEL_CHUNK_MIN
    assert prefill_kernel_chunk_min(None, bf16) == PREFILL_KERNEL_CHUNK_MIN
    assert PREFILL_KERNEL_CHUNK_MIN_AMX == 16 < PREFILL_KERNEL_CHUNK_MIN


def test_bf16_products_run_on_amx_exactly_where_the_cpu_has_it(kernel):
    assert kernel.uses_amx() == (has("amx_bf16") and kernel.supports("bfloat16"))


@pytest.fixture(scope="module")
def no_amx_build(kernel):
    """What a CPU with AVX512-BF16 but no AMX (Zen 4, Cooper Lake) compiles: built here where
    this machine's own build has the AMX products, so both bf16 paths are tested on it."""
    if not has("amx_bf16"):
        pytest.skip("this machine's own build is that build")
    return prefill_variant(*NO_AMX_CFLAGS)


def test_the_build_without_amx_keeps_its_vdpbf16ps_products(no_amx_build):
    assert not no_amx_build.uses_amx() and no_amx_build.supports("bfloat16")
    for lq, length in PROMPTS_AND_CHUNKS:
        check(no_amx_build, lq, length, 3, 64, torch.bfloat16)
    for group in sorted(HEADS):
        for dim in (64, 128):
            check(no_amx_build, 50, 83, group, dim, torch.bfloat16)
    check(no_amx_build, 200, 500, 3, 64, torch.bfloat16, 64)


@pytest.mark.parametrize("lq, length, window", [(1024, 1024, 0), (96, 2000, 0), (700, 700, 300)])
def test_long_contexts_in_bf16(kernel, lq, length, window):
    """Long prompts and a long chunk: many key chunks per tile (the AMX path's scores and values
    accumulate over them), and a window far inside the sequence."""
    if not kernel.supports("bfloat16"):
        pytest.skip("this machine's build has no bfloat16 path")
    check(kernel, lq, length, 3, 64, torch.bfloat16, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_paged_path_attends_prompts_with_it(kernel, dtype):
    """A step with a decode row, a whole prompt (its own fresh K/V) and a long chunk after a
    cached prefix (gathered from the paged cache): the same as the path without the kernel."""
    if not native_prefill_runs(kernel, torch.empty(1, 1, 64, dtype=dtype)):
        pytest.skip(f"this machine's build has no {dtype} path")
    g = torch.Generator().manual_seed(1)
    block, heads, kv, dim = 16, 9, 3, 64
    k_cache = torch.randn(40, block, kv, dim, generator=g).to(dtype)
    v_cache = torch.randn(40, block, kv, dim, generator=g).to(dtype)
    table = torch.randperm(40, generator=g).to(torch.int32).view(4, 10)
    query_lens, seq_lens = [1, 70, 90], [50, 70, 150]
    q = torch.randn(sum(query_lens), heads, dim, generator=g).to(dtype)
    starts = [0, 1, 71]
    new_k = torch.cat([_slots(k_cache, table[i], seq_lens[i] - n, seq_lens[i], block)
                       for i, n in enumerate(query_lens)])
    new_v = torch.cat([_slots(v_cache, table[i], seq_lens[i] - n, seq_lens[i], block)
                       for i, n in enumerate(query_lens)])
    plan = plan_attention(table, query_lens, seq_lens, block)
    decode = load_cpu_kernel()
    assert decode is not None  # the prefill kernel runs beside it: built wherever it builds
    got, want = torch.empty_like(q), torch.empty_like(q)
    run_planned_attention(plan, q, k_cache, v_cache, 0.125, got, (new_k, new_v), decode,
                          native_prefill=kernel)
    run_planned_attention(plan, q, k_cache, v_cache, 0.125, want, (new_k, new_v), decode)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=BF16_ATOL, rtol=0)
    for a, n in zip(starts, query_lens):
        torch.testing.assert_close(got[a:a + n].float(), want[a:a + n].float(), **tol)


def _slots(cache, row, first, last, block):
    """The cache's slots first..last-1 of a sequence whose blocks are `row`: its fresh K or V."""
    positions = torch.arange(first, last)
    return cache[row[positions // block].long(), positions % block]
