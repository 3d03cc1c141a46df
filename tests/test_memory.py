"""The per-process memory figures every run's summary reports (``streamrl.memory``)."""

from __future__ import annotations

import threading
import time

import numpy as np

from streamrl import memory


def test_the_private_peak_sees_an_allocation_after_it_is_freed_and_stays_within_the_resident_peak():
    memory.watch_private_memory(interval_s=0.001)
    memory.watch_private_memory()  # a second call starts no second thread
    assert sum(t.name == "streamrl-memory-watch" for t in threading.enumerate()) == 1
    before = memory.peaks_mb()["private"]
    block = np.ones(300 * 2**20 // 8)  # 300 MB of private pages, touched
    for _ in range(6000):  # until the watcher has read the process with the block in it (a broken one never does)
        if memory._private_peak_kb / 1024 > before + 250:
            break
        time.sleep(0.005)
    del block
    peaks = memory.peaks_mb()
    assert peaks["private"] > before + 250  # still there after the block is gone
    assert peaks["private"] <= peaks["resident"]
