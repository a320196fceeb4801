"""The P:D planner without a model: the cluster model's arithmetic step by step, its placement and
queue order, and the planner's inputs, ranking and CLI."""

from __future__ import annotations

import json
import math

import pytest

from cli.cluster import main as router_main
from planner.plan import SLO, candidates, load_workload, plan, report
from planner.simulator import ClusterSim, Profile, Topology

# A prefill-only step: 0.1 s + 1 ms per token; a decode step: 0.05 s + 10 ms per sequence.
PROFILE = Profile(per_step_s=0.1, per_token_s=0.001, per_token2_s=0.0, decode_base_s=0.05,
                  decode_per_seq_s=0.01)
PROFILE_JSON = {"prefill": {"per_step_s": 0.1, "per_token_s": 0.001, "per_token2_s": 0.0},
                "decode": {"base_s": 0.05, "per_seq_s": 0.01}}


def test_profile_reads_engine_profile_json_and_prices_prompt_tokens():
    assert Profile.from_json(PROFILE_JSON) == PROFILE
    with pytest.raises(ValueError, match="not a profile"):
        Profile.from_json({"prefill": {}})
    with pytest.raises(ValueError, match="per_token_s must be >= 0"):
        Profile(0.1, -1.0, 0.0, 0.05, 0.01)
    quadratic = Profile(0.0, 0.001, 1e-6, 0.0, 0.0)
    # Tokens [512, 600) cost their count plus the context term over that range.
    assert math.isclose(quadratic.prefill_s(512, 600), 0.088 + 1e-6 * (600**2 - 512**2))


def test_a_colocated_worker_chunks_the_prompt_then_decodes():
    (request,) = ClusterSim(Topology(colocated=1), PROFILE).run([(0.0, 600, 3)])
    # 512 tokens (0.612 s), 88 tokens (0.188 s): first token at 0.8; two decode steps of 0.06.
    assert math.isclose(request.ttft, 0.8)
    assert all(math.isclose(g, 0.06) for g in request.gaps) and len(request.gaps) == 2
    assert math.isclose(request.end, 0.92) and request.site == "colocated"


def test_a_long_prompt_is_prefilled_remotely_and_joins_the_decode_batch():
    (request,) = ClusterSim(Topology(prefill=1, decode=1), PROFILE).run([(0.0, 600, 3)])
    assert request.site == "remote"  # 600 > 512 tokens, and the pool is idle
    assert math.isclose(request.ttft, 0.8) and math.isclose(request.end, 0.92)


def test_a_prompt_of_one_chunk_is_prefilled_by_the_decode_worker_a_longer_one_remotely():
    (short,) = ClusterSim(Topology(prefill=1, decode=1), PROFILE).run([(0.0, 30, 1)])
    assert short.site == "local" and math.isclose(short.ttft, 0.13)
    # 100 tokens would take the decode worker four steps (chunks of 32, 32, 32, 4: 0.5 s); the
    # idle prefill worker takes one (0.2 s)
    (request,) = ClusterSim(Topology(prefill=1, decode=1), PROFILE).run([(0.0, 100, 1)])
    assert request.site == "remote" and math.isclose(request.ttft, 0.2)
    (wide,) = ClusterSim(Topology(prefill=1, decode=1, local_chunk=128),
                         PROFILE).run([(0.0, 100, 1)])
    assert wide.site == "local" and math.isclose(wide.ttft, 0.2)
    (off,) = ClusterSim(Topology(prefill=1, decode=1, local_prefill="off"),
                        PROFILE).run([(0.0, 30, 1)])
    assert off.site == "remote" and math.isclose(off.ttft, 0.13)


def test_a_short_prompt_overtakes_a_long_one_between_steps():
    long, short = ClusterSim(Topology(colocated=1), PROFILE).run([(0.0, 2000, 1),
                                                                  (0.01, 100, 1)])
    # Step 1 (0-0.612) holds the long prompt's first chunk; step 2 takes the short prompt whole
    # and 412 of the long prompt's tokens.
    assert math.isclose(short.first_token, 0.612 + 0.1 + 0.512)
    assert long.first_token > short.first_token


def test_candidates_cover_colocated_and_every_split_with_and_without_local_prefill():
    assert [t.name for t in candidates(3)] == [
        "colocated3", "1p2d", "1p2d local-prefill off", "2p1d", "2p1d local-prefill off"]
    assert [t.launch_args for t in candidates(2)] == [
        "--colocated 2", "--prefill 1 --decode 1 --local-prefill auto",
        "--prefill 1 --decode 1 --local-prefill off"]
    with pytest.raises(ValueError, match="--workers must be >= 1"):
        candidates(0)


def test_slo_and_workload_files_are_checked(tmp_path):
    slo = tmp_path / "slo.json"
    slo.write_text(json.dumps({"ttft_s": 8}))
    with pytest.raises(ValueError, match=r"needs \['tpot_s'\]"):
        SLO.load(slo)
    with pytest.raises(ValueError, match="tpot_s must be > 0"):
        SLO(8.0, 0.0)
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt_token_ids": [1, 2, 3], "max_tokens": 100}\n'
                        '{"prompt_tokens": 50, "max_tokens": 10}\n')
    assert load_workload(workload, cap=64) == [(3, 64), (50, 10)]
    workload.write_text('{"prompt_tokens": 0, "max_tokens": 10}\n')
    with pytest.raises(ValueError, match="w.jsonl:1: needs prompt_token_ids"):
        load_workload(workload, cap=None)


