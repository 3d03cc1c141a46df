"""The per-process memory figures every run's summary reports (``streamrl.memory``).

The check runs in a fresh interpreter: a peak is a running maximum over the whole process, so in
the suite's own process an earlier test's larger allocation would hide the one made here."""

from __future__ import annotations

import json
import subprocess
import sys

_CHECK = """
import json, threading, time
import numpy as np
from streamrl import memory
memory.watch_private_memory(interval_s=0.001)
memory.watch_private_memory()  # a second call starts no second thread
threads = sum(t.name == "streamrl-memory-watch" for t in threading.enumerate())
before = memory.peaks_mb()["private"]
block = np.ones(300 * 2**20 // 8)  # 300 MB of private pages, touched
for _ in range(6000):  # until the watcher has read the process with the block in it (a broken one never does)
    if memory._private_peak_kb / 1024 > before + 250:
        break
    time.sleep(0.005)
del block
print(json.dumps({"threads": threads, "before": before, "peaks": memory.peaks_mb()}))
"""


def test_the_private_peak_sees_an_allocation_after_it_is_freed_and_stays_within_the_resident_peak():
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["threads"] == 1
    peaks = got["peaks"]
    assert peaks["private"] > got["before"] + 250  # still there after the block is gone
    assert peaks["private"] <= peaks["resident"]
