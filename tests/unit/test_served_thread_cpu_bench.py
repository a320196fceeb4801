"""The served-CPU benchmark's bookkeeping: /proc stat lines and the compute/messaging split."""

from __future__ import annotations

from benchmarks.served_thread_cpu import TICKS_PER_S, parse_stat, split_compute


def test_a_stat_line_gives_its_name_and_user_plus_system_seconds():
    # The name may hold spaces and parentheses; utime and stime are fields 14 and 15.
    line = f"4242 (py (worker) 1) S 1 2 3 4 5 6 7 8 9 10 {3 * TICKS_PER_S} {TICKS_PER_S} 0 0"
    assert parse_stat(line) == ("py (worker) 1", 4.0)


def test_the_busiest_threads_are_compute_and_the_rest_messaging():
    before = {1: 10.0, 2: 10.0, 3: 1.0}
    after = {1: 30.0, 2: 29.0, 3: 1.5, 4: 0.25}  # thread 4 started during the run
    assert split_compute(before, after, 2) == (39.0, 0.75)
    assert split_compute(before, after, 1) == (20.0, 19.75)
