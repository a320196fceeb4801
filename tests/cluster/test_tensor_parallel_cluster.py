"""Prefill and decode workers of different tensor-parallel sizes (issue 31): each decode rank
receives exactly the KV heads it owns, from the prefill rank(s) that hold them, on both
transports — 1P(TP 2)+1D(TP 1), 1P(TP 1)+1D(TP 2) and 1P(TP 2)+1D(TP 2), 16 concurrent streams
token-identical to the offline engine, every block back. The model has 3 KV heads, so TP 2 splits
them unevenly (1 + 2) and every pair of sizes routes heads differently."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.request import SamplingParams
from pdserve_proto import pdserve_pb2 as pb
from tests.cluster.cluster_helpers import (
    greedy_request,
    scrape,
    start_cluster,
    stream_all,
    stream_tokens,
    wait_blocks_free,
)
from tests.conftest import mixed_prompts, save_tiny_model

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
PAIRS = [(2, 1), (1, 2), (2, 2)]  # (prefill TP, decode TP)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama-3kv"), "LlamaForCausalLM",
                           default_model_dir, hidden_size=96, num_attention_heads=6,
                           num_key_value_heads=3)


@pytest.fixture(scope="module")
def prompts(workload_prompts) -> list[list[int]]:
    return mixed_prompts(workload_prompts, 16)


@pytest.fixture(scope="module")
def expected(model_dir, prompts) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [o.token_ids for o in llm.generate(prompts, params)]
    del llm
    return outputs


@pytest.mark.parametrize("transport", ["shared", "dist"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), PAIRS,
                         ids=[f"p{p}-d{d}" for p, d in PAIRS])
def test_kv_moves_between_workers_of_different_tensor_parallel_sizes(
        tmp_path, model_dir, prompts, expected, transport, prefill_tp, decode_tp):
    with start_cluster(tmp_path, prefill=1, decode=1, model=str(model_dir), dtype="float32",
                       kv_transport=transport, prefill_tp=prefill_tp, decode_tp=decode_tp,
                       router_args=("--local-prefill", "off")) as cluster:
        got = stream_all(cluster.address, prompts, concurrency=16)
        assert [g[:MAX_TOKENS] for g in got] == [e[:MAX_TOKENS] for e in expected]
        _, _, last = stream_tokens(cluster.address, greedy_request(prompts[-1], MAX_TOKENS))
        assert last.timings.prefill_site == "remote"
        assert last.timings.kv_transport == transport
        assert last.timings.kv_transfer_bytes > 0
        assert (last.timings.prefill_tensor_parallel_size,
                last.timings.decode_tensor_parallel_size) == (prefill_tp, decode_tp)
        workers = wait_blocks_free(cluster)
        assert all(w.free_blocks == w.total_blocks for w in workers)
        sizes = {w.role: w.tensor_parallel_size for w in workers}
        assert sizes == {pb.WORKER_ROLE_PREFILL: prefill_tp, pb.WORKER_ROLE_DECODE: decode_tp}
        assert len({w.kv_layout for w in workers}) == 1
        assert "kv_heads=3" in workers[0].kv_layout
        for worker in workers:
            metrics = scrape(worker.metrics_address)
            role = "prefill" if worker.role == pb.WORKER_ROLE_PREFILL else "decode"
            assert metrics[f"pdserve_worker_tensor_parallel_size{{role={role}}}"] == \
                worker.tensor_parallel_size
