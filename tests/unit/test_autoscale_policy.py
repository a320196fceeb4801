"""The autoscaler's policy and signals without Ray or a router: which role it adds or removes
for made-up signals (bounds, cooldown, the planner's model when given), when it flips local
prefill, and the latency percentiles it reads from the router's histogram buckets."""

from __future__ import annotations

import pytest

from deploy.scaling import Bounds, ScalingPolicy, Signals
from deploy.signals import ITL, PHASES, REQUESTS, TTFT, cluster_now, parse_metrics, quantile
from loadtest.slo import SLO, LatencySLO
from pdserve_proto import pdserve_pb2 as pb

SLO_ = SLO(LatencySLO("TTFT", 90, 1000), LatencySLO("ITL", 99, 200), 0.01)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def signals(ttft: float | None = 100, itl: float | None = 20, queued: int = 0, kv: float = 0.1,
            backlog: int = 0, prefill: int = 1, decode: int = 1, rate: float = 1.0) -> Signals:
    return Signals(ttft, itl, rate, queued, backlog, kv, {"prefill": prefill, "decode": decode})


def policy(clock: Clock, prefill: tuple[int, int] = (1, 2), decode: tuple[int, int] = (1, 3),
           **kw: object) -> ScalingPolicy:
    return ScalingPolicy(SLO_, {"prefill": Bounds(*prefill), "decode": Bounds(*decode)},
                         cooldown_s=10, clock=clock, **kw)


def test_latency_over_the_slo_adds_the_role_it_points_at():
    clock = Clock()
    assert policy(clock).decide(signals(itl=300)).role == "decode"
    assert policy(clock).decide(signals(kv=0.95)).role == "decode"
    slow_first = policy(clock).decide(signals(ttft=1500, backlog=4000))
    assert (slow_first.action, slow_first.role) == ("add", "prefill")
    assert "TTFT at 150%" in slow_first.reason and "4000 prompt tokens" in slow_first.reason
    queued = policy(clock, prefill=(1, 1)).decide(signals(queued=3))
    assert (queued.action, queued.role) == ("add", "decode")  # prefill at its max
    waiting = signals(ttft=900)  # under the bound, but most of it spent queueing
    waiting = Signals(**{**waiting.__dict__, "queue_ms": 600.0})
    early = policy(clock).decide(waiting)
    assert (early.action, early.role) == ("add", "prefill") and "600 ms queued" in early.reason
    assert policy(clock).decide(signals(ttft=900)).action == "hold"


def test_bounds_are_kept_and_the_last_worker_never_goes():
    clock = Clock()
    full = policy(clock, prefill=(1, 1), decode=(1, 1)).decide(signals(itl=500, ttft=5000))
    assert full.action == "hold" and "max" in full.reason
    idle = policy(clock, prefill=(1, 2), decode=(1, 3)).decide(signals(ttft=10, itl=5))
    assert idle.action == "hold"  # one of each: nothing to remove
    down = policy(clock).decide(signals(ttft=10, itl=5, decode=3))
    assert (down.action, down.role) == ("remove", "decode")
    down = policy(clock).decide(signals(ttft=10, itl=5, prefill=2, decode=2))
    assert (down.action, down.role) == ("remove", "prefill")  # no backlog: prefill goes first
    busy = policy(clock).decide(signals(ttft=10, itl=5, decode=3, kv=0.6))
    assert busy.action == "hold"  # KV use too high to shrink


def test_a_change_waits_out_the_cooldown():
    clock = Clock()
    p = policy(clock)
    assert p.decide(signals(itl=300)).action == "add"
    clock.now = 5
    held = p.decide(signals(itl=300))
    assert held.action == "hold" and "cooling" in held.reason
    clock.now = 11
    assert p.decide(signals(itl=300)).action == "add"


def test_local_prefill_turns_off_while_decode_is_the_bottleneck_and_back_on_after():
    clock = Clock()
    p = policy(clock, decode=(1, 1))
    assert p.decide(signals(itl=300)).local_prefill == "off"
    assert p.decide(signals(itl=300)).local_prefill is None  # already off
    assert p.decide(signals(ttft=2000)).local_prefill == "auto"
    assert p.local_prefill == "auto"


