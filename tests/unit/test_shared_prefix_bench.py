"""The shared-prefix benchmark's workload and report, without a cluster."""

from __future__ import annotations

import argparse

from benchmarks.shared_prefix import (
    END,
    START,
    TITLE,
    Turn,
    build,
    replace_section,
    section,
    summarize,
)


def test_conversations_share_system_prompts_round_robin_with_their_own_messages():
    args = argparse.Namespace(systems=2, system_tokens=30, chats=5, turns=3, user_tokens=7)
    chats = build(args)
    assert len(chats) == 5 and all(len(c.system) == 30 for c in chats)
    assert chats[0].system == chats[2].system == chats[4].system != chats[1].system
    users = [tuple(u) for c in chats for u in c.users]
    assert len(users) == 15 and all(len(u) == 7 for u in users)
    assert len(set(users)) == 15  # every message is its own slice of text


def test_computed_tokens_are_prompt_less_cached_and_the_verdicts_follow():
    turns = [Turn(0, 0, 1000, 0, 1.0), Turn(0, 1, 1200, 1000, 0.5), Turn(1, 0, 900, 0, 0.0,
                                                                         error="UNAVAILABLE")]
    row = summarize(turns, 10.0)
    assert (row["turns"], row["errors"], row["prompt_tokens"]) == (2, 1, 2200)
    assert row["computed_tokens"] == 1200 and row["ttft_p50"] == 0.75
    load = dict(row, computed_tokens=4000, ttft_p50=2.0)
    text = "\n".join(section({"cache-aware": row, "load": load}, "cmd", 1100))
    assert "The least any placement could compute: 1,100 tokens" in text
    assert "**70% fewer** with cache-aware placement (target ≥60%: met)" in text
    assert "750 ms cache-aware vs 2,000 ms load-only (target lower: met)" in text
    marked = replace_section("# B\n", ["OLD-BODY"])
    assert TITLE in marked and marked.count(START) == 1 and END in marked
    again = replace_section(marked, ["NEW-BODY"])
    assert "NEW-BODY" in again and "OLD-BODY" not in again and again.count(TITLE) == 1
