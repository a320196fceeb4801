"""engine.gc_heap, each case in a process of its own (a freeze is for the whole process): the
startup heap leaves the collector's view, garbage made afterwards is still collected, and a thaw
gives the heap back; a run's freeze lasts as long as the run, nested runs thaw with the last,
and none undoes a serving process's freeze or the application's own; no collection runs inside
a capture's block."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import gc
    from engine.gc_heap import freeze_startup_heap, thaw_heap

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


RUNS = textwrap.dedent("""
    import gc
    from engine.gc_heap import freeze_startup_heap, heap_frozen_while, thaw_heap

    def visible(obj):  # whether a full collection walks it
        return any(o is obj for o in gc.get_objects())

    before = [[i] for i in range(1_000)]
    with heap_frozen_while():
        assert not visible(before)
        during = [[]]
        assert visible(during)  # made inside the run: the collector sees it
        with heap_frozen_while():
            pass
        assert not visible(before)  # the inner run ended; the outer one still holds the freeze
    assert visible(before) and gc.get_freeze_count() == 0  # thawed with the last run

    freeze_startup_heap()
    served = [[]]
    with heap_frozen_while():
        assert visible(served)  # under the process's freeze a run adds none of its own
    assert not visible(before) and gc.get_freeze_count() > 0  # and does not thaw it
    thaw_heap()
    assert visible(before)
    print("ok")
""")

FOREIGN = textwrap.dedent("""
    import gc
    from engine.gc_heap import heap_frozen_while

    app_state = [[i] for i in range(1_000)]
    gc.freeze()  # the application's own freeze, not engine.gc_heap's
    frozen = gc.get_freeze_count()
    with heap_frozen_while():
        made = [[]]
        assert any(o is made for o in gc.get_objects())  # no freeze of its own on top
    assert gc.get_freeze_count() == frozen  # and the application's is left as it was
    print("ok")
""")

CAPTURE = textwrap.dedent("""
    import gc
    from engine.gc_heap import no_collection

    class Node:
        pass

    collections = []
    gc.callbacks.append(lambda phase, info: collections.append(phase))
    before = [[]]
    with no_collection():
        collections.clear()
        assert not gc.isenabled()
        assert not any(o is before for o in gc.get_objects())  # frozen meanwhile
        for _ in range(50_000):  # far past every generation's threshold
            a, b = Node(), Node()
            a.other, b.other = b, a
        assert collections == []  # none ran on its own
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    with no_collection():
        pass
    assert not gc.isenabled()  # a collector that was off stays off
    print("ok")
""")


@pytest.mark.parametrize("script", [SCRIPT, RUNS, FOREIGN, CAPTURE],
                         ids=["startup", "runs", "foreign", "capture"])
def test_in_a_process_of_its_own(script: str) -> None:
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
