"""The Poisson benchmark's arithmetic, without a cluster: arrivals and the goodput summary."""

from __future__ import annotations

from benchmarks.poisson import Outcome, plan
from benchmarks.poisson_report import summary


def test_plans_are_seeded_disjoint_and_capped():
    first = plan([0.5, 2.0], n=10, cap=8, seed=3)
    assert first == plan([0.5, 2.0], n=10, cap=8, seed=3)
    ids = [tuple(row["prompt_token_ids"]) for arrivals in first for _, row in arrivals]
    assert len(set(ids)) == 20  # no prompt reused across rates
    assert all(row["max_tokens"] <= 8 for arrivals in first for _, row in arrivals)
    spans = [arrivals[-1][0] for arrivals in first]
    assert spans[0] > spans[1]  # 4x the rate, a shorter arrival span (for this seed)


def test_goodput_counts_requests_meeting_both_slos():
    outcomes = [Outcome(0.0, ttft=1.0, gaps=[0.1, 0.1], end=2.0, tokens=3),
                Outcome(0.5, ttft=5.0, gaps=[0.1], end=4.0, tokens=2),  # TTFT too slow
                Outcome(1.0, ttft=1.0, gaps=[0.5, 0.5], end=4.0, tokens=3),  # TPOT too slow
                Outcome(1.5, error="UNAVAILABLE")]
    s = summary(outcomes, ttft_slo=2.0, tpot_slo=0.2)
    assert s["attainment"] == 0.25 and s["errors"] == 1
    assert s["goodput"] == 1 / 4.0 and s["tok_s"] == 8 / 4.0
