"""The router's OpenAI-compatible HTTP API against a real 1P+1D cluster of the tiny model, driven
by the official `openai` client and by a raw HTTP client: completions, chat, streaming, token-id
prompts, stop strings, seeds, logprobs, greedy text equal to the gRPC API's; every error class
with its code; SSE framing byte for byte; a client that disconnects mid-stream leaves no block
behind; the latency breakdown on both APIs and in /metrics. (The cluster is the session's
`openai_cluster`, shared with test_openai_features.)"""

from __future__ import annotations

import json
import time

import openai
import pytest

from common.grpc_server import channel
from launch.cluster import free_port
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from tests.cluster.cluster_helpers import scrape, wait_blocks_free, wait_until
from tests.cluster.openai_helpers import PROMPT, grpc_complete, raw

pytestmark = pytest.mark.slow
LONG = {"max_tokens": 1500, "ignore_eos": True}  # a stream still running seconds later


@pytest.fixture(scope="module")
def cluster(openai_cluster):
    return openai_cluster


def test_models_and_health(client, http_address, model):
    assert [m.id for m in client.models.list()] == [model]
    conn, reply = raw(http_address, "/health")
    assert reply.status == 200 and json.loads(reply.read())["status"] == "ok"
    conn.close()


def test_greedy_text_equals_the_grpc_apis_for_text_and_token_id_prompts(client, cluster, model):
    ours = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    theirs = grpc_complete(cluster, pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingOptions(
        max_tokens=12, temperature=0)))
    assert ours.choices[0].text == theirs.text and ours.choices[0].finish_reason == "length"
    assert ours.usage.completion_tokens == 12 and ours.usage.prompt_tokens > 0
    ids = client.completions.create(model=model, prompt=list(theirs.token_ids[:5]) + [42],
                                    max_tokens=6, temperature=0)
    by_ids = grpc_complete(cluster, pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=list(theirs.token_ids[:5]) + [42]),
        sampling=pb.SamplingOptions(max_tokens=6, temperature=0)))
    assert ids.choices[0].text == by_ids.text


