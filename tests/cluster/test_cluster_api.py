"""The cluster's API surface against one 1P+1D cluster: health, reflection, status, bad input,
client cancel, deadlines, Complete, overload, lease expiry, metrics — and no KV block leaked by
any of them. The router here serves 3 requests at once and queues 3 more."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from common.grpc_server import channel
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from tests.cluster.cluster_helpers import (
    greedy_request,
    long_prompt,
    rpc_error,
    scrape,
    start_cluster,
    stream_tokens,
    wait_blocks_free,
    wait_until,
    worker_status,
)

pytestmark = pytest.mark.slow


MAX_RUNNING, MAX_QUEUED = 3, 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with start_cluster(tmp_path_factory.mktemp("api"), prefill=1, decode=1,
                       router_args=("--max-running", str(MAX_RUNNING),
                                    "--max-queued", str(MAX_QUEUED))) as running:
        yield running


@pytest.fixture()
def stub(cluster):
    with channel(cluster.address) as ch:
        yield pb_grpc.GenerationStub(ch)


def _assert_no_leak(cluster) -> None:
    workers = wait_blocks_free(cluster)
    assert all(w.free_blocks == w.total_blocks for w in workers), workers


def test_health_and_reflection_answer_on_router_and_workers(cluster):
    addresses = [cluster.address] + [w.address for w in cluster.status().workers]
    for address in addresses:
        with channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with channel(cluster.address) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= services


def test_status_lists_workers_and_their_load(cluster, stub):
    status = stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=5)
    assert status.model == "SmolLM2-135M-Instruct"
    assert sorted(w.role for w in status.workers) == [pb.WORKER_ROLE_PREFILL,
                                                      pb.WORKER_ROLE_DECODE]
    for w in status.workers:
        assert w.healthy and w.address.startswith("127.0.0.1:")
        assert w.total_blocks > 0 and w.seconds_since_heartbeat < 3


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(prompt=""), "prompt"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 99999999])), "vocabulary"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(max_tokens=100000)),
     "max_tokens"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(temperature=-1)),
     "temperature"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(top_p=1.5)), "top_p"),
    (pb.GenerateRequest(prompt="hi", model="gpt-4"), "model"),
    (pb.GenerateRequest(sampling=pb.SamplingOptions(max_tokens=4)), "prompt"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(max_tokens=0)),
     "sampling.max_tokens must be >= 1"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(temperature=float("nan"))),
     "sampling.temperature"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(top_k=-5)), "sampling.top_k"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(stop_token_ids=[10**6])),
     "stop_token_ids"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5] * 8190)), "8192"),
])
def test_bad_input_is_invalid_argument_naming_the_field(cluster, stub, request_, field):
    exc = rpc_error(lambda: list(stub.Generate(request_, timeout=30)))
    assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in exc.details()
    _assert_no_leak(cluster)


def _raw_generate(address: str, data: bytes) -> grpc.RpcError:
    """Send raw bytes as a GenerateRequest (a client that is not this project's)."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as ch:
        call = ch.unary_stream("/pdserve.v1.Generation/Generate",
                               response_deserializer=pb.GenerateResponse.FromString)
        return rpc_error(lambda: list(call(data, timeout=60)))


def test_invalid_utf8_and_oversized_requests_are_invalid_argument(cluster):
    before = [w.free_blocks for w in wait_blocks_free(cluster)]
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(stop=["XY"]))
    exc = _raw_generate(cluster.address,
                        request.SerializeToString().replace(b"XY", b"\xff\xfe"))
    assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.stop[0] is not valid UTF-8" in exc.details()
    huge = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[40000] * 6_000_000))
    exc = _raw_generate(cluster.address, huge.SerializeToString())
    assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "limit is 16777216 bytes" in exc.details()
    assert [w.free_blocks for w in wait_blocks_free(cluster)] == before  # nothing allocated


def test_complete_returns_what_generate_streams(cluster, stub):
    request = greedy_request([1, 2, 3, 4, 5, 6, 7, 8], max_tokens=8)
    tokens, text, _ = stream_tokens(cluster.address, request)
    reply = stub.Complete(request, timeout=60)
    assert list(reply.token_ids) == tokens and reply.text == text
    assert reply.finish_reason == pb.FINISH_REASON_LENGTH
    assert reply.usage.completion_tokens == 8


