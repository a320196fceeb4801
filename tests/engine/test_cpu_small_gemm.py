"""The few-row float32 GEMM (engine/models/csrc/cpu_small_gemm.cpp) against a float64 reference:
every tile remainder (1-4 rows with AVX2, 1-8 with AVX-512, and rows past AVX2_MAX_ROWS), output
widths on and off the 24- and 48-column panel grids, odd inner sizes, bias, rows with a stride;
inputs it refuses; which rows `Linear` sends to it; the AVX-512 form bit for bit the AVX2 form;
and the whole model: greedy tokens equal to oneDNN's, logits within float32 rounding of them."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine, RequestOutput
from engine.models import cpu_small_gemm
from engine.models import linear as linear_module
from engine.models.cpu_small_gemm import (
    AMX_BF16_MAX_ROWS,
    AVX2_MAX_ROWS,
    CFLAGS,
    PREFIX,
    SOURCE,
    SmallRowGemm,
    build_small_gemm,
)
from engine.models.linear import Linear
from engine.native_build import try_build_native
from engine.request import SamplingParams
from tests.conftest import torch_threads
from tests.native_builds import has


@pytest.fixture(autouse=True)
def without_the_amx_gemm(monkeypatch):
    """These tests are the panel kernel's: on a CPU with AMX, bfloat16 layers would give their
    few-row calls to the AMX GEMM instead (tests/engine/test_amx_gemm.py)."""
    monkeypatch.setattr(linear_module, "amx_row_gemm", lambda weight, bias: None)


@pytest.fixture(scope="module")
def native():
    if not (has("avx2") and has("fma")):
        pytest.skip("the few-row GEMM needs AVX2 and FMA")
    module = build_small_gemm()
    assert module is not None, "the CPU has AVX2 and FMA but the few-row GEMM did not build"
    return module


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if bias is None else bias.double())


def assert_close(got: torch.Tensor, want: torch.Tensor, inner: int) -> None:
    # float32 sums of `inner` products of unit normals: error grows like sqrt(inner) ulps
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got.double() - want).abs().max().item() <= 2e-6 * inner ** 0.5 * 8


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 24, 30, 100])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (50, 13), (7, 64), (24, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_float64_reference(native, rows, out_features, in_features, with_bias):
    w = rand(out_features, in_features, seed=1)
    bias = rand(out_features, seed=2) if with_bias else None
    x = rand(rows, in_features, seed=3)
    got = SmallRowGemm(native, w, bias)(x)
    assert_close(got, reference(x, w, bias), in_features)


@pytest.mark.parametrize("threads", [2, 4])
def test_panels_split_across_threads(native, threads):
    w, bias = rand(960, 576, seed=1), rand(960, seed=2)
    with torch_threads(threads):
        for rows in (1, 8, 24, 100):
            x = rand(rows, 576, seed=3)
            assert_close(SmallRowGemm(native, w, bias)(x), reference(x, w, bias), 576)


def test_rows_with_a_stride_and_a_strided_weight(native):
    x = rand(6, 100, seed=4)[:, 10:74]  # row stride 100, 64 columns
    w = rand(64, 40, seed=5).t()  # [40, 64], not contiguous: packed from its values
    got = SmallRowGemm(native, w, None)(x)
    assert_close(got, reference(x, w, None), 64)


def test_refuses_what_it_cannot_compute(native):
    gemm = SmallRowGemm(native, rand(48, 32, seed=6), None)
    with pytest.raises(RuntimeError, match="float32"):
        gemm(rand(2, 32, seed=7).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="in_features"):
        gemm(rand(2, 31, seed=7))
    if native.bf16_available():  # K 6 and 5 pack to the same 3 pairs: still refused
        even = SmallRowGemm(native, rand(48, 6, seed=6).bfloat16(), None)
        with pytest.raises(RuntimeError, match="in_features"):
            even(rand(1, 5, seed=7).bfloat16())
    with pytest.raises(RuntimeError, match="float32"):
        native.pack(rand(48, 32, seed=6).to(torch.float16))
    if not native.bf16_available():
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            native.pack(rand(48, 32, seed=6).to(torch.bfloat16))


def test_linear_sends_few_rows_to_it_and_more_to_onednn(native, monkeypatch):
    monkeypatch.setattr(linear_module, "load_cpu_small_gemm", lambda: native)
    w, bias = rand(96, 64, seed=8), rand(96, seed=9)
    layer = Linear(w, bias)
    assert layer.small_rows is not None
    calls: list[int] = []
    kernel = SmallRowGemm.__call__
    monkeypatch.setattr(SmallRowGemm, "__call__",
                        lambda self, x: calls.append(x.shape[0]) or kernel(self, x))
    sizes = (1, AVX2_MAX_ROWS, AVX2_MAX_ROWS + 1, 200)
    for rows in sizes:
        x = rand(rows, 64, seed=rows)
        assert_close(layer(x), reference(x, w, bias), 64)
    # the AVX2 form takes few rows only; the AVX-512 form every step
    assert calls == ([1, AVX2_MAX_ROWS] if native.max_tile_rows() == 4 else list(sizes))
    assert layer(rand(2, 3, 64, seed=1)).shape == (2, 3, 96)  # not 2-D: oneDNN
    # bfloat16 weights only where the build has the AVX512-BF16 form
    assert (Linear(w.to(torch.bfloat16)).small_rows is None) == (not native.bf16_available())


PROMPTS = [[1, 5, 9, 14, 2, 7], [3, 3, 8], [11, 4, 6, 6, 10, 12, 13], [2], [9, 8, 7, 6]]


def kernel_and_onednn_outputs(native: ModuleType, model_dir: Path,
                              monkeypatch: pytest.MonkeyPatch, dtype: str, max_tokens: int
                              ) -> dict[str, list[RequestOutput]]:
    """The tiny Llama's finished greedy outputs for PROMPTS (with log-probabilities), once with
    the kernel and once with oneDNN."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    results = {}
    for name, module in (("kernel", native), ("onednn", None)):
        monkeypatch.setattr(linear_module, "load_cpu_small_gemm", lambda m=module: m)
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype,
                                        cache=CacheConfig(kv_cache_gb=0.05)))
        assert (engine.runner.model.layers[0].qkv_proj.small_rows is not None) == (
            module is not None)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(prompt, params, request_id=str(i))
        done = {}
        while engine.has_unfinished_requests():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        results[name] = [done[str(i)] for i in range(len(PROMPTS))]
    return results


