"""SLO attainment under a load pulse, with and without the autoscaler, on a local Ray.

    python -m benchmarks.autoscale_slo [--repeats 3] [--users 8] [--duration-s 45]
        [--ttft-ms 500] [--itl-ms 100] [--out benchmarks/autoscale-slo-runs.json]

Each run deploys 1P+1D on a local Ray (the random-weight "tiny" Llama shape, a KV cache of
0.5 MB: 65 blocks, so the pulse is bound by KV room, not compute), then closed-loop users stream
greedy requests (160-token prompts, 64 tokens out) in a pulse: a quarter of the users, all of
them for the middle third, a quarter again. "fixed" keeps one decode worker; "autoscaled" runs
deploy.autoscaler (decode 1..2, interval 1 s). A request attains the SLO when its TTFT and its
mean inter-token gap are within the bounds (benchmarks.poisson's goodput definition). The two
modes alternate; figures are medians over the repeats, all from one invocation."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import percentile, write_json

REPO_ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "pdserve-bench"


def _config(model: Path, autoscaled: bool) -> Any:
    from deploy.config import DeployConfig
    from launch.cluster import free_port

    return DeployConfig.from_dict({
        "name": "bench", "ray": {"namespace": NAMESPACE, "address": "auto"},
        "model": {"path": str(model), "kv_cache_gb": 0.0005, "dtype": "float32"},
        "router": {"port": free_port(), "http_port": 0, "num_cpus": 0},
        "workers": {"grace_s": 10}, "placement": {"timeout_s": 120},
        "autoscale": {"enabled": autoscaled, "interval_s": 1.0, "cooldown_s": 4.0,
                      "kv_high": 0.4, "scale_down_window_s": 5.0,
                      "decode": {"min": 1, "max": 2}}})


class Pulse:
    """Closed-loop users: user i streams requests back to back while i < the shape's count."""

    def __init__(self, address: str, users: int, duration_s: float, prompts: list[list[int]],
                 max_tokens: int):
        from loadtest.shapes import ShapeSpec

        self.address, self.prompts, self.max_tokens = address, prompts, max_tokens
        self.spec = ShapeSpec("pulse", users, float(users), duration_s)
        self.records: list[dict[str, float]] = []
        self.lock = threading.Lock()
        self.start = 0.0

    def _active(self, user: int) -> bool:
        from loadtest.shapes import users_at

        now = users_at(self.spec, time.monotonic() - self.start)
        return now is not None and user < now[0]

    def run(self) -> list[dict[str, float]]:
        self.start = time.monotonic()
        threads = [threading.Thread(target=self._loop, args=(u,), daemon=True)
                   for u in range(self.spec.users)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.spec.duration_s + 180)
        return self.records

    def _loop(self, user: int) -> None:
        n = 0
        while time.monotonic() - self.start < self.spec.duration_s:
            if not self._active(user):
                time.sleep(0.1)
                continue
            record = _stream(self.address, self.prompts[(user * 97 + n) % len(self.prompts)],
                             self.max_tokens)
            record["started"] -= self.start
            with self.lock:
                self.records.append(record)
            n += 1


def _stream(address: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One greedy stream: when it started, its TTFT and mean inter-token gap (s), and ok."""
    from common.grpc_server import channel
    from pdserve_proto import pdserve_pb2 as pb
    from pdserve_proto import pdserve_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingOptions(max_tokens=max_tokens,
                                                             temperature=0, ignore_eos=True))
    started = time.monotonic()
    times: list[float] = []
    ok = 1.0
    try:
        with channel(address) as ch:
            for part in pb_grpc.GenerationStub(ch).Generate(request, timeout=120):
                if part.token_ids:
                    times.append(time.monotonic())
    except Exception:  # counted as a failed request
        ok = 0.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"started": started, "ok": ok, "ttft": times[0] - started if times else float("inf"),
            "itl": statistics.mean(gaps) if gaps else 0.0}


def summarize(records: list[dict[str, float]], ttft_s: float, itl_s: float,
              window: tuple[float, float]) -> dict[str, float]:
    def attained(r: dict[str, float]) -> bool:
        return bool(r["ok"]) and r["ttft"] <= ttft_s and r["itl"] <= itl_s

    pulse = [r for r in records if window[0] <= r["started"] < window[1]]
    done = [r for r in records if r["ok"]]
    return {"requests": len(records), "failed": len(records) - len(done),
            "attainment": sum(map(attained, records)) / max(1, len(records)),
            "attainment_pulse": sum(map(attained, pulse)) / max(1, len(pulse)),
            "ttft_p90_ms": percentile([r["ttft"] * 1000 for r in done], 90),
            "itl_mean_p99_ms": percentile([r["itl"] * 1000 for r in done], 99)}


def one_run(model: Path, autoscaled: bool, args: argparse.Namespace,
            prompts: list[list[int]]) -> dict[str, Any]:
    from deploy import deployment

    config = _config(model, autoscaled)
    result = deployment.deploy(config)
    try:
        records = Pulse(result.router_address, args.users, args.duration_s, prompts,
                        args.max_tokens).run()
        decisions = []
        if autoscaled:
            decisions = [d for d in deployment.autoscaler_decisions(config)
                         if d.get("action") in ("add", "remove")]
    finally:
        deployment.teardown(config)
    window = (args.duration_s / 3, 2 * args.duration_s / 3)
    return {"mode": "autoscaled" if autoscaled else "fixed",
            **summarize(records, args.ttft_ms / 1000, args.itl_ms / 1000, window),
            "changes": [(d["action"], d["role"], d.get("worker_id", "")) for d in decisions]}


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[100 + (7 * i + 13 * j) % 40000 for j in range(length)] for i in range(n)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=45.0)
    parser.add_argument("--prompt-tokens", type=int, default=160)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ttft-ms", type=float, default=500.0)
    parser.add_argument("--itl-ms", type=float, default=100.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/autoscale-slo-runs.json"))
    args = parser.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    ray_cli = str(Path(sys.executable).with_name("ray"))
    # A local Ray of 4 logical CPUs (1P + 2D workers fit), stopped at the end.
    subprocess.run([ray_cli, "start", "--head", "--num-cpus", "4", "--include-dashboard",
                    "false", "--disable-usage-stats"], check=True, timeout=120,
                   capture_output=True)
    runs = []
    try:
        runs = _runs(args)
    finally:
        subprocess.run([ray_cli, "stop", "--force"], timeout=120, capture_output=True)
    medians = {mode: {key: statistics.median(r[key] for r in runs if r["mode"] == mode)
                      for key in ("attainment", "attainment_pulse", "ttft_p90_ms",
                                  "itl_mean_p99_ms", "requests", "failed")}
               for mode in ("fixed", "autoscaled")}
    write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                          "medians": medians})
    print(json.dumps(medians, indent=1))


def _runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both modes, alternated, `args.repeats` times each."""
    from benchmarks.random_checkpoint import write_checkpoint
    from engine.prepare import default_model_dir

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_checkpoint("tiny", Path(tmp) / "tiny", default_model_dir(), "cpu")
        prompts = _prompts(40, args.prompt_tokens)
        for repeat in range(args.repeats):
            for autoscaled in ((False, True) if repeat % 2 == 0 else (True, False)):
                runs.append(one_run(model, autoscaled, args, prompts))
                print(json.dumps(runs[-1]), flush=True)
    return runs


if __name__ == "__main__":
    main()