def test_client_cancel_mid_stream_frees_blocks_on_both_workers(cluster, stub):
    neighbour = greedy_request(long_prompt()[:50], max_tokens=30)
    expected, _, _ = stream_tokens(cluster.address, neighbour)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(stream_tokens, cluster.address, neighbour)
        call = stub.Generate(greedy_request(long_prompt()[:600], max_tokens=400), timeout=120)
        seen = 0
        for part in call:
            seen += len(part.token_ids)
            if seen >= 3:
                break
        call.cancel()
        assert other.result()[0] == expected  # the stream beside it is unaffected
    _assert_no_leak(cluster)
    tokens, _, _ = stream_tokens(cluster.address, greedy_request([5, 6, 7], max_tokens=4))
    assert len(tokens) == 4  # the cluster keeps serving


def test_cancel_before_prefill_finishes_leaks_nothing(cluster, stub):
    prefill = next(w for w in cluster.status().workers if w.role == pb.WORKER_ROLE_PREFILL)
    sent = "pdserve_worker_kv_transfer_bytes_total{direction=sent,role=prefill,transport=shared}"
    sent_before = scrape(prefill.metrics_address).get(sent, 0.0)
    future = stub.Complete.future(greedy_request(long_prompt()[5:], max_tokens=4), timeout=120)
    time.sleep(0.3)
    future.cancel()
    _assert_no_leak(cluster)
    assert scrape(prefill.metrics_address).get(sent, 0.0) == sent_before  # nothing shipped


def test_deadline_is_propagated_and_frees_everything(cluster, stub):
    exc = rpc_error(lambda: list(stub.Generate(greedy_request(long_prompt(), max_tokens=300),
                                               timeout=1.5)))
    assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    _assert_no_leak(cluster)


def test_a_burst_of_four_times_capacity_loses_nothing_it_accepted(cluster):
    prompt = long_prompt()[:40]
    expected, _, _ = stream_tokens(cluster.address, greedy_request(prompt, max_tokens=10))
    burst = 4 * (MAX_RUNNING + MAX_QUEUED)
    with ThreadPoolExecutor(burst) as pool:
        futures = [pool.submit(stream_tokens, cluster.address,
                               greedy_request(prompt, max_tokens=10)) for _ in range(burst)]
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result()[0])
            except grpc.RpcError as exc:
                outcomes.append(exc)
    refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    served = [o for o in outcomes if not isinstance(o, grpc.RpcError)]
    assert refused and len(served) >= MAX_RUNNING + MAX_QUEUED
    for exc in refused:
        assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued" in exc.details()
    assert all(tokens == expected for tokens in served)  # every accepted one, correct
    _assert_no_leak(cluster)


def _prefill_ttft_count(cluster) -> float:
    prefill = next(w for w in cluster.status().workers if w.role == pb.WORKER_ROLE_PREFILL)
    return scrape(prefill.metrics_address).get(
        'pdserve_worker_ttft_seconds_count{role=prefill}', 0.0)


def test_a_deadline_passing_in_the_router_queue_never_reaches_a_worker(cluster, stub):
    calls = [stub.Generate(greedy_request(long_prompt()[:30], max_tokens=300), timeout=120)
             for _ in range(MAX_RUNNING)]
    for call in calls:  # every slot is taken and each request is past its prefill
        next(call)
    prefilled = _prefill_ttft_count(cluster)
    router = cluster.status().metrics_address
    expired = 'pdserve_router_requests_total{api=grpc,code=DEADLINE_EXCEEDED}'
    expired_before = scrape(router).get(expired, 0.0)
    exc = rpc_error(lambda: list(stub.Generate(greedy_request([1, 2, 3], max_tokens=4),
                                               timeout=1.0)))
    assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: scrape(router).get(expired, 0.0) >= expired_before + 1, 5.0,
               "the router to count the expired request")
    assert _prefill_ttft_count(cluster) == prefilled
    for call in calls:
        call.cancel()
    _assert_no_leak(cluster)


