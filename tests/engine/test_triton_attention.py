"""The Triton paged-attention and KV-write kernels — under TRITON_INTERPRET=1 on CPU, natively on
CUDA — and the torch CPU path, both against the fp32 reference: decode, prefill, chunked prefill
over a cached prefix, mixed batches; lengths at block boundaries; permuted block tables; NaN in
every unused cache slot; GQA groups 1, 3, 4, 8; head dims 64/80/128; block sizes 16/32; split-KV;
fp32, fp16 and bf16. Then greedy generation with the Triton kernels forced matches the torch path
token for token."""

from __future__ import annotations

import pytest
import torch

from engine.attention import triton_paged
from engine.attention.reference import paged_attention_reference
from engine.attention.torch_paged import paged_attention_torch

# On CUDA where present (and then part of `pytest -m gpu`: tests/conftest.py).
RUNS_ON_CUDA = True
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# On CPU, tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton.
assert DEVICE == "cuda" or triton_paged.interpreting()

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
CASES = {  # (query lengths, sequence lengths)
    "decode": ([1, 1, 1, 1], [15, 16, 17, 40]),
    "prefill": ([15, 16, 17], [15, 16, 17]),
    "chunk_with_cached_prefix": ([16, 5, 17], [48, 21, 33]),
    "mixed": ([1, 1, 33, 1, 7], [64, 3, 33, 17, 40]),
    "long_prefill_and_decode": ([1, 150], [200, 150]),
}