def test_chat_and_streaming_chat_agree(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                           temperature=0)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and whole.choices[0].message.role == \
        "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_stop_strings_seeds_and_logprobs(client, model):
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                       logprobs=2)
    lp = greedy.choices[0].logprobs
    assert len(lp.tokens) == 16 and all(len(top) <= 2 for top in lp.top_logprobs)
    # Greedy: the sampled token is the most likely one, so it heads its top 2.
    assert all(max(top, key=top.get) == tok for tok, top in zip(lp.tokens, lp.top_logprobs))
    text = greedy.choices[0].text
    stop = next(t for t in lp.tokens[3:] if t.strip() and text.index(t) > 0)
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    sampled = [client.completions.create(model=model, prompt=PROMPT, max_tokens=12, seed=7,
                                         temperature=1.0).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user",
                                                                  "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(1 <= len(c.top_logprobs) <= 2 for c in content)


def test_bad_requests_get_openais_error_shape_and_status(client, http_address, model):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x", max_tokens=0)
    assert bad.value.body["message"] == "max_tokens must be >= 1, got 0"
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=model, prompt="x", max_tokens=5000)
    assert "exceeds the model context of 2048 tokens" in too_long.value.body["message"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4o", prompt="x")
    assert missing.value.body["code"] == "model_not_found"
    conn, reply = raw(http_address, "/v1/completions", {"model": model, "prompt": PROMPT, **LONG},
                      {"X-Request-Timeout": "0.3"})
    assert reply.status == 504 and json.loads(reply.read())["error"]["type"] == "timeout_error"
    conn.close()
    conn, reply = raw(http_address, "/v1/chat/completions", {"model": model, "messages": "x"})
    assert reply.status == 400 and json.loads(reply.read())["error"]["param"] == "messages"
    conn.close()


def test_sse_framing_byte_for_byte(client, http_address, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    conn, reply = raw(http_address, "/v1/completions", body)
    assert reply.status == 200 and reply.getheader("Content-Type") == "text/event-stream"
    data = reply.read()
    conn.close()
    assert data.endswith(b"data: [DONE]\n\n")
    events = data.split(b"\n\n")[:-1]
    parsed = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    for event, obj in zip(events, parsed):  # one compact JSON object per event, nothing else
        assert event == b"data: " + json.dumps(obj, separators=(",", ":")).encode()
    assert len({obj["id"] for obj in parsed}) == 1
    assert all(obj["object"] == "text_completion" for obj in parsed)
    finish = [obj for obj in parsed if obj["choices"] and obj["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and "timings" in finish[0]
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"]["completion_tokens"] == 8
    text = "".join(obj["choices"][0]["text"] for obj in parsed if obj["choices"])
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert text == whole.choices[0].text


def test_a_full_queue_is_429_and_clients_leaving_mid_stream_free_every_block(
        cluster, client, http_address, model):
    baseline = {w.worker_id: w.free_blocks for w in wait_blocks_free(cluster)}
    streams = [raw(http_address, "/v1/completions",
                   {"model": model, "prompt": PROMPT, "stream": True, **LONG}) for _ in range(2)]
    for _, reply in streams:
        assert reply.status == 200 and reply.readline().startswith(b"data: ")
    with pytest.raises(openai.RateLimitError) as full:  # --max-running 2, --max-queued 0
        client.completions.create(model=model, prompt="x", max_tokens=2)
    assert "overloaded" in full.value.body["message"]
    for conn, _ in streams:  # both clients vanish mid-stream
        conn.sock.close()
        conn.close()
    wait_until(lambda: cluster.status().running_requests == 0, 30, "the router to let go")
    after = {w.worker_id: w.free_blocks for w in wait_blocks_free(cluster)}
    assert after == baseline, "blocks leaked by the streams whose clients left"
    assert client.completions.create(model=model, prompt="x", max_tokens=2).choices


def test_latency_breakdown_on_both_apis_and_in_metrics(cluster, client, http_address, model):
    with channel(cluster.address) as ch:
        parts = list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            prompt=PROMPT, sampling=pb.SamplingOptions(max_tokens=4, temperature=0)),
            timeout=60))
    t = parts[-1].timings
    assert t.prefill_site == "remote" and t.kv_transfer_bytes > 0
    assert t.prefill_compute_s > 0 and t.decode_admission_s > 0 and t.router_queue_s >= 0
    assert t.prefill_queue_s >= 0 and t.prefill_compute_s <= t.ttft_s
    reply = client.completions.with_raw_response.create(model=model, prompt=PROMPT,
                                                        max_tokens=4, temperature=0)
    timings = json.loads(reply.text)["timings"]
    assert timings["kv_transfer_bytes"] > 0 and timings["prefill_compute_s"] > 0
    assert set(timings) >= {"router_queue_s", "prefill_queue_s", "decode_admission_s"}
    metrics = scrape(http_address)  # /metrics is on the HTTP port too
    for phase in ("router_queue", "prefill_queue", "prefill_compute", "kv_transfer",
                  "decode_admission", "ttft"):
        assert metrics[f"pdserve_router_request_phase_seconds_count{{phase={phase}}}"] >= 2


def test_no_healthy_worker_is_503(tiny_llama_dir):
    from router.server import Router, RouterOptions

    router = Router(RouterOptions(port=free_port("127.0.0.1"), http_port=free_port("127.0.0.1"),
                                  model=str(tiny_llama_dir), metrics_port=0))
    router.start()
    try:
        conn, reply = raw(router.http_address, "/health")
        assert reply.status == 503 and json.loads(reply.read())["reason"] == "no healthy worker"
        conn.close()
        started = time.monotonic()
        conn, reply = raw(router.http_address, "/v1/completions",
                          {"model": tiny_llama_dir.name, "prompt": "x", "max_tokens": 2})
        error = json.loads(reply.read())["error"]
        assert reply.status == 503 and error["type"] == "service_unavailable_error"
        assert "no healthy" in error["message"] and time.monotonic() - started < 10
        conn.close()
    finally:
        router.stop(1.0)


def test_models_retrieve_developer_and_tool_roles_and_usage_on_every_chunk(client, model):
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")

    def chat(*messages: dict) -> str:
        reply = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                               messages=list(messages))
        return reply.choices[0].message.content

    user = {"role": "user", "content": PROMPT}
    assert chat({"role": "developer", "content": "Be brief."}, user) == \
        chat({"role": "system", "content": "Be brief."}, user)
    assert isinstance(chat(user, {"role": "assistant", "content": "Let me check."},
                           {"role": "tool", "content": "42", "tool_call_id": "call_1"}), str)
    stream = client.chat.completions.create(
        model=model, max_tokens=6, temperature=0, messages=[user], stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    completion = [c.usage.completion_tokens for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 6


def test_the_ttft_parts_benchmark_adds_up(http_address):
    """benchmarks.ttft_parts against the shared cluster: every request served, its phases read
    from the last chunk's timings (remote prefill here: KV transfer too) and those before the
    first token lying within the router's TTFT, which lies within the client's. Decode
    admission follows the first token: counting it in made `rest` dip below zero (a suite run saw
    -1.08 ms)."""
    import argparse

    from benchmarks import ttft_parts

    args = argparse.Namespace(address=http_address, rate=50.0, requests=2, prompt_tokens=16,
                              max_tokens=4, seed=1, json=None)
    results = ttft_parts.run(args)
    assert len(results) == 2 and not [r for r in results if "error" in r]
    for r in results:
        assert r["prefill_compute"] > 0 and r["kv_transfer"] > 0 and r["client_ttft"] > 0
        assert r["decode_admission"] >= 0.0
        assert r["rest"] > -1.0  # the phases lie inside the TTFT (1 ms of slack)
        assert r["router_ttft"] <= r["client_ttft"] + 1.0