def test_plan_ranks_candidates_by_goodput_and_reports_the_best():
    rows = [(1500, 32)] * 2 + [(200, 32)] * 8
    table = plan(PROFILE, rows, SLO(8.0, 0.2), 2, [0.2, 0.4], requests=60, seeds=2)
    for results in table.values():
        goodputs = [r["goodput"] for r in results]
        assert goodputs == sorted(goodputs, reverse=True) and len(results) == 3
        assert all(0 <= r["attainment"] <= 1 for r in results)
    text = "\n".join(report(table, SLO(8.0, 0.2), 2))
    assert f"rate 0.2 req/s — recommended: {table[0.2][0]['topology']}" in text


def test_router_plan_cli_reads_its_files_and_refuses_bad_ones(tmp_path, capsys):
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE_JSON))
    (tmp_path / "slo.json").write_text(json.dumps({"ttft_s": 8, "tpot_s": 0.2}))
    (tmp_path / "w.jsonl").write_text('{"prompt_tokens": 300, "max_tokens": 16}\n')
    args = ["plan", "--workload", str(tmp_path / "w.jsonl"), "--slo", str(tmp_path / "slo.json"),
            "--workers", "2", "--profile", str(tmp_path / "profile.json"), "--requests", "20",
            "--seeds", "1", "--json", str(tmp_path / "out.json")]
    assert router_main(args) == 0
    assert "recommended:" in capsys.readouterr().out
    assert set(json.loads((tmp_path / "out.json").read_text())) == {"0.4"}
    with pytest.raises(SystemExit) as refused:
        router_main([*args[:5], "--workers", "0", *args[7:]])
    assert refused.value.code == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
    # Refused before any profile is read or measured (a missing one would be measured first)
    no_profile = [a for a in args if a not in ("--profile", str(tmp_path / "profile.json"))]
    for bad, message in ((["--prefill-tp", "0"], "--prefill-tp and --decode-tp must be >= 1"),
                         (["--max-tokens-cap", "-2"], "--max-tokens-cap must be >= 0")):
        with pytest.raises(SystemExit) as refused:
            router_main([*no_profile, *bad])
        assert refused.value.code == 2 and message in capsys.readouterr().err


def test_tensor_parallel_roles_take_their_devices_and_their_own_speed(tmp_path, capsys):
    assert [(t.name, t.devices) for t in candidates(5, prefill_tp=2, decode_tp=1)] == [
        ("colocated5", 5), ("1p(tp2)3d", 5), ("1p(tp2)3d local-prefill off", 5),
        ("2p(tp2)1d", 5), ("2p(tp2)1d local-prefill off", 5)]
    assert candidates(4, 1, 2)[0].launch_args == "--colocated 2 -tp 2"
    assert candidates(4, 2, 2)[1].launch_args == ("--prefill 1 --decode 1 --prefill-tp 2 "
                                                  "--decode-tp 2 --local-prefill auto")
    with pytest.raises(ValueError, match="cannot hold one worker at --decode-tp 4"):
        candidates(3, 1, 4)
    # A faster TP-2 prefill worker gives the same prompt its first token sooner.
    fast = Profile(0.1, 0.0005, 0.0, 0.05, 0.01)
    topology = Topology(prefill=1, decode=1, local_prefill="off", prefill_tp=2)
    (at_tp2,) = ClusterSim(topology, {1: PROFILE, 2: fast}).run([(0.0, 600, 3)])
    (at_tp1,) = ClusterSim(Topology(prefill=1, decode=1, local_prefill="off"),
                           PROFILE).run([(0.0, 600, 3)])
    assert at_tp2.first_token < at_tp1.first_token
    with pytest.raises(ValueError, match="no profile of a worker at tensor-parallel size 2"):
        ClusterSim(topology, PROFILE)
    (tmp_path / "p1.json").write_text(json.dumps(PROFILE_JSON))
    (tmp_path / "slo.json").write_text(json.dumps({"ttft_s": 8, "tpot_s": 0.2}))
    (tmp_path / "w.jsonl").write_text('{"prompt_tokens": 300, "max_tokens": 16}\n')
    args = ["plan", "--workload", str(tmp_path / "w.jsonl"), "--slo", str(tmp_path / "slo.json"),
            "--workers", "3", "--prefill-tp", "2", "--tp-profile", f"2={tmp_path / 'p1.json'}",
            "--profile", str(tmp_path / "p1.json"), "--requests", "20", "--seeds", "1"]
    assert router_main(args) == 0
    assert "1p(tp2)1d" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        router_main([*args[:9], "--tp-profile", "two=x.json", *args[11:]])
    assert "--tp-profile takes N=FILE" in capsys.readouterr().err
