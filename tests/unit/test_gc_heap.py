"""common.gc_heap in a process of its own (a freeze is for the whole process): the startup heap
leaves the collector's view, garbage made afterwards is still collected, and a thaw gives the
heap back."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import gc
    from common.gc_heap import freeze_startup_heap, thaw_heap

    startup = [[i] for i in range(50_000)]  # long-lived containers, as a model's would be
    tracked_before = len(gc.get_objects())
    frozen = freeze_startup_heap()
    assert frozen >= 50_000 and frozen >= tracked_before - 100, (frozen, tracked_before)
    assert len(gc.get_objects()) < 1_000  # a full collection no longer walks the heap

    class Node:
        pass

    for _ in range(3):
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle only the collector can free
        del a, b
    assert gc.collect() >= 6  # made after the freeze: collected as before
    thaw_heap()
    assert len(gc.get_objects()) >= 50_000  # the collector sees the startup heap again
    print("ok")
""")


def test_freezing_hides_the_startup_heap_and_later_garbage_is_still_collected() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