def test_a_deadline_passing_mid_stream_aborts_on_both_workers(cluster, stub):
    router = cluster.status().metrics_address
    expired = "pdserve_router_requests_total{api=grpc,code=DEADLINE_EXCEEDED}"
    expired_before = scrape(router).get(expired, 0.0)
    call = stub.Generate(greedy_request([1, 2, 3, 4], max_tokens=2000), timeout=15.0)
    received = 0
    with pytest.raises(grpc.RpcError) as failed:
        for part in call:
            received += len(part.token_ids)
    assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED and received > 0
    # counted as what it was, though its first tokens went out fine
    wait_until(lambda: scrape(router).get(expired, 0.0) >= expired_before + 1, 30.0,
               "the router to count the request that expired mid-stream")
    _assert_no_leak(cluster)


def test_reserved_blocks_whose_kv_never_arrives_are_freed_by_the_lease(cluster):
    decode = next(w for w in cluster.status().workers if w.role == pb.WORKER_ROLE_DECODE)
    with channel(decode.address) as ch:
        reply = pb_grpc.DecodeWorkerStub(ch).Reserve(pb.ReserveRequest(
            request_id="orphan", prompt_token_ids=list(range(1, 200)),
            sampling=pb.SamplingOptions(max_tokens=4), lease_s=10.0), timeout=10)
    assert len(reply.transfer.block_ids) == 13
    wait_until(lambda: worker_status(cluster, decode.worker_id).free_blocks
               == decode.total_blocks - 13, 9.0, "the reservation to show")
    _assert_no_leak(cluster)  # nobody aborts it: only the lease can free it


def test_metrics_move_on_router_and_workers(cluster, stub):
    status = cluster.status()
    workers = {w.role: w.metrics_address for w in status.workers}
    before = [scrape(status.metrics_address), scrape(workers[pb.WORKER_ROLE_PREFILL]),
              scrape(workers[pb.WORKER_ROLE_DECODE])]
    # The first goes to the prefill worker (600 tokens is past --local-prefill-max-tokens); the
    # decode worker then holds all but the prompt's last block, so it prefills the second itself.
    unseen = long_prompt(rank=1)[20:620]  # no earlier test sent it: no worker caches it
    sites = [stream_tokens(cluster.address, greedy_request(unseen, max_tokens=6)
                           )[2].timings.prefill_site for _ in range(2)]
    assert sites == ["remote", "local"]
    rpc_error(lambda: list(stub.Generate(pb.GenerateRequest(prompt=""), timeout=10)))
    after = [scrape(status.metrics_address), scrape(workers[pb.WORKER_ROLE_PREFILL]),
             scrape(workers[pb.WORKER_ROLE_DECODE])]

    def moved(i: int, name: str) -> float:
        return after[i].get(name, 0.0) - before[i].get(name, 0.0)

    assert moved(0, "pdserve_router_ttft_seconds_count{}") == 2
    assert moved(0, "pdserve_router_inter_token_latency_seconds_count{}") >= 2 * 5
    assert moved(0, "pdserve_router_e2e_seconds_count{}") == 2
    assert moved(0, "pdserve_router_requests_total{api=grpc,code=OK}") == 2
    assert moved(0, "pdserve_router_requests_total{api=grpc,code=INVALID_ARGUMENT}") == 1
    assert moved(0, "pdserve_router_kv_transfer_bytes_total{transport=shared}") > 0
    assert after[0]["pdserve_router_workers{role=decode}"] == 1
    assert "pdserve_router_queue_depth{}" in after[0]
    assert moved(0, "pdserve_router_prefill_sites_total{reason=long,site=remote}") == 1
    assert moved(0, "pdserve_router_prefill_sites_total{reason=short,site=local}") == 1
    assert moved(1, "pdserve_worker_ttft_seconds_count{role=prefill}") == 1
    sent = "pdserve_worker_kv_transfer_bytes_total{direction=sent,role=prefill,transport=shared}"
    received = ("pdserve_worker_kv_transfer_bytes_total{direction=received,role=decode,"
                "transport=shared}")
    assert moved(1, sent) > 0
    assert moved(1, "pdserve_worker_prefix_cache_queries_tokens_total{role=prefill}") == 600
    # the second, identical prompt hits the decode worker's prefix cache (all but its last token)
    assert moved(2, "pdserve_worker_prefix_cache_hits_tokens_total{role=decode}") >= 592
    assert moved(2, received) == moved(1, sent)
    assert moved(2, "pdserve_worker_inter_token_latency_seconds_count{role=decode}") > 0
    assert moved(2, "pdserve_worker_e2e_seconds_count{role=decode}") == 2
    assert after[2]["pdserve_worker_kv_blocks_total{role=decode}"] > 0
    for name in ("pdserve_worker_preemptions_total{role=decode}",
                 "pdserve_worker_prefix_cache_hit_rate{role=prefill}",
                 "pdserve_worker_kv_blocks_used{role=decode}",
                 "pdserve_worker_running_requests{role=decode}",
                 "pdserve_worker_waiting_requests{role=prefill}"):
        assert any(name in a for a in after), name


