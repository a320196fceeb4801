"""benchmarks.served_against_commit's arithmetic: medians per tree and their ratios."""

from __future__ import annotations

import pytest

from benchmarks.served_against_commit import summary, table


def run(itl: float, worker: float, router: float, tokens: int = 1000) -> dict[str, float]:
    return {"itl_p50_ms": itl, "wall_s": 5.0, "tokens": tokens, "worker_compute_s": 9.0,
            "worker_messaging_s": worker, "router_s": router, "client_s": 0.1}


def test_medians_are_per_token_microseconds_over_every_run():
    got = summary([run(30.0, 0.2, 0.4), run(32.0, 0.1, 0.2, tokens=500), run(10.0, 0.3, 0.1)])
    assert got["itl_p50_ms"] == 30.0
    assert got["worker_messaging_us_per_token"] == pytest.approx(200.0)  # 200, 200, 300
    assert got["router_us_per_token"] == pytest.approx(400.0)  # 400, 400, 100
    assert got["client_us_per_token"] == pytest.approx(100.0)


def test_the_table_names_both_trees_and_the_ratio():
    earlier, this = summary([run(30.0, 0.2, 0.4)]), summary([run(27.0, 0.1, 0.3)])
    report = {"commit": "abc123", "machine": "a CPU", "dtype": "bfloat16", "concurrency": 16,
              "runs": {"this": [{}], "earlier": [{}]}, "median": {"earlier": earlier, "this": this},
              "ratio": {k: this[k] / earlier[k] for k in this}}
    lines = table(report)
    assert lines[4].startswith("| abc123 | 30.0 | 200 | 400 | 100 |")
    assert lines[5].startswith("| this checkout | 27.0 | 100 | 300 | 100 |")
    assert lines[6] == "| this / earlier | 0.900 | 0.500 | 0.750 | 1.000 |"
