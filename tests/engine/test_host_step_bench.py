"""benchmarks.host_step: a stubbed engine's steps sample the stub's tokens, and a comparison
against a commit runs both trees and removes its worktree."""

from __future__ import annotations

import gc

import pytest

from benchmarks.host_step import (
    STUB_VOCAB,
    CollectorClock,
    compare,
    decode_ms,
    parse_args,
    stubbed_llm,
)
from engine.request import SamplingParams
from tests.engine.worktree_runs import start_worktree_test, worktrees


def test_stubbed_steps_sample_the_one_hot_rows() -> None:
    llm = stubbed_llm()
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4,
                                                   ignore_eos=True))[0]
    # the stub's row 0 is one-hot at token 300, and every step samples one row here
    assert out.token_ids == [300] * 4
    assert 0 < decode_ms(llm.engine, running=3, steps=2, first_id=40_000)
    assert 0 < decode_ms(llm.engine, running=2, steps=2, first_id=41_000, depth=5)
    assert not llm.engine.has_unfinished_requests()
    assert STUB_VOCAB < llm.engine.model_config.vocab_size


def test_compares_head_with_itself_and_removes_the_worktree(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = start_worktree_test(monkeypatch)  # the argmax, which a stubbed step runs, too
    report = compare(parse_args(["--against", "HEAD", "--running", "2", "--steps", "2",
                                 "--passes", "1", "--rounds", "1", "--deep", "3",
                                 "--kv-cache-gb", "1"]))
    assert set(report["median"]) == {"earlier", "this"}
    for figures in report["median"].values():
        assert figures["decode_ms_2"] > 0 and figures["workload_s"] > 0
        assert figures["decode_ms_2_at_3"] > 0
        assert figures["gc_full_ms"] > figures["gc_full_ms_frozen"] >= 0
        assert figures["workload_s_mean"] > 0
        assert figures["workload_gc_ms_mean"] >= 0
        assert figures["workload_full_collections_mean"] >= 0
    ratio = report["this_over_earlier"]["workload_s"]
    assert ratio == report["median"]["this"]["workload_s"] / \
        report["median"]["earlier"]["workload_s"]
    assert worktrees() == before


def test_the_collector_clock_times_collections_inside_its_block_only() -> None:
    with CollectorClock() as clock:
        gc.collect()
    assert clock.full == 1 and clock.ms > 0
    seen = clock.ms
    gc.collect()
    assert clock.full == 1 and clock.ms == seen


def test_refuses_zero_rounds() -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--rounds", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        parse_args(["--deep", "-1"])
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-gb", "0"])
