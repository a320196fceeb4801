"""Locust users that stream generations from the cluster's router: `Generate` over gRPC
(`--api grpc`, the default) or `POST /v1/completions` with `stream: true` over its
OpenAI-compatible HTTP API (`--api http`; --host is then the HTTP address).

Each request records three Locust entries (request type "grpc" or "http"): TTFT (request sent ->
first token), ITL (every gap between token messages or events) and E2E (request sent -> last
message); a failed request is one E2E failure whose error is its gRPC status code or HTTP
status. At the end the SLO file's verdict
is printed per entry and the process exits non-zero when any SLO is missed or nothing completed.

Run it through `python -m loadtest run|local` (which passes the options below), or directly:
    locust -f loadtest/locustfile.py --headless --host 127.0.0.1:50051 --slo loadtest/slo.yaml
"""

from __future__ import annotations

import json
from pathlib import Path

import gevent  # locust has already monkey-patched the standard library
import grpc
import grpc.experimental.gevent as grpc_gevent
import requests
from locust import LoadTestShape, User, constant, events, task
from locust.stats import CSV_STATS_INTERVAL_SEC

grpc_gevent.init_gevent()  # after the monkey-patch, before any gRPC object exists

from loadtest.shapes import SHAPES, ShapeSpec, users_at  # noqa: E402
from loadtest.slo import SLO, judge  # noqa: E402
from loadtest.workload import (  # noqa: E402
    DEFAULT_WORKLOAD,
    MAX_REQUESTS_LIMIT,
    WorkloadSampler,
    load_workload,
)
from pdserve_proto import pdserve_pb2 as pb  # noqa: E402
from pdserve_proto import pdserve_pb2_grpc as pb_grpc  # noqa: E402


@events.init_command_line_parser.add_listener
def _options(parser) -> None:  # noqa: ANN001 - locust's argparse wrapper
    parser.add_argument("--slo", default=str(Path(__file__).resolve().parent / "slo.yaml"),
                        help="SLO file (YAML)")
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD), help="JSONL workload")
    parser.add_argument("--max-tokens-cap", type=int, default=0, help="cap output lengths")
    parser.add_argument("--max-requests", type=int, default=1000, help="stop after N requests")
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--shape", default="constant", choices=SHAPES)
    parser.add_argument("--shape-users", type=int, default=4)
    parser.add_argument("--shape-spawn-rate", type=float, default=4.0)
    parser.add_argument("--shape-duration-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api", default="grpc", choices=["grpc", "http"])


@events.init.add_listener
def _setup(environment, **_kwargs) -> None:  # noqa: ANN001
    options = environment.parsed_options
    if not 1 <= options.max_requests <= MAX_REQUESTS_LIMIT:
        raise ValueError(f"--max-requests must be in [1, {MAX_REQUESTS_LIMIT}]")
    environment.slo = SLO.from_yaml(options.slo)  # a bad file fails before any load
    environment.sampler = WorkloadSampler(
        load_workload(options.workload, options.max_tokens_cap or None), options.seed)
    environment.requests_ended = 0
    # The user class for --api (locust would otherwise run every class in this file).
    environment.user_classes[:] = [u for u in environment.user_classes
                                   if getattr(u, "api", None) == options.api]


class ConfiguredShape(LoadTestShape):
    """The shape named by --shape (constant, ramp, step, burst); ends after its duration."""

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        spec = ShapeSpec(options.shape, options.shape_users, options.shape_spawn_rate,
                         options.shape_duration_s)
        return users_at(spec, self.get_run_time())


class GenerateUser(User):
    """What both APIs' users share: the closed loop, the workload, the entries recorded."""

    abstract = True
    api = ""  # the --api value that selects this class (_setup keeps only that one)
    wait_time = constant(0)  # closed loop: each user sends its next request at once

    @task
    def generate(self) -> None:
        item = self.environment.sampler.next()
        start = _now()
        try:
            tokens = self.stream(item, _Gaps(self, start))
            self._record("E2E", _now() - start, tokens)
        except RequestFailed as exc:
            self._record("E2E", _now() - start, 0, exc)
        self._count_end()

    def stream(self, item, gaps: _Gaps) -> int:  # noqa: ANN001 - a workload item
        """Stream one request, telling `gaps` as tokens arrive; the tokens received
        (RequestFailed when it fails)."""
        raise NotImplementedError

    def _record(self, name: str, seconds: float, length: int = 0,
                error: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type=self.api, name=name, response_time=seconds * 1000.0,
            response_length=length, exception=error, context={})

    def _count_end(self) -> None:
        env = self.environment
        env.requests_ended += 1
        if env.requests_ended == env.parsed_options.max_requests and env.runner is not None:
            gevent.spawn(env.runner.quit)  # bounded in requests as well as in time


