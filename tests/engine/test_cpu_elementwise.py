"""The native CPU element-wise kernels (engine/models/csrc/cpu_elementwise.cpp) against the torch
form they replace (engine.models.elementwise), bitwise in float32 and bfloat16: RoPE on a strided
view of the projection, SiLU * up, residual add + RMSNorm (its sum of squares in torch's order),
over widths on and off the vector grid and rows enough to run in parallel; then the whole model:
logits bitwise equal to the torch form's in both dtypes, and bf16 greedy tokens equal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.cpu_elementwise import load_cpu_elementwise
from engine.models.elementwise import TorchElementwise, apply_rope, rms_norm
from engine.native_build import cpu_flags
from tests.conftest import torch_threads
from tests.native_builds import (
    ELEMENTWISE_AVX2,
    ELEMENTWISE_NO_BF16,
    ELEMENTWISE_PORTABLE,
    elementwise_variant,
    has,
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def native():
    module = load_cpu_elementwise()
    if module is None:
        flags = cpu_flags().split()
        # Where the CPU has AVX2, the kernels must build: a silent fallback would hide a bug.
        assert "avx2" not in flags, \
            "the CPU has AVX2 but the native element-wise kernels did not load"
        pytest.skip("no AVX-512/AVX2 or no C++ compiler: the torch form is used")
    return module


def rand(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128, 40])
@pytest.mark.parametrize("tokens", [1, 7, 600])
def test_rope_is_bitwise_the_torch_form_on_a_view_of_the_projection(native, dtype, dim, tokens):
    heads, kv_heads = 9, 3
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, scale=3.0)
    angles = rand(tokens, 1, dim // 2, dtype=torch.float32, seed=1, scale=50.0)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q_k = qkv[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    expected = apply_rope(q_k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    native.rope_(q_k, cos, sin)
    assert torch.equal(q_k, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 600])
@pytest.mark.parametrize("strided_rows", [False, True])
def test_rope_qkv_gives_the_torch_forms_q_k_v_as_views(native, dtype, tokens, strided_rows):
    from engine.models.cpu_elementwise import NativeCpuElementwise

    heads, kv_heads, dim = 9, 3, 64
    width = (heads + 2 * kv_heads) * dim
    wide = rand(tokens, width + (32 if strided_rows else 0), dtype=dtype, scale=3.0)
    qkv = wide[:, :width]
    emb = rand(tokens, 1, dim // 2, dtype=torch.float32, seed=1, scale=50.0).repeat(1, 1, 2)
    rope = (emb.cos().to(dtype), emb.sin().to(dtype))
    expected = TorchElementwise().rope_qkv(qkv.clone(), rope, heads, kv_heads, dim)
    got = NativeCpuElementwise(native).rope_qkv(qkv, rope, heads, kv_heads, dim)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and torch.equal(g, e)
        assert g.untyped_storage().data_ptr() == wide.untyped_storage().data_ptr()  # views
    assert torch.equal(wide[:, :heads * dim].reshape(tokens, heads, dim), got[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 96, 32])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_silu_mul_is_bitwise_the_torch_form(native, dtype, width, rows):
    gate_up = rand(rows, 2 * width, dtype=dtype, scale=6.0)
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0], dtype=dtype)  # exp's edges
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(native.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [100, 16, 1])
def test_silu_mul_row_tails(native, dtype, width):
    """Widths off the 16-lane grid: torch computes a row's last (width mod 32) elements with
    libm's exp, its vector body with SLEEF's, which may differ by an ulp; the native kernel uses
    SLEEF's throughout (models' widths are multiples of 32, where both agree bitwise)."""
    gate_up = rand(7, 2 * width, dtype=dtype, scale=6.0)
    gate, up = gate_up.chunk(2, dim=-1)
    tol = dict(rtol=2.0 ** -7, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=0)
    torch.testing.assert_close(native.silu_mul(gate_up), F.silu(gate) * up, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 64, 100, 4096, 5000, 3])
@pytest.mark.parametrize("rows", [3, 400])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_is_bitwise_the_torch_form(native, dtype, hidden, rows, with_delta):
    h = rand(rows, hidden, dtype=dtype, scale=4.0)
    delta = rand(rows, hidden, dtype=dtype, seed=1) if with_delta else None
    weight = rand(hidden, dtype=dtype, seed=2)
    residual, out = native.add_rms_norm(h, delta, weight, 1e-5)
    total = h + delta if with_delta else h
    assert torch.equal(residual, total)
    xf = total.float()  # transformers' three-op form (fp32: F.rms_norm is bitwise this too)
    expected = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(out, expected)
    assert torch.equal(out, rms_norm(total, weight, 1e-5))


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_split_across_threads_are_still_bitwise_the_torch_form(native, dtype, threads):
    with torch_threads(threads):
        gate_up = rand(300, 2 * 1536, dtype=dtype, scale=6.0)
        gate, up = gate_up.chunk(2, dim=-1)
        assert torch.equal(native.silu_mul(gate_up), F.silu(gate) * up)
        h, weight = rand(400, 4096, dtype=dtype, scale=4.0), rand(4096, dtype=dtype, seed=2)
        _, out = native.add_rms_norm(h, None, weight, 1e-5)
        assert torch.equal(out, rms_norm(h, weight, 1e-5))
        qkv = rand(600, 15 * 64, dtype=dtype, scale=3.0)
        emb = rand(600, 1, 32, dtype=torch.float32, seed=1, scale=50.0).repeat(1, 1, 2)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        q_k = qkv[:, :12 * 64].view(600, 12, 64)
        expected = apply_rope(q_k, cos, sin)
        native.rope_(q_k, cos, sin)
        assert torch.equal(q_k, expected)


def test_bad_inputs_are_refused_and_empty_batches_work(native):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native.silu_mul(torch.ones(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="heads contiguous"):
        native.rope_(torch.ones(3, 2, 64).transpose(0, 1), torch.ones(2, 64), torch.ones(2, 64))
    with pytest.raises(RuntimeError, match="delta must match"):
        native.add_rms_norm(torch.ones(2, 8), torch.ones(2, 4), torch.ones(8), 1e-5)
    assert native.silu_mul(torch.ones(0, 8)).shape == (0, 4)
    assert native.add_rms_norm(torch.ones(0, 8), None, torch.ones(8), 1e-5)[1].shape == (0, 8)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal where not NaN, NaN in the same places (torch's own bf16 paths differ in a
    NaN's payload: c10's scalar conversion gives 0x7FC0, its vector one 0xFFFF)."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a.masked_fill(nan, 0).view(torch.int16), b.masked_fill(nan, 0).view(
        torch.int16))


def edge_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """bf16 rows whose products and sums round to bf16 denormals, with a NaN or an infinity in
    some rows: the values that vcvtneps2bf16 rounds otherwise than c10."""
    x = rand(rows, width, dtype=torch.float32, seed=seed) * 2.0 ** -126
    x[1::3, 5] = float("nan")
    x[2::3, 7] = float("inf")
    return x.to(torch.bfloat16)


def builds_with_and_without_avx512_bf16(native) -> list:
    builds = [native]
    if has("avx512_bf16"):  # the integer rounding of machines without it, tested here too
        builds.append(elementwise_variant(*ELEMENTWISE_NO_BF16))
    return builds


def test_bf16_denormals_and_nans_round_as_torch_rounds_them(native):
    """bf16 rounding by vcvtneps2bf16 reads denormal inputs as zero: a vector holding one
    (or a NaN) must take the integer rounding, so every output keeps torch's bits."""
    for build in builds_with_and_without_avx512_bf16(native):
        h, delta = edge_rows(40, 576, seed=3), edge_rows(40, 576, seed=4)
        weight = rand(576, dtype=torch.bfloat16, seed=2)
        residual, out = build.add_rms_norm(h, delta, weight, 1e-5)
        assert residual.view(torch.int16).ne(0).any()
        assert same_values(residual, h + delta)
        assert same_values(out, rms_norm(h + delta, weight, 1e-5))
        gate_up = torch.cat((edge_rows(40, 1536, seed=5) * 2.0 ** 100,
                             edge_rows(40, 1536, seed=6)), dim=-1)
        gate, up = gate_up.chunk(2, dim=-1)
        assert same_values(build.silu_mul(gate_up), F.silu(gate) * up)
        qk = edge_rows(40, 12 * 64, seed=7).view(40, 12, 64)
        emb = rand(40, 1, 32, dtype=torch.float32, seed=1, scale=50.0).repeat(1, 1, 2)
        cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        expected = apply_rope(qk, cos, sin)
        build.rope_(qk, cos, sin)
        assert same_values(qk, expected)


