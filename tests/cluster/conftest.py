"""The OpenAI-API cluster the HTTP tests share (test_http_api, test_openai_features): one 1P+1D
cluster of the tiny model for the whole session, so the two modules start it once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.cluster.cluster_helpers import start_cluster

if TYPE_CHECKING:  # imported where used: a GPU machine's cluster stage runs without openai
    import openai


@pytest.fixture(scope="session")
def openai_cluster(tmp_path_factory, tiny_llama_dir):
    # Every prompt prefilled remotely (the breakdown's KV phases); 2 requests at once, none
    # queued (the 429 test).
    with start_cluster(tmp_path_factory.mktemp("http"), prefill=1, decode=1,
                       model=str(tiny_llama_dir), kv_cache_gb=0.05, dtype="float32",
                       router_args=("--local-prefill", "off", "--max-running", "2",
                                    "--max-queued", "0")) as running:
        yield running


@pytest.fixture(scope="session")
def http_address(openai_cluster) -> str:
    return openai_cluster.status().http_address


@pytest.fixture(scope="session")
def model(openai_cluster) -> str:
    return openai_cluster.status().model


@pytest.fixture(scope="session")
def client(http_address) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=f"http://{http_address}/v1", api_key="unused", max_retries=0,
                         timeout=120)
