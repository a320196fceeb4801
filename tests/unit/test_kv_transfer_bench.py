"""The KV-transfer benchmark's arithmetic and report, without a cluster."""

from __future__ import annotations

import math

from benchmarks.kv_transfer import (
    END,
    START,
    TITLE,
    Sample,
    gbps,
    make_prompt,
    replace_section,
    summarize,
    table,
    verdicts,
)


def test_prompts_have_the_length_their_own_first_token_and_wrap_around():
    stream = [10, 11, 12]
    assert make_prompt(stream, 5, 99, 2) == [99, 12, 10, 11, 12]
    assert make_prompt(stream, 1, 7, 0) == [7]


def test_gbps_is_bytes_per_second_in_1e9():
    assert gbps(2e9, 0.5) == 4.0
    assert math.isnan(gbps(1e9, 0.0))


def samples() -> list[Sample]:
    shared = [Sample("shared", 1024, 40_000_000, s, 2.0) for s in (0.010, 0.020, 0.030)]
    dist = [Sample("dist", 1024, 40_000_000, s, t) for s, t in ((0.1, 1.0), (0.2, 4.0),
                                                               (0.4, 2.0))]
    return shared + dist


def test_rows_are_medians_per_transport_and_length():
    shared, dist = summarize(samples(), {1024: 0.01})
    assert (shared["transport"], shared["tokens"], shared["n"]) == ("shared", 1024, 3)
    assert shared["mb"] == 40.0 and shared["transfer_s"] == 0.020
    assert math.isclose(shared["gbps"], 2.0) and math.isclose(shared["memcpy_gbps"], 4.0)
    assert math.isclose(shared["ratio"], 0.5) and shared["share"] == 0.01
    # The share is the median of per-request ratios (0.1, 0.05, 0.2), not a ratio of medians.
    assert dist["transfer_s"] == 0.2 and dist["ttft_s"] == 2.0 and dist["share"] == 0.1


def test_table_and_verdicts_format_the_rows():
    rows = summarize(samples(), {1024: 0.01})
    lines = table(rows)
    assert len(lines) == 4 and lines[2].startswith("| shared | 1,024 | 3 | 40.0 | 20.0 | 2.00 |")
    assert "| 50% | 2,000 | 1.00% |" in lines[2]
    text = "\n".join(verdicts(rows))
    assert "| shared transport ≥70% of memcpy, 1,024+ tokens | 50% at 1,024 tokens | no |" in text
    assert "at 1,024 tokens, shared | 1.00% | yes |" in text
    assert "at 1,024 tokens, dist | 10.00% | no |" in text


def test_verdicts_say_when_a_target_was_not_measured():
    rows = summarize([Sample("dist", 128, 1000, 0.1, 1.0)], {128: 0.001})
    assert "not measured" in "\n".join(verdicts(rows))


def test_the_section_is_appended_once_then_replaced_in_place():
    first = replace_section("# Benchmarks\n\n## Other\n\ntext\n", ["old"])
    assert first.endswith(f"{TITLE}\n\n{START}\nold\n{END}\n")
    second = replace_section(first + "\nnotes kept\n", ["new", "table"])
    assert second.count(TITLE) == 1 and "old" not in second
    assert f"{START}\nnew\ntable\n{END}\n\nnotes kept" in second and "## Other\n\ntext" in second


def test_streamed_rows_get_ttft_verdicts_and_the_whole_copy_the_memcpy_one():
    rows = summarize([Sample("shared", 2048, 90_000_000, 0.002, 4.0),
                      Sample("shared-whole", 2048, 90_000_000, 0.030, 4.0)], {2048: 0.02})
    text = "\n".join(verdicts(rows))
    # The streamed copy's exposed 2 ms is not a copy rate: the verdict uses the whole copy.
    assert "| shared-whole transport ≥70% of memcpy, 1,024+ tokens | 67% at 2,048 tokens | no |" \
        in text
    assert "at 2,048 tokens, shared | 0.05% | yes |" in text
    assert "at 2,048 tokens, shared-whole | 0.75% | yes |" in text