def test_the_planners_model_picks_the_role_when_given():
    clock = Clock()
    calls: list[tuple[int, int, float]] = []

    def score(prefill: int, decode: int, rate: float) -> float:
        calls.append((prefill, decode, rate))
        return 2.0 if prefill == 2 else 1.0  # a second prefill worker helps most

    decision = policy(clock, split_score=score).decide(signals(itl=300, rate=3.0))
    assert (decision.action, decision.role) == ("add", "prefill")  # against the heuristic
    assert sorted(calls) == [(1, 2, 3.0), (2, 1, 3.0)]


def test_histogram_quantiles_as_prometheus_computes_them():
    buckets = {0.1: 10.0, 0.5: 50.0, 1.0: 90.0, float("inf"): 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.5)
    assert quantile(0.7, buckets) == pytest.approx(0.75)  # halfway through (0.5, 1.0]
    assert quantile(0.95, buckets) == pytest.approx(1.0)  # past the last finite bound
    assert quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None


def test_the_routers_metrics_and_status_become_signals():
    text = "\n".join([
        f"# TYPE {TTFT} histogram",
        f'{TTFT}_bucket{{le="0.5"}} 3.0', f'{TTFT}_bucket{{le="+Inf"}} 4.0',
        f"{TTFT}_count 4.0", f"{TTFT}_sum 1.0",
        f"# TYPE {ITL} histogram", f'{ITL}_bucket{{le="+Inf"}} 0.0', f"{ITL}_count 0.0",
        f"{ITL}_sum 0.0",
        f"# TYPE {PHASES} histogram",
        f'{PHASES}_bucket{{le="0.1",phase="prefill_queue"}} 2.0',
        f'{PHASES}_bucket{{le="+Inf",phase="prefill_queue"}} 2.0',
        f'{PHASES}_bucket{{le="0.1",phase="ttft"}} 9.0',
        "# TYPE pdserve_router_requests counter",
        f'{REQUESTS}{{api="grpc",code="OK"}} 5.0', f'{REQUESTS}{{api="http",code="OK"}} 2.0'])
    buckets, ended = parse_metrics(text)
    assert buckets[TTFT] == {0.5: 3.0, float("inf"): 4.0} and ended == 7.0
    assert buckets["prefill_queue"] == {0.1: 2.0, float("inf"): 2.0}
    assert buckets["router_queue"] == {}  # the ttft phase is not a queue
    status = pb.ClusterStatus(queued_requests=2, workers=[
        pb.WorkerStatus(worker_id="p", role=pb.WORKER_ROLE_PREFILL, healthy=True,
                        queued_prompt_tokens=300),
        pb.WorkerStatus(worker_id="d0", role=pb.WORKER_ROLE_DECODE, healthy=True,
                        free_blocks=25, total_blocks=100),
        pb.WorkerStatus(worker_id="d1", role=pb.WORKER_ROLE_DECODE, healthy=True,
                        free_blocks=75, total_blocks=100),
        pb.WorkerStatus(worker_id="d2", role=pb.WORKER_ROLE_DECODE, healthy=True,
                        draining=True, free_blocks=0, total_blocks=100)])
    now = cluster_now(status)
    assert now == {"queued": 2, "prefill_backlog_tokens": 300, "kv_use": 0.5,
                   "workers": {"prefill": 1, "decode": 2},
                   "registered": frozenset({"p", "d0", "d1", "d2"})}


def test_a_worker_goes_only_after_the_load_stayed_low_for_the_window():
    clock = Clock()
    p = policy(clock, scale_down_window_s=5)
    quiet, busy = signals(ttft=10, itl=5, decode=2), signals(ttft=10, itl=5, decode=2, kv=0.5)
    assert p.decide(quiet).action == "hold"
    clock.now = 3
    assert p.decide(busy).action == "hold"  # a burst: the quiet spell starts again
    clock.now = 4
    assert p.decide(quiet).action == "hold"
    clock.now = 8
    assert p.decide(quiet).action == "hold"  # quiet for 4 s
    clock.now = 9.5
    assert p.decide(quiet).action == "remove"