def test_model_greedy_tokens_equal_onednn(native, tiny_llama_dir, monkeypatch):
    """The tiny Llama in float32 with the kernel and with oneDNN: the same greedy tokens, logits
    within float32 rounding (batches of 1-5 rows go to the kernel, the prefill too with
    AVX-512)."""
    results = kernel_and_onednn_outputs(native, tiny_llama_dir, monkeypatch, "float32", 12)
    for a, b in zip(results["kernel"], results["onednn"]):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)


def test_avx512_form_equals_the_avx2_form_bit_for_bit(native):
    """Each output is the same chain of FMAs over k in both forms, whatever the tiling."""
    if native.max_tile_rows() == 4:
        pytest.skip("this CPU builds the AVX2 form only")
    avx2 = try_build_native(PREFIX, SOURCE, (*CFLAGS, "-mno-avx512f"), "few-row GEMM, AVX2")
    assert avx2 is not None and avx2.max_tile_rows() == 4 and avx2.panel_width() == 24
    w, bias = rand(100, 77, seed=10), rand(100, seed=11)
    for rows in (1, 5, 8, 13, 24, 37):
        x = rand(rows, 77, seed=rows)
        assert torch.equal(SmallRowGemm(native, w, bias)(x), SmallRowGemm(avx2, w, bias)(x))


@pytest.fixture(scope="module")
def native_bf16(native):
    if not native.bf16_available():
        pytest.skip("the bfloat16 form needs AVX512-BF16")
    return native


