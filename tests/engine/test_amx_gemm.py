"""The AMX bfloat16 GEMM (engine/models/csrc/amx_gemm.cpp) against a float64 reference: row
counts on both sides of its 16-row tiles and 32-row passes (1-256), output widths on and off its
32-column blocks, inner sizes on and off its 32-wide k steps, bias, strided rows, any thread
count giving the same bits; what it refuses; which calls `Linear` gives it; and the tiny Llama's
greedy tokens with it equal to oneDNN's. Skipped where the CPU has no AMX.

Tolerance: the kernel sums in float32 and rounds once to bfloat16, so each output is within half
a bfloat16 ulp (2^-9 relative) of the exact product plus float32 summation error; the bound
asserted is 2^-8 relative + 1e-3 absolute.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.models import linear as linear_module
from engine.models.amx_gemm import AMX_GEMM_MAX_ROWS, AmxRowGemm, load_amx_gemm
from engine.models.linear import Linear
from engine.request import SamplingParams
from tests.conftest import torch_threads


@pytest.fixture(scope="module")
def native():
    module = load_amx_gemm()
    if module is None:
        pytest.skip("the AMX GEMM needs a CPU with AMX-BF16 (and a C++ compiler)")
    return module


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                          bias: torch.Tensor | None) -> None:
    exact = x.double() @ w.double().t()
    if bias is not None:
        exact = exact + bias.double()
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 64, 100, 256])
def test_row_counts_match_the_exact_product(native, rows):
    w, b = rand(96, 576, seed=1).bfloat16(), rand(96, seed=2).bfloat16()
    x = rand(rows, 576, seed=rows).bfloat16()
    assert_close_to_exact(AmxRowGemm(native, w, b, 256)(x), x, w, b)


@pytest.mark.parametrize("out_features", [1, 15, 16, 31, 32, 33, 960])
@pytest.mark.parametrize("in_features", [1, 31, 32, 33, 64, 1536])
def test_widths_and_inner_sizes_off_the_grid(native, out_features, in_features):
    w = rand(out_features, in_features, seed=3).bfloat16()
    for rows, bias in ((3, None), (20, rand(out_features, seed=4).bfloat16())):
        x = rand(rows, in_features, seed=5).bfloat16()
        assert_close_to_exact(AmxRowGemm(native, w, bias)(x), x, w, bias)


def test_strided_rows_and_any_thread_count_give_the_same_bits(native):
    w = rand(200, 96, seed=6).bfloat16()
    gemm = AmxRowGemm(native, w, None)
    wide = rand(40, 128, seed=7).bfloat16()
    x = wide[:, 16:112]  # rows 128 apart
    with torch_threads(1):
        one = gemm(x)
    with torch_threads(4):
        four = gemm(x)
    assert torch.equal(one, four) and torch.equal(one, gemm(x.contiguous()))
    assert_close_to_exact(one, x, w, None)


def test_bad_inputs_are_refused(native):
    w = rand(32, 64, seed=8).bfloat16()
    gemm = AmxRowGemm(native, w, None)
    with pytest.raises(RuntimeError, match="at most 256 rows"):
        native.linear(rand(257, 64, seed=9).bfloat16(), gemm.packed, 32, 64, None)
    with pytest.raises(RuntimeError, match="x must be"):
        native.linear(rand(4, 64, seed=9), gemm.packed, 32, 64, None)
    with pytest.raises(RuntimeError, match="does not match"):
        native.linear(rand(4, 64, seed=9).bfloat16(), gemm.packed, 64, 64, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        native.linear(rand(4, 64, seed=9).bfloat16(), gemm.packed, 32, 64,
                      rand(31, seed=1).bfloat16())
    with pytest.raises(RuntimeError, match="weight must be"):
        native.pack(w.float())


def test_linear_gives_it_bf16_calls_of_few_rows_and_onednn_the_rest(native, monkeypatch):
    w, b = rand(96, 64, seed=10).bfloat16(), rand(96, seed=11).bfloat16()
    layer = Linear(w, b)
    assert isinstance(layer.small_rows, AmxRowGemm)
    assert layer.small_rows.max_rows == AMX_GEMM_MAX_ROWS
    assert layer.weight is not None and layer.packed  # oneDNN's copy serves larger calls
    calls: list[int] = []
    kernel = AmxRowGemm.__call__
    monkeypatch.setattr(AmxRowGemm, "__call__",
                        lambda self, x: calls.append(x.shape[0]) or kernel(self, x))
    for rows in (1, AMX_GEMM_MAX_ROWS, AMX_GEMM_MAX_ROWS + 1, 300):
        x = rand(rows, 64, seed=rows).bfloat16()
        assert_close_to_exact(layer(x), x, w, b)
    assert calls == [1, AMX_GEMM_MAX_ROWS]
    assert not isinstance(Linear(w.float()).small_rows, AmxRowGemm)  # float32 never


def test_tiny_llama_greedy_tokens_equal_onednn(native, tiny_llama_dir, monkeypatch):
    """bfloat16, with the AMX GEMM and with oneDNN alone: the same greedy tokens, log-probabilities
    within 0.05 (each rounds its float32 sums to bfloat16 once, summed in another order)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time"]
    results = {}
    for name, factory in (("amx", linear_module.amx_row_gemm), ("onednn", lambda w, b: None)):
        monkeypatch.setattr(linear_module, "amx_row_gemm", factory)
        monkeypatch.setattr(linear_module, "load_cpu_small_gemm", lambda: None)
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16",
                                        cache=CacheConfig(kv_cache_gb=0.05)))
        assert isinstance(engine.runner.model.layers[0].qkv_proj.small_rows, AmxRowGemm) == (
            name == "amx")
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=str(i))
        done = {}
        while engine.has_unfinished_requests():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        results[name] = [done[str(i)] for i in range(len(prompts))]
    for a, b in zip(results["amx"], results["onednn"]):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert all(abs(la[t] - lb[t]) < 0.05 for t in la)