def test_calls_without_a_deadline_get_the_routers_default(cluster, stub):
    request = greedy_request([5, 6, 7, 8], max_tokens=4)
    assert sum(len(p.token_ids) for p in stub.Generate(request)) == 4  # no timeout=
    assert len(stub.Complete(request).token_ids) == 4
    # A client that knows the API only from reflection (as grpcurl does), without a deadline.
    with channel(cluster.address) as ch:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(ch))
        service = pool.FindServiceByName("pdserve.v1.Generation")
        method = service.FindMethodByName("Generate")
        request_type = message_factory.GetMessageClass(method.input_type)
        reply_type = message_factory.GetMessageClass(method.output_type)
        generate = ch.unary_stream("/pdserve.v1.Generation/Generate",
                                   request_serializer=request_type.SerializeToString,
                                   response_deserializer=reply_type.FromString)
        message = request_type()
        message.prompt = "Hello"
        message.sampling.max_tokens = 3
        message.sampling.temperature = 0.0
        replies = list(generate(message))
    assert sum(len(r.token_ids) for r in replies) == 3 and replies[-1].finish_reason != 0
    _assert_no_leak(cluster)


def test_top_p_zero_keeps_only_the_top_token_on_both_front_doors(cluster, stub):
    def grpc_text(**sampling: float) -> list[int]:
        request = pb.GenerateRequest(prompt="Once upon a time", sampling=pb.SamplingOptions(
            max_tokens=12, ignore_eos=True, **sampling))
        return list(stub.Complete(request, timeout=60).token_ids)

    greedy = grpc_text(temperature=0.0)
    assert grpc_text(temperature=1.0, top_p=0.0, seed=11) == greedy
    assert grpc_text(temperature=1.0, top_p=1.0, seed=11) != greedy  # sampling, seeded
    http_address = cluster.status().http_address
    host, port = http_address.split(":")
    texts = []
    for top_p in (0.0, None):
        body = {"model": cluster.status().model, "prompt": "Once upon a time", "max_tokens": 12,
                "ignore_eos": True, "temperature": 0 if top_p is None else 1, "seed": 11}
        if top_p is not None:
            body["top_p"] = top_p
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        texts.append(json.loads(conn.getresponse().read())["choices"][0]["text"])
        conn.close()
    assert texts[0] == texts[1]


def test_a_huge_chat_message_is_refused_before_it_is_tokenized(cluster, stub):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a" * (15 << 20))])
    exc = rpc_error(lambda: stub.Complete(pb.GenerateRequest(chat=chat), timeout=60))
    assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages: 15728640 characters; the limit is 1000000" in exc.details()


def test_the_router_logs_one_line_per_request_with_its_outcome(cluster, stub):
    stream_tokens(cluster.address, greedy_request([9, 10, 11], max_tokens=3, rid="logged-ok"))
    rpc_error(lambda: stub.Complete(pb.GenerateRequest(request_id="logged-bad", prompt=""),
                                    timeout=10))
    log = cluster.log_dir / "router.log"

    def lines(request_id: str) -> list[str]:
        return [line for line in log.read_text().splitlines()
                if f"request_id={request_id} " in line]

    wait_until(lambda: lines("logged-ok") and lines("logged-bad"), 10.0, "the access log")
    ok, bad = lines("logged-ok"), lines("logged-bad")
    assert len(ok) == 1 and " INFO pdserve.access request finished " in ok[0]
    for field in ("api=grpc", "status=OK", "prompt_tokens=3", "output_tokens=3", "ttft_s=",
                  "e2e_s=", "prefill_site=", "kv_transport="):
        assert field in ok[0], field
    assert len(bad) == 1 and " WARNING pdserve.access request failed: prompt must not be " in bad[0]
    assert "status=INVALID_ARGUMENT" in bad[0]