def assert_bf16_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                      bias: torch.Tensor | None) -> None:
    """float32 sums of exact bf16 products, rounded once: within one bfloat16 step of the
    float64 sum (plus float32 rounding of the sum where it cancels)."""
    want = reference(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.double() - want).abs()
    bound = want.abs() * 2.0 ** -8 + 2e-6 * x.shape[1] ** 0.5 * 8
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 30, 64])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (50, 13), (7, 64), (96, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_matches_the_float64_reference(native_bf16, rows, out_features, in_features,
                                            with_bias):
    w = rand(out_features, in_features, seed=1).bfloat16()
    bias = rand(out_features, seed=2).bfloat16() if with_bias else None
    x = rand(rows, in_features, seed=3).bfloat16()
    assert_bf16_close(SmallRowGemm(native_bf16, w, bias)(x), x, w, bias)


def test_bf16_odd_strided_rows_and_onednn(native_bf16):
    """Rows of odd length take a padded copy, rows of odd stride are read in place (pairs that
    straddle 4 bytes); results stay within one bfloat16 step of oneDNN's AVX512-BF16 GEMM."""
    x = rand(5, 101, seed=4).bfloat16()[:, 1:100]  # 99 columns, row stride 101
    w = rand(70, 99, seed=5).bfloat16()
    assert_bf16_close(SmallRowGemm(native_bf16, w, None)(x), x, w, None)
    x = rand(5, 101, seed=4).bfloat16()[:, 1:97]  # 96 columns at odd offsets
    w = rand(70, 96, seed=5).bfloat16()
    assert_bf16_close(SmallRowGemm(native_bf16, w, None)(x), x, w, None)
    x, w = rand(9, 576, seed=6).bfloat16(), rand(960, 576, seed=7).bfloat16()
    ours, onednn = SmallRowGemm(native_bf16, w, None)(x).float(), F.linear(x, w).float()
    assert ((ours - onednn).abs() <= onednn.abs() * 2.0 ** -7 + 1e-3).all()


def test_with_amx_bf16_layers_send_few_rows_to_it_and_more_to_onednn(native_bf16, monkeypatch):
    """Where the CPU has AMX, oneDNN's bfloat16 GEMM beats the kernel from about 8 rows: a
    bfloat16 layer keeps oneDNN's copy beside the kernel's, the kernel takes up to
    AMX_BF16_MAX_ROWS rows; float32 layers still give the kernel every call."""
    monkeypatch.setattr(linear_module, "load_cpu_small_gemm", lambda: native_bf16)
    monkeypatch.setattr(cpu_small_gemm, "cpu_has_amx_bf16", lambda: True)
    w = rand(96, 64, seed=8).bfloat16()
    layer = Linear(w)
    assert layer.small_rows is not None and layer.small_rows.max_rows == AMX_BF16_MAX_ROWS
    assert layer.weight is not None and layer.packed  # oneDNN's copy is kept
    calls: list[int] = []
    kernel = SmallRowGemm.__call__
    monkeypatch.setattr(SmallRowGemm, "__call__",
                        lambda self, x: calls.append(x.shape[0]) or kernel(self, x))
    for rows in (1, AMX_BF16_MAX_ROWS, AMX_BF16_MAX_ROWS + 1, 300):
        x = rand(rows, 64, seed=rows).bfloat16()
        assert_bf16_close(layer(x), x, w, None)
    assert calls == [1, AMX_BF16_MAX_ROWS]
    assert Linear(w.float()).small_rows.max_rows == (
        AVX2_MAX_ROWS if native_bf16.max_tile_rows() == 4 else None)


def test_bf16_model_agrees_with_onednn(native_bf16, tiny_llama_dir, monkeypatch):
    """The tiny Llama in bfloat16 with the kernel and with oneDNN: the same greedy tokens, their
    log-probabilities within 0.05 (both round each linear's float32 sum to bfloat16 once, in a
    different order of additions)."""
    results = kernel_and_onednn_outputs(native_bf16, tiny_llama_dir, monkeypatch, "bfloat16", 8)
    for a, b in zip(results["kernel"], results["onednn"]):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert all(abs(la[t] - lb[t]) < 0.05 for t in la)