def test_a_dry_run_logs_each_decision_with_its_inputs_and_changes_nothing(monkeypatch):
    from deploy.autoscaler import Autoscaler
    from deploy.config import DeployConfig

    config = DeployConfig.from_dict({"autoscale": {
        "enabled": True, "dry_run": True, "cooldown_s": 0, "decode": {"min": 1, "max": 2}}})
    scaler = Autoscaler(config, {"address": "127.0.0.1:1", "metrics_address": "127.0.0.1:1",
                                 "registry_address": "127.0.0.1:1"}, None)
    readings = iter([signals(itl=5000), signals(ttft=10, itl=5, decode=2)])  # bound: 2 s
    monkeypatch.setattr(scaler.signals, "read", lambda: next(readings))
    for name in ("add", "remove"):
        monkeypatch.setattr(scaler.workers, name, lambda *a: pytest.fail(f"dry run: {a}"))
    monkeypatch.setattr(scaler, "_set_local_prefill", lambda *a: pytest.fail("dry run"))
    added = scaler.tick()
    assert (added["action"], added["role"], added["dry_run"]) == ("add", "decode", True)
    assert added["inputs"]["itl_ms"] == 5000 and added["local_prefill"] == "off"
    assert "worker_id" not in added
    assert scaler.tick()["action"] == "hold"  # scale-down waits out its 60 s window
    assert [d["action"] for d in scaler.decisions] == ["add", "hold"]


def test_a_role_below_its_minimum_gets_a_worker_back_and_max_caps_adds_only():
    clock = Clock()
    p = policy(clock, prefill=(1, 1), decode=(2, 3))
    clock.now = 100
    back = p.decide(signals(decode=1))  # one of two died
    assert (back.action, back.role) == ("add", "decode") and "below the minimum" in back.reason
    over = policy(clock, prefill=(1, 1), decode=(1, 2))  # 3 decode workers, max 2: may shrink
    assert over.decide(signals(ttft=10, itl=5, decode=3)).action == "remove"


def test_the_planners_model_scores_splits_from_a_profile_and_a_workload():
    from pathlib import Path

    from deploy.autoscaler import planner_score
    from loadtest.workloads import ONLINE_MIXED

    profile = Path(__file__).resolve().parents[2] / "benchmarks/plans/profile-cpu-1thread.json"
    score = planner_score(str(profile), str(ONLINE_MIXED), SLO_)
    one, two = score(1, 1, 0.3), score(1, 2, 0.3)  # goodput: requests meeting the SLO per s
    assert 0 < one < two <= 0.3  # at 0.3 req/s a second decode worker helps


def test_autoscale_paths_are_made_absolute_for_the_actor(tmp_path, monkeypatch):
    from deploy.config import ConfigError, DeployConfig

    (tmp_path / "slo.yaml").write_text("ttft: {percentile: 90, max_ms: 1}\n"
                                       "itl: {percentile: 99, max_ms: 1}\nmax_error_rate: 0\n")
    (tmp_path / "bad.yaml").write_text("ttft: {percentile: 90, max_ms: 1}\n")
    monkeypatch.chdir(tmp_path)
    config = DeployConfig.from_dict({"autoscale": {"slo_file": "slo.yaml"}})
    assert config.autoscale.slo_file == str(tmp_path / "slo.yaml")
    with pytest.raises(ConfigError, match="autoscale: .*missing keys \\['itl', 'max_error_rate'"):
        DeployConfig.from_dict({"autoscale": {"slo_file": "bad.yaml"}})


def test_the_first_read_sets_a_baseline_and_a_router_restart_starts_over(monkeypatch):
    import io

    import deploy.signals as signals_module
    from deploy.signals import RouterSignals

    def metrics(count: float, ended: float) -> str:
        return "\n".join([f"# TYPE {TTFT} histogram", f'{TTFT}_bucket{{le="1.0"}} {count}',
                          f'{TTFT}_bucket{{le="+Inf"}} {count}', f"{TTFT}_count {count}",
                          f"{TTFT}_sum 0.0", "# TYPE pdserve_router_requests counter",
                          f'{REQUESTS}{{api="grpc",code="OK"}} {ended}'])

    pages = iter([metrics(100, 100), metrics(110, 110), metrics(4, 4)])
    monkeypatch.setattr(signals_module.urllib.request, "urlopen",
                        lambda url, timeout: io.BytesIO(next(pages).encode()))
    monkeypatch.setattr(signals_module, "cluster_status",
                        lambda *a: pb.ClusterStatus(queued_requests=1))
    clock = Clock()
    reader = RouterSignals("router", "metrics", SLO_, clock=clock)
    first = reader.read()
    assert first.ttft_ms is None and first.request_rate == 0  # no window yet
    clock.now = 10
    second = reader.read()
    assert second.ttft_ms == pytest.approx(900) and second.request_rate == pytest.approx(1.0)
    clock.now = 20
    restarted = reader.read()  # counters went down: the router started over
    assert restarted.request_rate == pytest.approx(0.4) and restarted.ttft_ms is not None
