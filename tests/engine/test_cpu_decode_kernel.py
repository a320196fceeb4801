"""The native CPU paged decode-attention kernel (engine/attention/csrc/paged_decode.cpp) against
the naive fp32 reference: GQA groups 1/3/4/8 (and 16, past the specialised kernels), head dims
64/128 (compiled-in) and 80 (generic), lengths on both sides of the 16-token block boundary up to
4096, scattered block tables whose unused entries and slots hold NaN, strided q/out rows, 1..130
sequences, KV splits under several thread counts, other block sizes, the paths machines without
AVX-512 (or its BF16 extension) or AVX2 compile, and short prefill chunks sent through it as
decode rows.

Tolerances: float32 within 1e-5 (relative and absolute). bfloat16 K/V/q are exact in fp32 and the
kernel computes in fp32, so its only extra error is rounding the result to bf16 once: at most half
a bf16 ulp, 2^-8 relative, which is the bound asserted (plus 1e-5 absolute for fp32 noise).
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.cpu_kernel import load_cpu_kernel
from engine.attention.reference import paged_attention_reference
from tests.conftest import torch_threads
from tests.native_builds import DECODE_VARIANTS, decode_variant, has

LENS = [1, 15, 16, 17, 33, 1000, 4096]
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=1e-5, rtol=2.0 ** -8)
HEADS = {1: (4, 4), 3: (9, 3), 4: (8, 2), 8: (16, 2), 16: (32, 2)}  # group: (heads, kv heads)


@pytest.fixture(scope="module")
def kernel():
    native = load_cpu_kernel()
    if native is None:
        pytest.skip("the native CPU kernel cannot be built here (no C++ compiler or ninja)")
    return native


def make_case(lens, heads, kv_heads, dim, dtype=torch.float32, block_size=16, seed=0):
    """Blocks scattered at random; every slot and table entry a sequence must not read is NaN
    (the tails of last blocks, and unused table entries point at an all-NaN block)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 2
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    poison = int(order[-1])
    k[poison], v[poison] = float("nan"), float("nan")
    table = torch.full((len(lens), max(per_seq) + 2), poison, dtype=torch.int32)
    used = 0
    for i, (n, nb) in enumerate(zip(lens, per_seq)):
        table[i, :nb] = order[used:used + nb]
        used += nb
        tail = n - (nb - 1) * block_size
        k[table[i, nb - 1], tail:], v[table[i, nb - 1], tail:] = float("nan"), float("nan")
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)


def reference(q, k, v, table, lens, window=None):
    """In fp32 throughout (bf16 inputs widen exactly), the result not rounded to bf16."""
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    return paged_attention_reference(q.float(), k.float(), v.float(), table, lens, starts,
                                     scale=q.shape[-1] ** -0.5, max_query_len=1,
                                     max_seq_len=int(lens.max()), window=window)


def run(native, q, k, v, table, lens, out=None, window=0):
    out = torch.empty_like(q) if out is None else out
    native.paged_decode_attention(q, k, v, table, lens, q.shape[-1] ** -0.5, out, window)
    return out


def check(native, case, dtype, window=None, expected=None):
    """`expected`: the reference's answer when `case` is poisoned where the reference reads."""
    got = run(native, *case, window=window or 0).float()
    assert torch.isfinite(got).all()
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    expected = reference(*case, window=window) if expected is None else expected
    torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [64, 128, 80])
