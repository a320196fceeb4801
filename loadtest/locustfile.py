"""Locust users that stream `Generate` from the cluster's router over gRPC.

Each request records three Locust entries (request type "grpc"): TTFT (request sent -> first
token), ITL (every gap between token messages) and E2E (request sent -> last message); a failed
request is one E2E failure whose error is its gRPC status code. At the end the SLO file's verdict
is printed per entry and the process exits non-zero when any SLO is missed or nothing completed.

Run it through `python -m loadtest run|local` (which passes the options below), or directly:
    locust -f loadtest/locustfile.py --headless --host 127.0.0.1:50051 --slo loadtest/slo.yaml
"""

from __future__ import annotations

import gevent  # locust has already monkey-patched the standard library
import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import LoadTestShape, User, constant, events, task

grpc_gevent.init_gevent()  # after the monkey-patch, before any gRPC object exists

from loadtest.shapes import SHAPES, ShapeSpec, users_at  # noqa: E402
from loadtest.slo import SLO, judge  # noqa: E402
from loadtest.workload import DEFAULT_WORKLOAD, WorkloadSampler, load_workload  # noqa: E402
from pdserve_proto import pdserve_pb2 as pb  # noqa: E402
from pdserve_proto import pdserve_pb2_grpc as pb_grpc  # noqa: E402

MAX_REQUESTS_LIMIT = 100_000


@events.init_command_line_parser.add_listener
def _options(parser) -> None:  # noqa: ANN001 - locust's argparse wrapper
    parser.add_argument("--slo", default="loadtest/slo.yaml", help="SLO file (YAML)")
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD), help="JSONL workload")
    parser.add_argument("--max-tokens-cap", type=int, default=0, help="cap output lengths")
    parser.add_argument("--max-requests", type=int, default=1000, help="stop after N requests")
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--shape", default="constant", choices=SHAPES)
    parser.add_argument("--shape-users", type=int, default=4)
    parser.add_argument("--shape-spawn-rate", type=float, default=4.0)
    parser.add_argument("--shape-duration-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)


@events.init.add_listener
def _setup(environment, **_kwargs) -> None:  # noqa: ANN001
    options = environment.parsed_options
    if not 1 <= options.max_requests <= MAX_REQUESTS_LIMIT:
        raise ValueError(f"--max-requests must be in [1, {MAX_REQUESTS_LIMIT}]")
    environment.slo = SLO.from_yaml(options.slo)  # a bad file fails before any load
    environment.sampler = WorkloadSampler(
        load_workload(options.workload, options.max_tokens_cap or None), options.seed)
    environment.requests_ended = 0


class ConfiguredShape(LoadTestShape):
    """The shape named by --shape (constant, ramp, step, burst); ends after its duration."""

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        spec = ShapeSpec(options.shape, options.shape_users, options.shape_spawn_rate,
                         options.shape_duration_s)
        return users_at(spec, self.get_run_time())


class GenerateUser(User):
    wait_time = constant(0)  # closed loop: each user sends its next request at once

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(self.host)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def generate(self) -> None:
        env = self.environment
        item = env.sampler.next()
        request = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=item.prompt_token_ids),
            sampling=pb.SamplingOptions(max_tokens=item.max_tokens, temperature=0,
                                        ignore_eos=item.ignore_eos))
        start = last = _now()
        first = True
        tokens = 0
        try:
            for part in self.stub.Generate(request,
                                           timeout=env.parsed_options.request_timeout_s):
                now = _now()
                if part.token_ids:
                    self._record("TTFT" if first else "ITL", now - (start if first else last))
                    first, last = False, now
                    tokens += len(part.token_ids)
            self._record("E2E", _now() - start, tokens)
        except grpc.RpcError as exc:
            self._record("E2E", _now() - start, tokens, RequestFailed(exc.code().name))
        self._count_end()

    def _record(self, name: str, seconds: float, length: int = 0,
                error: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type="grpc", name=name, response_time=seconds * 1000.0,
            response_length=length, exception=error, context={})

    def _count_end(self) -> None:
        env = self.environment
        env.requests_ended += 1
        if env.requests_ended == env.parsed_options.max_requests and env.runner is not None:
            gevent.spawn(env.runner.quit)  # bounded in requests as well as in time


class RequestFailed(Exception):
    """A failed request; its message (the gRPC status code) is how Locust groups failures."""


def _now() -> float:
    import time

    return time.perf_counter()


@events.quitting.add_listener
def _verdict(environment, **_kwargs) -> None:  # noqa: ANN001
    stats = environment.stats
    slo: SLO = environment.slo
    measured = {}
    for latency in (slo.ttft, slo.itl):
        entry = stats.get(latency.name, "grpc")
        measured[latency.name] = (entry.get_response_time_percentile(latency.percentile / 100)
                                  if entry.num_requests else None)
    e2e = stats.get("E2E", "grpc")
    verdicts = judge(slo, measured, e2e.num_requests, e2e.num_failures)
    print("\nSLO verdict:")
    for verdict in verdicts:
        print("  " + verdict.line())
    failures = {str(error.error): error.occurrences for error in stats.errors.values()}
    if failures:
        print(f"  failures by status: {failures}")
    if not all(v.met for v in verdicts):
        environment.process_exit_code = 1