class GrpcGenerateUser(GenerateUser):
    """Streams `Generate` over gRPC."""

    api = "grpc"

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(self.host)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def on_stop(self) -> None:
        self.channel.close()

    def stream(self, item, gaps: _Gaps) -> int:  # noqa: ANN001 - a workload item
        request = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=item.prompt_token_ids),
            sampling=pb.SamplingOptions(max_tokens=item.max_tokens, temperature=0,
                                        ignore_eos=item.ignore_eos))
        try:
            for part in self.stub.Generate(
                    request, timeout=self.environment.parsed_options.request_timeout_s):
                if part.token_ids:
                    gaps.tokens(len(part.token_ids))
        except grpc.RpcError as exc:
            raise RequestFailed(exc.code().name) from exc
        return gaps.count


class HttpGenerateUser(GenerateUser):
    """Streams `POST /v1/completions` (`stream: true`) over the OpenAI-compatible HTTP API."""

    api = "http"

    def on_start(self) -> None:
        self.session = requests.Session()
        self.base = self.host if "://" in self.host else f"http://{self.host}"
        reply = self.session.get(f"{self.base}/v1/models", timeout=30)
        reply.raise_for_status()
        self.model = reply.json()["data"][0]["id"]

    def on_stop(self) -> None:
        self.session.close()

    def stream(self, item, gaps: _Gaps) -> int:  # noqa: ANN001 - a workload item
        body = {"model": self.model, "prompt": item.prompt_token_ids, "stream": True,
                "max_tokens": item.max_tokens, "temperature": 0, "ignore_eos": item.ignore_eos}
        try:
            with self.session.post(f"{self.base}/v1/completions", json=body, stream=True,
                                   timeout=self.environment.parsed_options.request_timeout_s
                                   ) as reply:
                if reply.status_code != 200:
                    raise RequestFailed(f"HTTP {reply.status_code}")
                for line in reply.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RequestFailed(f"stream error: {event['error']['type']}")
                    if event["choices"] and event["choices"][0].get("text"):
                        gaps.tokens(1)
        except requests.RequestException as exc:
            raise RequestFailed(type(exc).__name__) from exc
        return gaps.count

class RequestFailed(Exception):
    """A failed request; its message (the gRPC status code, or the HTTP status) is how Locust
    groups failures."""


class _Gaps:
    """Records a stream's TTFT and inter-token gaps as they arrive."""

    def __init__(self, user: GenerateUser, start: float):
        self.user, self.last, self.count = user, start, 0

    def tokens(self, n: int) -> None:
        now = _now()
        self.user._record("TTFT" if self.count == 0 else "ITL", now - self.last)
        self.last = now
        self.count += n


def _now() -> float:
    import time

    return time.perf_counter()


@events.quitting.add_listener
def _verdict(environment, **_kwargs) -> None:  # noqa: ANN001
    if getattr(environment.parsed_options, "csv_prefix", None):
        # Locust's CSV writer runs every CSV_STATS_INTERVAL_SEC and never at shutdown: a run
        # that ends between two writes would leave stale files. It is still running here.
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)
    stats = environment.stats
    slo: SLO = environment.slo
    measured = {}
    api = environment.parsed_options.api
    for latency in (slo.ttft, slo.itl):
        entry = stats.get(latency.name, api)
        measured[latency.name] = (entry.get_response_time_percentile(latency.percentile / 100)
                                  if entry.num_requests else None)
    e2e = stats.get("E2E", api)
    verdicts = judge(slo, measured, e2e.num_requests, e2e.num_failures)
    print("\nSLO verdict:")
    for verdict in verdicts:
        print("  " + verdict.line())
    failures = {str(error.error): error.occurrences for error in stats.errors.values()}
    if failures:
        print(f"  failures by status: {failures}")
    if not all(v.met for v in verdicts):
        environment.process_exit_code = 1
