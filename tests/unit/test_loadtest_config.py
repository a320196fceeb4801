"""The load test's plain parts: SLO files and verdicts, load shapes, workload files."""

from __future__ import annotations

import json

import pytest

from loadtest.shapes import ShapeSpec, users_at
from loadtest.slo import SLO, judge
from loadtest.workload import DEFAULT_WORKLOAD, load_workload

GOOD = {"ttft": {"percentile": 90, "max_ms": 500}, "itl": {"percentile": 99, "max_ms": 100},
        "max_error_rate": 0.05}


def test_slo_file_round_trip(tmp_path):
    path = tmp_path / "slo.yaml"
    path.write_text("ttft: {percentile: 90, max_ms: 500}\nitl: {percentile: 99, max_ms: 100}\n"
                    "max_error_rate: 0.05\n")
    slo = SLO.from_yaml(path)
    assert slo == SLO.from_dict(GOOD)
    assert slo.ttft.percentile == 90 and slo.itl.max_ms == 100


@pytest.mark.parametrize("change, message", [
    ({"extra": 1}, "unknown keys ['extra']"),
    ({"ttft": {"percentile": 100, "max_ms": 5}}, "ttft.percentile must be in (0, 100)"),
    ({"itl": {"percentile": 50, "max_ms": 0}}, "itl.max_ms must be > 0"),
    ({"itl": {"p": 50}}, "itl must be {percentile: P, max_ms: M}"),
    ({"max_error_rate": 2}, "max_error_rate must be in [0, 1]"),
])
def test_bad_slo_files_are_refused_with_the_field(change, message):
    with pytest.raises(ValueError) as error:
        SLO.from_dict({**GOOD, **change})
    assert message in str(error.value)


def test_verdict_per_entry():
    slo = SLO.from_dict(GOOD)
    verdicts = judge(slo, {"TTFT": 400.0, "ITL": 150.0}, requests=100, failures=2)
    assert [(v.entry, v.met) for v in verdicts] == [
        ("TTFT", True), ("ITL", False), ("errors", True), ("completed", True)]
    nothing = judge(slo, {"TTFT": None, "ITL": None}, requests=0, failures=0)
    assert not any(v.met for v in nothing)


def test_shapes_stay_within_their_bounds_and_end():
    for kind in ("constant", "ramp", "step", "burst", "pulse"):
        spec = ShapeSpec(kind, users=8, spawn_rate=2, duration_s=40, burst_period_s=10,
                         burst_s=2)
        counts = [users_at(spec, t)[0] for t in range(40)]
        assert all(1 <= c <= 8 for c in counts) and users_at(spec, 40) is None
        assert max(counts) == 8
    assert [users_at(ShapeSpec("ramp", 8, duration_s=40), t)[0] for t in (0, 19, 39)] == \
        [1, 4, 8]
    assert sorted({users_at(ShapeSpec("step", 8, duration_s=40), t)[0] for t in range(40)}) \
        == [2, 4, 6, 8]
    burst = [users_at(ShapeSpec("burst", 8, duration_s=40, burst_period_s=10, burst_s=2), t)[0]
             for t in range(10)]
    assert burst == [2] * 8 + [8, 8]
    pulse = [users_at(ShapeSpec("pulse", 8, duration_s=30), t)[0] for t in range(30)]
    assert pulse == [2] * 10 + [8] * 10 + [2] * 10  # up for the middle third, then down


def test_shapes_refuse_unbounded_or_unknown_load():
    with pytest.raises(ValueError, match="--users"):
        ShapeSpec("constant", users=10_000)
    with pytest.raises(ValueError, match="--shape"):
        ShapeSpec("sawtooth")


def test_the_default_workload_is_80_percent_chat(tmp_path):
    items = load_workload(DEFAULT_WORKLOAD, max_tokens_cap=8)
    chat = sum(item.kind == "chat" for item in items)
    assert len(items) == 240 and chat / len(items) == pytest.approx(0.8, abs=0.02)
    assert max(item.max_tokens for item in items) == 8
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_token_ids": [], "max_tokens": 4}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_workload(bad)


@pytest.mark.parametrize(("argv", "message"), [
    (["--users", "0"], "users"),
    (["--max-requests", "0"], "--max-requests must be in \\[1, 100000\\], got 0"),
    (["--max-tokens-cap", "-1"], "--max-tokens-cap must be >= 0 \\(0: no cap\\), got -1"),
])
def test_a_local_load_test_refuses_bad_options_before_any_cluster_starts(argv, message,
                                                                          monkeypatch):
    import launch.cluster
    from loadtest.__main__ import main

    def no_start(self):  # noqa: ANN001, ANN202
        raise AssertionError("a cluster was started for options locust refuses")

    monkeypatch.setattr(launch.cluster.LocalCluster, "start", no_start)
    with pytest.raises(ValueError, match=message):
        main(["local", *argv])