def build(q_lens: list[int], seq_lens: list[int], n_heads: int, n_kv: int, head_dim: int = 64,
          block_size: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0):  # noqa: ANN201
    """Inputs of one ragged step: a permuted block table, NaN in every slot no sequence uses."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 3
    shape = (num_blocks, block_size, n_kv, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    used = 0
    for i, (n, length) in enumerate(zip(per_seq, seq_lens)):
        table[i, :n] = order[used:used + n].to(torch.int32)
        used += n
        for j in range(length):
            block = order[used - n + j // block_size]
            k_cache[block, j % block_size] = torch.randn(n_kv, head_dim, generator=g)
            v_cache[block, j % block_size] = torch.randn(n_kv, head_dim, generator=g)
    q = torch.randn(sum(q_lens), n_heads, head_dim, generator=g)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tensors = [t.to(dtype) if t.is_floating_point() else t for t in
               (q, k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32), starts)]
    kwargs = dict(scale=head_dim ** -0.5, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return tensors, kwargs


def check(path: str, tensors: list[torch.Tensor], kwargs: dict, dtype: torch.dtype,
          **extra: object) -> None:
    expected = paged_attention_reference(*[t.float() if t.is_floating_point() else t
                                           for t in tensors], **kwargs)
    if path == "triton":
        got = triton_paged.paged_attention_triton(*[t.to(DEVICE) for t in tensors], **kwargs,
                                                  **extra).cpu()
    else:
        got = paged_attention_torch(*tensors, **kwargs)
    assert got.dtype == dtype and not got.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_against_the_reference(case, group, path):
    q_lens, seq_lens = CASES[case]
    tensors, kwargs = build(q_lens, seq_lens, 2 * group, 2)
    if path == "torch":  # the torch path gathers whole blocks: it needs finite unused slots
        for cache in tensors[1:3]:
            cache.nan_to_num_(0.0)
    check(path, tensors, kwargs, torch.float32)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_head_dims_and_block_sizes(head_dim, block_size):
    tensors, kwargs = build([1, 1, 33, 1, 7], [64, 3, 33, 17, 40], 8, 2, head_dim, block_size)
    check("triton", tensors, kwargs, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["decode", "chunk_with_cached_prefix", "mixed"])
def test_half_precision(case, dtype):
    q_lens, seq_lens = CASES[case]
    tensors, kwargs = build(q_lens, seq_lens, 9, 3, dtype=dtype)
    check("triton", tensors, kwargs, dtype)


@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_fp16_without_the_upcast(case):
    """The GPU's path: fp16 tiles straight into the dot products (the interpreter's fp16 dot is
    right; only its bf16 one needs the upcast)."""
    q_lens, seq_lens = CASES[case]
    tensors, kwargs = build(q_lens, seq_lens, 8, 2, dtype=torch.float16)
    check("triton", tensors, kwargs, torch.float16, upcast=False)


@pytest.mark.parametrize("splits", [2, 4, 16, 64])
@pytest.mark.parametrize(("q_lens", "seq_lens"), [([1, 1, 1], [300, 129, 40]), ([1, 7], [130, 40])],
                         ids=["long_decode", "decode_and_chunk"])
def test_split_kv(q_lens, seq_lens, splits):
    """Each sequence's keys over `splits` programs, merged after: with more splits than key
    tiles some splits see nothing and must weigh nothing."""
    tensors, kwargs = build(q_lens, seq_lens, 8, 2)
    check("triton", tensors, kwargs, torch.float32, num_kv_splits=splits)


WINDOW_CASES = [  # (case, window, KV splits): the interpreter is slow, so a chosen few
    ("decode", 1, 1), ("decode", 16, 1), ("decode", 7, 4), ("prefill", 7, 1),
    ("prefill", 16, 1), ("chunk_with_cached_prefix", 33, 1), ("chunk_with_cached_prefix", 5, 1),
    ("mixed", 16, 4), ("mixed", 1000, 1), ("long_prefill_and_decode", 33, 1),
]


@pytest.mark.parametrize(("case", "window", "splits"), WINDOW_CASES)
def test_sliding_window_and_soft_capping(case, window, splits):
    """Windows inside a key tile, on block and tile boundaries and longer than the sequences,
    alone and with Gemma 2's soft-capping, over one program per sequence or split-KV."""
    q_lens, seq_lens = CASES[case]
    tensors, kwargs = build(q_lens, seq_lens, 8, 2)
    for extra in (dict(window=window), dict(window=window, softcap=5.0), dict(softcap=2.0)):
        expected = paged_attention_reference(*tensors, **kwargs, **extra)
        got = triton_paged.paged_attention_triton(*[t.to(DEVICE) for t in tensors], **kwargs,
                                                  num_kv_splits=splits, **extra).cpu()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_key_tiles_wholly_before_a_window_are_never_read():
    """NaN in every key and value of the tiles before each decode query's window's first tile:
    a single read of one would show."""
    window, tile = 40, triton_paged.TILE_N
    tensors, kwargs = build([1, 1], [200, 77], 4, 2)
    expected = paged_attention_reference(*tensors, **kwargs, window=window)
    _, k_cache, v_cache, table, seq_lens, _ = tensors
    for row, length in enumerate(seq_lens.tolist()):
        for pos in range((length - window) // tile * tile):
            block, slot = int(table[row, pos // 16]), pos % 16
            k_cache[block, slot], v_cache[block, slot] = float("nan"), float("nan")
    got = triton_paged.paged_attention_triton(*[t.to(DEVICE) for t in tensors], **kwargs,
                                              window=window).cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_refused():
    tensors, kwargs = build([1], [5], 4, 2)
    with pytest.raises(ValueError, match="power of two"):
        triton_paged.paged_attention_triton(*[t.to(DEVICE) for t in tensors], **kwargs,
                                            num_kv_splits=3)
    with pytest.raises(ValueError, match="window must be >= 1"):
        triton_paged.paged_attention_triton(*[t.to(DEVICE) for t in tensors], **kwargs,
                                            window=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_kernel_stores_at_the_slots(dtype):
    n_kv, head_dim, block_size = 2, 80, 16
    k_cache = torch.zeros(6, block_size, n_kv, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 16, 17, 95, -1, 40], dtype=torch.int64, device=DEVICE)
    k = torch.randn(6, n_kv, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(6, n_kv, head_dim, device=DEVICE).to(dtype)
    triton_paged.write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, n_kv, head_dim)
    flat_v = v_cache.view(-1, n_kv, head_dim)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], k[keep]) and torch.equal(flat_v[slots[keep]], v[keep])
    assert int((flat_k != 0).any(-1).any(-1).sum()) == int(keep.sum())  # nothing else written


def test_greedy_generation_with_the_triton_kernels_matches_the_torch_path(tiny_llama_dir,
                                                                          workload_prompts):
    from engine.config import CacheConfig, EngineConfig
    from engine.llm import LLM
    from engine.request import SamplingParams

    prompts = [workload_prompts[0][:40], workload_prompts[1][:17], [1, 2, 3]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", device=DEVICE,
                              attention_backend=backend, cache=CacheConfig(kv_cache_gb=0.01))
        llm = LLM(config=config)
        assert llm.engine.runner.attention.name == backend
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_default_model_on_cuda_matches_cpu_greedy(workload_prompts):
    """float32 on both: the Triton kernels (auto on CUDA) give the CPU path's greedy tokens."""
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.request import SamplingParams

    prompts = [workload_prompts[0][:200], workload_prompts[2][:31]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for device in ("cpu", "cuda"):
        llm = LLM(config=EngineConfig(model="default", dtype="float32", device=device))
        tokens[device] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
    assert tokens["cuda"] == tokens["cpu"]
