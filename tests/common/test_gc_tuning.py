"""freeze_startup_heap (common/gc_tuning.py): what start-up allocated leaves the cycle
collector's reach (a full collection no longer walks it), and the collector stays on
for what serving allocates."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap


def test_frozen_startup_heap_is_out_of_later_collections():
    frozen_here = gc.get_freeze_count()
    script = textwrap.dedent("""
        import gc
        from pdserve.common.gc_tuning import freeze_startup_heap
        heap = [[i, str(i)] for i in range(300_000)]  # a start-up heap: long-lived, tracked
        gc.collect(); before = len(gc.get_objects(2))  # what a full collection walks
        frozen = freeze_startup_heap()
        gc.collect(); after = len(gc.get_objects(2))
        cycle = []; cycle.append(cycle); del cycle  # serving's garbage is still collected
        print(frozen, gc.isenabled(), gc.collect() >= 1, before, after)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    frozen, enabled, collects, before, after = int(out[0]), out[1], out[2], int(out[3]), int(out[4])
    assert frozen >= 300_000 and enabled == "True" and collects == "True"
    assert before >= 300_000 and after < 1000, f"the oldest generation held {before} objects, then {after}"
    assert gc.get_freeze_count() == frozen_here  # the test process itself is untouched