@pytest.mark.parametrize("group", [1, 3, 4, 8, 16])
def test_matches_reference_across_groups_dims_and_lengths(kernel, group, dim, dtype):
    heads, kv_heads = HEADS[group]
    check(kernel, make_case(LENS, heads, kv_heads, dim, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_seqs", [1, 2, 3, 7, 8, 9, 64, 130])
def test_any_number_of_sequences(kernel, num_seqs, dtype):
    """Few sequences: one KV head per work item (and splits); many: whole sequences per item."""
    g = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, 700, (num_seqs,), generator=g).tolist()
    check(kernel, make_case(lens, 9, 3, 64, dtype, seed=num_seqs), dtype)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("lens", [[4096], [2049, 1, 300], [5000, 17]], ids=str)
def test_long_contexts_split_across_threads(kernel, lens, threads):
    """Few sequences with long contexts are split along the KV and merged; a short sequence
    beside a long one leaves some of its splits empty."""
    with torch_threads(threads):
        for dtype in (torch.float32, torch.bfloat16):
            check(kernel, make_case(lens, 8, 2, 128, dtype), dtype)


def check_window(native, case, dtype, window, block_size=16):
    """Against the reference on `case`, then with NaN in every key and value slot before each
    row's window (the reference multiplies those by 0; the kernel must read none of them)."""
    expected = reference(*case, window=window)
    _, k, v, table, lens = case
    for row, n in enumerate(lens.tolist()):
        for pos in range(max(0, n - window)):
            block = int(table[row, pos // block_size])
            k[block, pos % block_size], v[block, pos % block_size] = float("nan"), float("nan")
    check(native, case, dtype, window, expected)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [1, 16, 17, 100])
def test_a_sliding_window_reads_only_the_keys_inside_it(kernel, window, dtype, threads):
    """Windows starting inside a block, on a block boundary, within one tile, and longer than
    some rows; long rows split across threads start their splits at the window; every slot
    before a row's window is NaN, so a single read of one would show."""
    with torch_threads(threads):
        for group, dim in ((3, 64), (4, 128), (1, 80)):
            heads, kv_heads = HEADS[group]
            check_window(kernel, make_case(LENS, heads, kv_heads, dim, dtype), dtype, window)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        run(kernel, *make_case([4], 4, 4, 64), window=-1)


@pytest.mark.parametrize("block_size", [8, 32, 48])
def test_other_block_sizes(kernel, block_size):
    """Tiles never cross a block: a block of 8 is one short tile, 32 two, 48 three."""
    check(kernel, make_case([1, 7, 8, 9, 47, 48, 49, 333], 9, 3, 64, block_size=block_size),
          torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_query_and_output_rows(kernel, dtype):
    """q as the engine hands it over: a view into a fused qkv projection; out a view too."""
    lens = [3, 16, 100, 1000]
    q, k, v, table, seq_lens = make_case(lens, 9, 3, 64, dtype)
    qkv = torch.randn(len(lens), (9 + 6) * 64).to(dtype)
    qkv[:, :9 * 64] = q.reshape(len(lens), -1)
    q_view = qkv[:, :9 * 64].view(len(lens), 9, 64)
    assert not q_view.is_contiguous()
    buffer = torch.full((len(lens), 9, 96), 7.0, dtype=dtype)
    out_view = buffer[:, :, 16:80]
    run(kernel, q_view, k, v, table, seq_lens, out_view)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out_view.float(), reference(q, k, v, table, seq_lens), **tol)
    assert (buffer[:, :, :16] == 7).all() and (buffer[:, :, 80:] == 7).all()


def test_rejects_mismatched_inputs(kernel):
    q, k, v, table, lens = make_case([5], 9, 3, 64)
    with pytest.raises(RuntimeError):
        run(kernel, q.to(torch.bfloat16), k, v, table, lens)
    with pytest.raises(RuntimeError):
        run(kernel, q, k, v, table.long(), lens)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        run(kernel, q, k, v, table, torch.tensor([16 * table.shape[1] + 1], dtype=torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("flag", sorted(DECODE_VARIANTS))
def test_paths_other_machines_compile(kernel, flag):
    """What other machines compile from the same source with -march=native: without AVX-512 the
    AVX2 kernel, without AVX2 the plain-loop path, with AVX-512 but no BF16 extension (Skylake-X,
    Ice Lake) bf16 q.k by widening instead of vdpbf16ps. Same results, for the shapes the vector
    kernels specialise and one they do not."""
    if not has(DECODE_VARIANTS[flag]):
        pytest.skip(f"this CPU has no {DECODE_VARIANTS[flag]}: its own build is that path")
    try:
        other = decode_variant(flag)
    except Exception as exc:  # a compiler without the flag
        pytest.skip(f"cannot build with {flag}: {exc}")
    for group, dim in ((3, 64), (4, 128), (8, 64), (1, 80)):
        heads, kv_heads = HEADS[group]
        for dtype in (torch.float32, torch.bfloat16):
            check(other, make_case(LENS, heads, kv_heads, dim, dtype), dtype)
            check_window(other, make_case(LENS, heads, kv_heads, dim, dtype), dtype, 100)

class _Recorder:
    """The native module, noting how many query rows each call got."""

    def __init__(self, native):
        self.native, self.calls = native, []

    def paged_decode_attention(self, q, *args):
        self.calls.append(q.shape[0])
        return self.native.paged_decode_attention(q, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_short_prefill_chunks_after_a_cached_prefix_use_the_kernel(kernel, dtype):
    """Through the backend: chunks of up to NATIVE_CHUNK_MAX queries after a cached prefix go
    to the kernel as decode rows (bottom-right causal), except, where the native prefill kernel
    runs, those of `prefill_kernel_chunk_min` queries or more (32, 16 with AMX in bf16), which it
    takes; a fresh prompt and a longer chunk keep the prefill path; decodes beside them are
    unaffected."""
    from engine.attention.torch_paged import (
        NATIVE_CHUNK_MAX,
        TorchPagedAttention,
        native_prefill_runs,
        prefill_kernel_chunk_min,
    )
    from tests.engine.test_attention import build_case

    backend = TorchPagedAttention()
    probe = torch.empty(1, 9, 64, dtype=dtype)
    edge = prefill_kernel_chunk_min(backend._native_prefill, probe)
    q_lens = [1, 2, 12, edge - 1, edge, NATIVE_CHUNK_MAX, NATIVE_CHUNK_MAX + 1, 20, 1]
    seq_lens = [40, 17, 1000, 600, 700, 100, 300, 20, 5]
    args, kwargs = build_case(q_lens, seq_lens, 9, 3, head_dim=64, dtype=dtype)
    recorder = _Recorder(kernel)
    backend._native = recorder
    backend.prepare(args[3], q_lens, seq_lens, 16)
    got = backend(*args, **kwargs).float()
    q, k, v = (t.float() for t in args[:3])
    expected = paged_attention_reference(q, k, v, *args[3:], **kwargs)
    prefill_kernel = native_prefill_runs(backend._native_prefill, args[0])
    as_rows = [n == 1 or (n <= NATIVE_CHUNK_MAX and n < s
                          and not (prefill_kernel and n >= edge))
               for n, s in zip(q_lens, seq_lens)]
    native_rows = torch.tensor([rows for n, rows in zip(q_lens, as_rows) for _ in range(n)])
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got[native_rows], expected[native_rows], **tol)
    torch_tol = 1e-5 if dtype == torch.float32 else 1.5e-2  # bf16 matmuls in the torch path
    torch.testing.assert_close(got[~native_rows], expected[~native_rows], atol=torch_tol,
                               rtol=torch_tol)
    chunks = [n for n, rows in zip(q_lens, as_rows) if rows and n > 1]
    assert sorted(recorder.calls) == sorted([2, *chunks])  # the 2 decodes in one call
    if prefill_kernel:
        assert chunks == [2, 12, edge - 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64, 5000])
def test_write_kv_stores_rows_as_index_copy_does(kernel, dtype, tokens):
    """K/V as views of a fused projection (token rows strided), scattered slots, a negative
    slot skipped; 5000 tokens split across threads. Every cache byte equals the torch form's."""
    from engine.attention.interface import write_kv_cache

    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    num_blocks = -(-tokens // block_size) + 3
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    caches = [torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
              for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv_cache(k, v, *expected, slots)
    native_slots = slots.clone()
    if tokens > 1:  # a skipped token: its slot keeps the cache's old bytes
        native_slots[1] = -1
        for c, e in zip(caches, expected):
            e.view(-1, kv_heads, dim)[slots[1]] = c.view(-1, kv_heads, dim)[slots[1]]
    with torch_threads(2):
        kernel.write_kv(k, v, *caches, native_slots)
    for c, e in zip(caches, expected):
        assert torch.equal(c.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           e.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_write_kv_refuses_what_it_cannot_store(kernel):
    k_cache, v_cache = torch.zeros(2, 16, 3, 64), torch.zeros(2, 16, 3, 64)
    k, v = torch.ones(4, 3, 64), torch.ones(4, 3, 64)
    with pytest.raises(RuntimeError, match="past the cache"):
        kernel.write_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 32]))
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        kernel.write_kv(torch.ones(3, 4, 64).transpose(0, 1), v, k_cache, v_cache,
                        torch.arange(4))
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel.write_kv(k.bfloat16(), v.bfloat16(), k_cache, v_cache, torch.arange(4))
    with pytest.raises(RuntimeError, match="int64"):
        kernel.write_kv(k, v, k_cache, v_cache, torch.arange(4, dtype=torch.int32))
    assert k_cache.abs().sum() == 0  # nothing written by a refused call


def test_the_cpu_backend_writes_kv_with_the_kernel_and_falls_back_off_its_layout(kernel,
                                                                                 monkeypatch):
    from engine.attention import torch_paged

    backend = torch_paged.TorchPagedAttention()
    calls = []
    monkeypatch.setattr(torch_paged, "write_kv_cache", lambda *a: calls.append("torch"))
    k_cache, v_cache = torch.zeros(2, 16, 3, 64), torch.zeros(2, 16, 3, 64)
    backend.write_kv(torch.ones(4, 3, 64), torch.ones(4, 3, 64), k_cache, v_cache,
                     torch.arange(4))
    assert calls == [] and k_cache.view(-1, 3, 64)[:4].eq(1).all()
    backend.write_kv(torch.ones(3, 4, 64).transpose(0, 1), torch.ones(4, 3, 64), k_cache,
                     v_cache, torch.arange(4))
    assert calls == ["torch"]
