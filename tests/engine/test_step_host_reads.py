"""A step reads the device once (the sampled ids, with any logprobs), and the engine's scheduler
defaults follow the device. On CPU a "read" is the same call as on CUDA (`Tensor.tolist`/`item`/
`__float__`...), so counting those calls checks the GPU rule without a GPU."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams

READS = ("tolist", "item", "__float__", "__int__", "__bool__", "numpy", "cpu")


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))


def count_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):  # noqa: ANN001
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=4),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=4),
    SamplingParams(temperature=0, max_tokens=4, logprobs=3),
], ids=["greedy", "seeded_top_k_top_p", "logprobs"])
def test_one_device_read_per_step(engine, monkeypatch, params):
    for i, prompt in enumerate(([1, 5, 9, 13, 17], [2, 4, 6], [7] * 40)):
        engine.add_request(prompt, params, request_id=f"{params.temperature}-{i}")
    engine.step()  # prefill steps: warm everything up before counting
    while engine.has_unfinished_requests():
        with monkeypatch.context() as patch:
            reads = count_reads(patch)
            engine.step()
        assert len(reads) == 1, f"a step read the device {len(reads)} times: {reads}"


def test_scheduler_defaults_follow_the_device():
    assert EngineConfig(device="cpu").scheduler == SchedulerConfig()
    cuda = EngineConfig(device="cuda:1").scheduler
    assert (cuda.max_num_batched_tokens, cuda.max_num_seqs) == (8192, 256)
    mine = SchedulerConfig.for_device("cuda", max_num_seqs=32, max_num_batched_tokens=None)
    assert (mine.max_num_batched_tokens, mine.max_num_seqs) == (8192, 32)
    assert EngineConfig(device="cuda", scheduler=SchedulerConfig()).scheduler == SchedulerConfig()


def test_gpu_speed_paths_default_on_for_cuda_only():
    paths = ("cuda_graphs", "async_scheduling", "fused_kernels")
    assert [getattr(EngineConfig(device="cpu"), p) for p in paths] == [False] * 3
    assert [getattr(EngineConfig(device="cuda:1"), p) for p in paths] == [True] * 3
    # graphs need the Triton backend: a torch-attention engine on CUDA leaves them off
    torch_attention = EngineConfig(device="cuda", attention_backend="torch")
    assert [getattr(torch_attention, p) for p in paths] == [False, True, True]
    chosen = EngineConfig(device="cuda", cuda_graphs=False, fused_kernels=False)
    assert [getattr(chosen, p) for p in paths] == [False, True, False]
