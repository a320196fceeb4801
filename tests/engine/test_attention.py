"""The torch paged-attention path against the naive fp32 reference."""

from __future__ import annotations

import pytest
import torch

from engine.attention.reference import paged_attention_reference
from engine.attention.torch_paged import paged_attention_torch


def build_case(q_lens, seq_lens, n_heads, n_kv, head_dim=32, block_size=16, dtype=torch.float32,
               seed=0, permute=True):
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g) if permute else torch.arange(num_blocks)
    width = max(blocks_per_seq)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        table[i, :nb] = order[used:used + nb].to(torch.int32)
        used += nb
    q = torch.randn(sum(q_lens), n_heads, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    args = (q, k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32), starts)
    kwargs = dict(scale=head_dim ** -0.5, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return args, kwargs


CASES = {
    "decode": ([1, 1, 1, 1], [15, 16, 17, 40]),
    "prefill": ([15, 16, 17], [15, 16, 17]),
    "chunk_with_cached_prefix": ([16, 5], [48, 21]),
    "mixed": ([1, 1, 33, 1, 7], [64, 3, 33, 17, 40]),
    "decodes_not_first": ([9, 1, 1], [9, 30, 2]),
    "single_token_prompt": ([1], [1]),
    # over one CPU prefill tile (128 query rows): whole tiles, a partial last tile, a prefix
    "long_prefill_and_chunk": ([300, 200, 1], [300, 457, 90]),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize(("n_heads", "n_kv"), [(4, 4), (6, 2), (8, 2), (8, 1)])
def test_torch_path_matches_reference_fp32(name, n_heads, n_kv):
    q_lens, seq_lens = CASES[name]
    args, kwargs = build_case(q_lens, seq_lens, n_heads, n_kv)
    expected = paged_attention_reference(*args, **kwargs)
    got = paged_attention_torch(*args, **kwargs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["decode", "mixed", "chunk_with_cached_prefix",
                                  "long_prefill_and_chunk"])
def test_torch_path_matches_reference_bf16(name):
    q_lens, seq_lens = CASES[name]
    args, kwargs = build_case(q_lens, seq_lens, 6, 2, dtype=torch.bfloat16, block_size=32)
    expected = paged_attention_reference(*args, **kwargs).float()
    got = paged_attention_torch(*args, **kwargs).float()
    torch.testing.assert_close(got, expected, atol=1.5e-2, rtol=1.5e-2)


def test_unused_slots_do_not_leak_into_the_result():
    args, kwargs = build_case([1, 4], [17, 20], 4, 2)
    q, k_cache, v_cache, table, seq_lens, starts = args
    before = paged_attention_torch(*args, **kwargs)
    # Overwrite every slot past each sequence's length with large garbage.
    for i, s in enumerate(seq_lens.tolist()):
        last = table[i, (s - 1) // 16].item()
        k_cache[last, s % 16 or 16:] = 1e4
        v_cache[last, s % 16 or 16:] = 1e4
    after = paged_attention_torch(*args, **kwargs)
    torch.testing.assert_close(after, before)


def test_fresh_prompts_attend_this_steps_kv_without_reading_the_cache():
    """The stateful torch backend attends a whole-prompt step from the new K/V it is handed."""
    from engine.attention.torch_paged import TorchPagedAttention

    q_lens, seq_lens = [1, 20, 9], [30, 20, 9]
    args, kwargs = build_case(q_lens, seq_lens, 6, 2)
    q, k_cache, v_cache, table, lens, starts = args
    expected = paged_attention_reference(*args, **kwargs)
    # This step's K/V for each row, read from the cache at each token's own position.
    rows_k, rows_v = [], []
    for i, (lq, s) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(s - lq, s):
            block, offset = table[i, pos // 16].item(), pos % 16
            rows_k.append(k_cache[block, offset])
            rows_v.append(v_cache[block, offset])
    new_kv = (torch.stack(rows_k), torch.stack(rows_v))
    backend = TorchPagedAttention()
    backend.prepare(table, q_lens, seq_lens, 16)
    # Poison the fresh prompts' own blocks: the backend must not read them.
    for i in (1, 2):
        k_cache[table[i, : -(-seq_lens[i] // 16)].long()] = float("nan")
    got = backend(*args, **kwargs, new_kv=new_kv)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False], ids=["native-decode", "sdpa-decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["decode", "mixed", "decodes_not_first"])
def test_stateful_backend_decode_paths_match_reference(native, dtype, name):
    from engine.attention.torch_paged import TorchPagedAttention

    backend = TorchPagedAttention(native_decode=native)
    assert backend.uses_native_decode == native  # CI has a C++ compiler: the kernel must build
    q_lens, seq_lens = CASES[name]
    args, kwargs = build_case(q_lens, seq_lens, 9, 3, head_dim=64, dtype=dtype)
    expected = paged_attention_reference(*args, **kwargs).float()
    backend.prepare(args[3], q_lens, seq_lens, 16)
    got = backend(*args, **kwargs).float()
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("window", [1, 7, 32, 1000])
def test_sliding_window_matches_the_reference(name, window):
    """A query at position p sees keys p - window + 1 .. p: decodes, whole prompts, chunks after
    a cached prefix, prefill tiles (the native kernel is left out for windowed layers)."""
    q_lens, seq_lens = CASES[name]
    args, kwargs = build_case(q_lens, seq_lens, 8, 2)
    expected = paged_attention_reference(*args, **kwargs, window=window)
    got = paged_attention_torch(*args, **kwargs, window=window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if window < max(seq_lens):  # the window changed something
        full = paged_attention_reference(*args, **kwargs)
        assert not torch.allclose(full, expected, atol=1e-3)


@pytest.mark.parametrize("name", ["decode", "mixed", "long_prefill_and_chunk"])
@pytest.mark.parametrize("window", [None, 32])
def test_soft_capped_scores_match_the_reference(name, window):
    """Gemma 2: scores become cap * tanh(scores / cap) before the mask, in every path."""
    q_lens, seq_lens = CASES[name]
    args, kwargs = build_case(q_lens, seq_lens, 8, 2)
    args = (args[0] * 4, *args[1:])  # scores large enough for the cap to bend them
    expected = paged_attention_reference(*args, **kwargs, window=window, softcap=2.0)
    got = paged_attention_torch(*args, **kwargs, window=window, softcap=2.0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    uncapped = paged_attention_reference(*args, **kwargs, window=window)
    assert not torch.allclose(uncapped, expected, atol=1e-3)
