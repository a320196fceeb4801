"""The fused element-wise Triton kernels (engine.models.fused) against the torch form they
replace, under TRITON_INTERPRET=1 on CPU: fp32 to 1e-6, bf16 to one rounding step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import CacheConfig
from engine.models import fused
from engine.models.elementwise import apply_rope, rms_norm

# On CUDA where present (and then part of `pytest -m gpu`: tests/conftest.py).
RUNS_ON_CUDA = True
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Engines of one test (and of the test before it, until collected) share the device: each takes a
# small cache rather than the default 90% of the GPU.
SMALL_CACHE = CacheConfig(kv_cache_gb=0.25)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_add_rms_norm_matches_the_residual_add_then_rms_norm(dtype, hidden):
    h, delta = rand(5, hidden, dtype=dtype), rand(5, hidden, dtype=dtype, seed=1)
    weight = rand(hidden, dtype=dtype, seed=2)
    total, normed = fused.add_rms_norm(h, delta, weight, 1e-5)
    expected_total = h + delta
    torch.testing.assert_close(total, expected_total, **TOL[dtype])
    torch.testing.assert_close(normed, rms_norm(expected_total, weight, 1e-5), **TOL[dtype])
    alone, normed_alone = fused.add_rms_norm(h, None, weight, 1e-5)
    assert alone is h
    torch.testing.assert_close(normed_alone, rms_norm(h, weight, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dim", [(3, 64), (4, 80), (2, 128)])
def test_rope_in_place_on_a_view_of_the_fused_projection(dtype, heads, dim):
    tokens = 6
    qkv = rand(tokens, heads * dim + 2 * dim, dtype=dtype)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)  # strided, as in the layer
    cos, sin = rand(tokens, 1, dim, dtype=dtype, seed=3), rand(tokens, 1, dim, dtype=dtype, seed=4)
    expected = apply_rope(q.clone(), cos, sin)
    untouched = qkv[:, heads * dim:].clone()
    fused.rope_(q, cos, sin)
    torch.testing.assert_close(q, expected, **TOL[dtype])
    assert torch.equal(qkv[:, heads * dim:], untouched), "rope wrote outside q"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [128, 1536, 100])
def test_silu_mul_matches_silu_of_gate_times_up(dtype, inter):
    gate_up = rand(4, 2 * inter, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(gate_up), F.silu(gate) * up, **TOL[dtype])


def test_empty_batches_and_bad_layouts():
    empty = rand(0, 64, dtype=torch.float32)
    assert fused.add_rms_norm(empty, empty, rand(64, dtype=torch.float32), 1e-5)[1].shape == (0, 64)
    assert fused.silu_mul(rand(0, 256, dtype=torch.float32)).shape == (0, 128)
    x = rand(3, 2, 64, dtype=torch.float32).transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        fused.rope_(x, rand(2, 1, 64, dtype=torch.float32), rand(2, 1, 64, dtype=torch.float32))


def test_greedy_generation_with_fused_kernels_matches_the_torch_form(tiny_llama_dir,
                                                                     workload_prompts):
    """The whole decoder with the fused kernels (CUDA, or the interpreter on CPU; fp32): same
    greedy tokens."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.request import SamplingParams

    prompts = [workload_prompts[0][:12], workload_prompts[1][:40], [5, 9]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for fused_on in (False, True):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                        device=DEVICE, fused_kernels=fused_on,
                                        cache=SMALL_CACHE))
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=str(i))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        outputs[fused_on] = [done[str(i)] for i in range(len(prompts))]
    assert outputs[True] == outputs[False]


def test_start_up_forward_compiles_the_fused_path_and_writes_no_kv(tiny_llama_dir):
    """The warm-up forward that compiles the fused kernels at start (on CUDA) skips every KV
    write: the cache is bit for bit what it was."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device=DEVICE,
                                    fused_kernels=True, attention_backend="triton",
                                    cache=SMALL_CACHE))
    runner = engine.runner
    for layer in runner.kv_caches:
        layer.normal_()  # any content: it must survive untouched
    before = [layer.clone() for layer in runner.kv_caches]
    runner.warm_up_model()
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))
