"""The mixture-of-experts paths (engine.models.moe, engine.models.fused_moe) without a model and in
the engine: the grouped CPU path equals the per-expert loop bit for bit; the Triton grouped-GEMM
kernels (under TRITON_INTERPRET=1 on CPU, natively on CUDA) equal it within float32 noise, over
uneven expert loads, experts no token chose, k of 1..3 and an intermediate size that is not a
power of two; the engine's greedy output with the Triton path on equals the default path's."""

from __future__ import annotations

import pytest
import torch

from engine.config import MoEConfig
from engine.models import fused_moe as fm
from engine.models.moe import MoEMLP

RUNS_ON_CUDA = True  # with `pytest -m gpu` where CUDA is (tests/conftest.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def layer(experts: int, top_k: int, hidden: int = 64, inter: int = 48, seed: int = 0,
          dtype: torch.dtype = torch.float32, backend: str = "grouped") -> MoEMLP:
    g = torch.Generator().manual_seed(seed)
    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.2).to(dtype).to(DEVICE)
    return MoEMLP(MoEConfig(experts, top_k, inter, True), w(experts, hidden),
                  w(experts, 2 * inter, hidden), w(experts, hidden, inter), backend)


def tokens(n: int, hidden: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(n)).to(dtype).to(DEVICE)


def test_align_sorts_pairs_by_expert_in_padded_blocks():
    experts = torch.tensor([[2, 0], [0, 3], [2, 3], [0, 2]])  # expert 1 unused
    pairs, blocks = fm.align(experts, 4, block_m=4)
    # 5 blocks: the most 8 pairs over 4 experts can fill; the last 2 hold padding only
    assert fm.max_blocks(8, 4, block_m=4) == 5
    assert blocks.tolist() == [0, 2, 3, 3, 3]
    assert pairs.tolist() == [1, 2, 6, 8, 0, 4, 7, 8, 3, 5, 8, 8] + [8] * 8  # 8: padding


def test_max_blocks_bounds_every_routing():
    """The worst routings: every expert one pair (a block each), and every pair its own expert."""
    for pairs, experts, block_m in [(8, 8, 4), (8, 2, 4), (37, 16, 16), (16, 128, 16)]:
        worst = sum(-(-c // block_m) for c in [pairs // experts + (e < pairs % experts)
                                               for e in range(experts)])
        assert fm.max_blocks(pairs, experts, block_m) >= worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("experts", "top_k", "n"), [(4, 2, 1), (8, 2, 37), (4, 3, 20),
                                                     (8, 1, 9), (16, 2, 5)])
def test_grouped_equals_the_loop_and_triton_within_noise(experts, top_k, n, dtype):
    moe = layer(experts, top_k, dtype=dtype)
    x = tokens(n, dtype=dtype)
    weights, chosen = moe.route(x)
    loop = moe.per_expert_loop(x, weights, chosen)
    assert torch.equal(moe.grouped(x, weights, chosen), loop)
    got = fm.fused_moe(x, moe.gate_up, moe.down, weights, chosen)
    # bf16: both round hidden rows to bf16 (one ulp apart at worst), the loop's matmuls in bf16
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), loop.float(), **tol)


def test_the_backend_is_checked_and_an_empty_batch_is_fine():
    with pytest.raises(ValueError, match="MoE backend must be one of grouped, loop, triton"):
        layer(4, 2, backend="fused")
    moe = layer(4, 2, backend="triton")
    assert moe(tokens(0)).shape == (0, 64)


def test_the_engine_with_the_triton_experts_equals_the_default_path(
        monkeypatch, tmp_path, default_model_dir, workload_prompts):
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import LLMEngine
    from tests.conftest import save_tiny_model
    from tests.engine.hf_reference import engine_greedy

    model = save_tiny_model(tmp_path / "mixtral", "MixtralForCausalLM", default_model_dir,
                            seed=5, num_local_experts=4, num_experts_per_tok=2)
    prompts = [p[:n] for p, n in zip(workload_prompts, (3, 17, 30))]

    def greedy(**paths: bool) -> list[list[int]]:
        engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", device=DEVICE,
                                        cache=CacheConfig(block_size=16, num_blocks=32),
                                        **paths))
        assert engine.runner.model.layers[0].moe.backend == backend
        return engine_greedy(engine, prompts, 4)

    # the grouped path runs eagerly only (it sizes slices on the host): CUDA graphs off there
    eager = {"cuda_graphs": False} if DEVICE == "cuda" else {}
    backend = "grouped"
    monkeypatch.setattr("engine.models.moe.default_backend", lambda device: "grouped")
    expected = greedy(**eager)
    monkeypatch.undo()
    monkeypatch.setenv("PDSERVE_TRITON_MOE", "1")  # on CUDA the default without it
    backend = "triton"
    assert greedy() == expected


def test_cuda_graphs_refuse_an_expert_path_they_cannot_capture(tmp_path, default_model_dir,
                                                               monkeypatch):
    """The grouped path sizes each expert's slice on the host; only the Triton kernel can be
    captured (the default on CUDA). Checked before any capture, so it runs without a GPU; the
    engine is on the CPU, where the Triton attention backend wants the interpreter named even on
    a machine with CUDA (no kernel runs here)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import LLMEngine
    from tests.conftest import save_tiny_model

    model = save_tiny_model(tmp_path / "mixtral", "MixtralForCausalLM", default_model_dir,
                            num_local_experts=4, num_experts_per_tok=2)
    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu",
                                    attention_backend="triton",
                                    cache=CacheConfig(block_size=16, num_blocks=8)))
    assert engine.runner.model.layers[0].moe.backend == "grouped"  # the CPU default
    with pytest.raises(ValueError, match="needs the Triton MoE kernel .*not the 'grouped' path"):
        engine.runner.enable_decode_graphs(4, 256, capture=True)
