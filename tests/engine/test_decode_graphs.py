"""Decode steps through per-bucket static buffers (engine.decode_graphs).

On CPU the captured forwards run eagerly under the Triton interpreter (`capture=False`): the
padding, the in-place buffer updates and the fixed split-KV counts are checked against the eager
path token for token. The capture itself runs only where CUDA is (the `gpu` test)."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.decode_graphs import PAD_SLOT, DecodeRows, StaticDecodeInputs, bucket_for, capture_sizes
from engine.engine import LLMEngine
from engine.request import SamplingParams

# On CUDA where present (and then part of `pytest -m gpu`: tests/conftest.py).
RUNS_ON_CUDA = True
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H100_SMS = 132  # stands for the GPU's SM count: decode buckets of few sequences get split-KV


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    for n in range(1, 257):
        bucket = bucket_for(n, sizes)
        assert bucket is not None and n <= bucket < n + 8
    assert bucket_for(257, sizes) is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def rows(n: int, seq_len: int) -> DecodeRows:
    tables = [[10 * i + j for j in range(-(-seq_len // 4))] for i in range(n)]
    return DecodeRows(token_ids=[100 + i for i in range(n)], positions=[seq_len - 1] * n,
                      slots=[t[-1] * 4 + (seq_len - 1) % 4 for t in tables],
                      seq_lens=[seq_len] * n, block_rows=[(t, len(t)) for t in tables])


def test_a_smaller_step_in_the_same_bucket_leaves_padding_not_stale_rows():
    inputs = StaticDecodeInputs(max_seqs=8, max_blocks_per_seq=8, device=torch.device("cpu"))
    inputs.fill(rows(7, seq_len=9), bucket=8)
    inputs.fill(rows(3, seq_len=5), bucket=8)
    assert inputs.slot_mapping[3:8].tolist() == [PAD_SLOT] * 5, "a stale row would write KV"
    assert inputs.seq_lens.tolist() == [5, 5, 5, 0, 0, 0, 0, 0], "a stale row would read KV"
    assert inputs.token_ids[:3].tolist() == [100, 101, 102]
    assert inputs.block_table[2, :2].tolist() == [20, 21]
    md = inputs.metadata(8, num_kv_splits=4, max_seq_len=64)
    assert md.query_start_loc.tolist() == list(range(9)) and md.num_kv_splits == 4
    assert md.seq_lens.data_ptr() == inputs.seq_lens.data_ptr(), "replays need fixed addresses"
    with pytest.raises(ValueError, match="blocks"):
        inputs.fill(rows(1, seq_len=40), bucket=1)


def generate(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
             ) -> list[tuple[list[int], object]]:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, request_id=str(i))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.logprobs)
    return [done[str(i)] for i in range(len(prompts))]


def engines(model_dir, graphs_capture: bool, **config: object) -> dict[str, LLMEngine]:
    # Both engines live at once: each gets a small cache (on CUDA the default takes 90% of it).
    config.setdefault("cache", CacheConfig(kv_cache_gb=0.25))
    made = {}
    for name in ("eager", "graphs"):
        # Every speed path off, as on CPU: on CUDA each defaults to on, and the eager engine
        # would replay graphs of its own.
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device=DEVICE,
                                        attention_backend="triton", cuda_graphs=False,
                                        async_scheduling=False, fused_kernels=False, **config))
        if name == "graphs":
            engine.runner.enable_decode_graphs(engine.config.scheduler.max_num_seqs,
                                               engine.max_model_len, capture=graphs_capture,
                                               num_sms=None if graphs_capture else H100_SMS)
        made[name] = engine
    return made


def test_decode_through_static_buffers_matches_eager(tiny_llama_dir, workload_prompts):
    """Batches shrinking across buckets (5 → 1 sequences), split-KV in the small buckets, greedy,
    seeded sampling and logprobs: the same tokens and logprobs as the eager path."""
    prompts = [workload_prompts[i][:n] for i, n in enumerate((12, 40, 3, 21, 17))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (2, 4, 6)]
    params += [SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=5, ignore_eos=True,
                              logprobs=2),
               SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=0)]
    made = engines(tiny_llama_dir, graphs_capture=DEVICE == "cuda")
    outputs = {name: generate(engine, prompts, params) for name, engine in made.items()}
    graphs = made["graphs"].runner.graphs
    assert sorted(graphs.replays) == [1, 2, 4, 8], "every bucket the batch crossed replayed"
    assert max(graphs.splits[b] for b in graphs.replays) > 1, "split-KV was exercised"
    for (eager_ids, eager_lp), (graph_ids, graph_lp) in zip(outputs["eager"], outputs["graphs"]):
        assert graph_ids == eager_ids
        if eager_lp is not None:
            for a, b in zip(eager_lp, graph_lp):
                assert a.keys() == b.keys()
                assert all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_preemption_and_prefix_hits_stay_exact_through_static_buffers(tiny_llama_dir,
                                                                      workload_prompts):
    """A cache too small for every sequence: preempted requests recompute (mixed steps run
    eagerly, decode steps replay), and a repeated prompt hits the prefix cache."""
    shared = workload_prompts[2][:32]
    prompts = [shared + [7], shared + [9], workload_prompts[3][:30], shared + [7]]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * len(prompts)
    # 10 blocks: the repeats of `shared` wait for its blocks and share them (engine.prefix_wait),
    # and the four requests still need 12.
    made = engines(tiny_llama_dir, graphs_capture=DEVICE == "cuda",
                   cache=CacheConfig(num_blocks=10))
    outputs = {name: generate(engine, prompts, params) for name, engine in made.items()}
    assert [ids for ids, _ in outputs["graphs"]] == [ids for ids, _ in outputs["eager"]]
    assert made["graphs"].runner.graphs.replays, "decode steps replayed"
    assert made["graphs"].scheduler.num_preemptions > 0, "the cache was too small to hold all"


def test_cuda_graphs_are_refused_without_cuda_or_triton():
    with pytest.raises(ValueError, match="cuda_graphs needs device cuda"):
        EngineConfig(cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs needs attention_backend"):
        EngineConfig(cuda_graphs=True, device="cuda", attention_backend="torch")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_captured_graphs_match_eager_on_cuda(default_model_dir, workload_prompts):
    """The default model in fp32 with real CUDA graphs (config flag): the same greedy tokens."""
    prompts = [workload_prompts[i][:200] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=24 + 4 * i, ignore_eos=True)
              for i in range(6)]
    outputs = {}
    for graphs in (False, True):
        engine = LLMEngine(EngineConfig(model=str(default_model_dir), dtype="float32",
                                        device="cuda", cuda_graphs=graphs))
        outputs[graphs] = [ids for ids, _ in generate(engine, prompts, params)]
        if graphs:
            assert engine.runner.graphs.replays
        del engine  # its KV cache goes before the next engine sizes its own
        gc.collect()
        torch.cuda.empty_cache()
    assert outputs[True] == outputs[False]
