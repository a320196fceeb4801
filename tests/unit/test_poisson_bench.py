"""The Poisson benchmark's arithmetic, without a cluster: arrivals and the goodput summary."""

from __future__ import annotations

from benchmarks.poisson import plan
from benchmarks.poisson_report import Outcome, combined, summary


def test_plans_are_seeded_disjoint_and_capped():
    first = plan([0.5, 2.0], n=10, cap=8, seed=3, repeats=2)
    assert first == plan([0.5, 2.0], n=10, cap=8, seed=3, repeats=2)
    runs = [arrivals for by_rate in first for arrivals in by_rate]
    ids = [tuple(row["prompt_token_ids"]) for arrivals in runs for _, row in arrivals]
    assert len(runs) == 4 and len(set(ids)) == 40  # no prompt reused by another run
    assert all(row["max_tokens"] <= 8 for arrivals in runs for _, row in arrivals)
    spans = [by_rate[0][-1][0] for by_rate in first]
    assert spans[0] > spans[1]  # 4x the rate, a shorter arrival span (for this seed)


def test_goodput_counts_requests_meeting_both_slos():
    outcomes = [Outcome(0.0, ttft=1.0, gaps=[0.1, 0.1], end=2.0, tokens=3),
                Outcome(0.5, ttft=5.0, gaps=[0.1], end=4.0, tokens=2),  # TTFT too slow
                Outcome(1.0, ttft=1.0, gaps=[0.5, 0.5], end=4.0, tokens=3),  # TPOT too slow
                Outcome(1.5, error="UNAVAILABLE")]
    s = summary(outcomes, ttft_slo=2.0, tpot_slo=0.2)
    assert s["attainment"] == 0.25 and s["errors"] == 1
    assert s["goodput"] == 1 / 4.0 and s["tok_s"] == 8 / 4.0


def test_repeated_runs_report_medians():
    fast = [Outcome(0.0, ttft=1.0, gaps=[0.1], end=2.0, tokens=2)]
    slow = [Outcome(0.0, ttft=3.0, gaps=[0.1], end=4.0, tokens=2)]
    middle = [Outcome(0.0, ttft=2.0, gaps=[0.1], end=4.0, tokens=2)]
    s = combined([fast, slow, middle], ttft_slo=2.5, tpot_slo=0.2)
    assert s["ttft"][0] == 2.0 and s["attainment"] == 1.0 and len(s["ttft_all"]) == 3


def test_a_stall_fails_the_max_gap_slo_but_not_the_tpot_one():
    stalled = Outcome(0.0, ttft=1.0, gaps=[0.05] * 9 + [0.9], end=3.0, tokens=11)  # TPOT 0.135
    smooth = Outcome(0.0, ttft=1.0, gaps=[0.15] * 10, end=3.0, tokens=11)
    assert stalled.met(2.0, 0.2) and smooth.met(2.0, 0.2)
    assert not stalled.met(2.0, 0.2, max_gap=0.5) and smooth.met(2.0, 0.2, max_gap=0.5)
    assert summary([stalled, smooth], 2.0, 0.2, max_gap=0.5)["attainment"] == 0.5