def run_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_cpu_uses_the_native_kernels_and_logits_are_bitwise_the_torch_forms(
        native, tiny_llama_dir, workload_prompts, dtype):
    from engine.attention import AttentionMetadata
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype=dtype))
    model = engine.runner.model
    assert model.elementwise.name == "native"
    ids = torch.tensor(workload_prompts[0][:48])
    n = len(ids)
    md = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64), block_table=torch.arange(
            -(-n // 16), dtype=torch.int32).unsqueeze(0),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n, max_seq_len=n,
        query_lens_list=[n], seq_lens_list=[n])
    runner = engine.runner
    logits = {}
    for ops in (model.elementwise, TorchElementwise()):
        model.elementwise = ops
        runner.attention.prepare(md.block_table, [n], [n], runner.block_size)
        logits[ops.name] = model.forward(ids, torch.arange(n), runner.kv_caches, md,
                                         runner.attention, torch.arange(n))
    assert torch.equal(logits["native"], logits["torch"])


def test_bf16_greedy_tokens_match_the_torch_form(native, default_model_dir, workload_prompts):
    """Two engines (a second run in one engine would be served from the first's prefix cache,
    another computation path)."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    prompts = [workload_prompts[i][:64] for i in range(4)]
    outputs = []
    for form in ("native", "torch"):
        engine = LLMEngine(EngineConfig(model=str(default_model_dir), dtype="bfloat16"))
        assert engine.runner.model.elementwise.name == "native"
        if form == "torch":
            engine.runner.model.elementwise = TorchElementwise()
        outputs.append(run_greedy(engine, prompts, 16))
        del engine
    assert outputs[0] == outputs[1]


def test_the_avx2_build_is_bitwise_the_torch_form_too():
    """The build a machine with AVX2 but no AVX-512 gets (8 lanes, tails through a buffer, SLEEF's
    8-lane exp) is tested on every AVX2 machine, AVX-512 ones included."""
    if not has("avx2"):
        pytest.skip("no AVX2 on this CPU")
    native = load_cpu_elementwise()
    # Where the machine's own build is the AVX2 one, no second compile (a minute on 2 cores).
    avx2 = native if native is not None and native.isa() == "avx2" else elementwise_variant(
        *ELEMENTWISE_AVX2)
    assert avx2.available() is True and avx2.isa() == "avx2"
    for dtype in DTYPES:
        for rows, width in ((1, 1536), (9, 100), (300, 64)):
            gate_up = rand(rows, 2 * width, dtype=dtype, scale=6.0)
            gate, up = gate_up.chunk(2, dim=-1)
            if width % 32 == 0:  # off the grid torch's tail uses libm's exp (test above)
                assert torch.equal(avx2.silu_mul(gate_up), F.silu(gate) * up)
            h, delta = rand(rows, width, dtype=dtype, scale=4.0), rand(rows, width, dtype=dtype)
            weight = rand(width, dtype=dtype, seed=2)
            residual, out = avx2.add_rms_norm(h, delta, weight, 1e-5)
            assert torch.equal(residual, h + delta)
            assert torch.equal(out, rms_norm(h + delta, weight, 1e-5))
        for dim in (64, 40):  # 40: a half of 20 is two full vectors and a tail of 4
            x = rand(5, 3, dim, dtype=dtype, scale=3.0)
            emb = rand(5, 1, dim // 2, dtype=torch.float32, seed=1, scale=50.0).repeat(1, 1, 2)
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            expected = apply_rope(x, cos, sin)
            avx2.rope_(x, cos, sin)
            assert torch.equal(x, expected)


def test_without_vector_units_the_module_builds_and_reports_unavailable():
    """A machine with neither AVX-512 nor AVX2 gets a module whose `available()` is false, so the
    model keeps the torch form (load_cpu_elementwise returns None there)."""
    portable = elementwise_variant(*ELEMENTWISE_PORTABLE)
    assert portable.available() is False and portable.isa() == ""
    assert not hasattr(portable, "silu_mul")
