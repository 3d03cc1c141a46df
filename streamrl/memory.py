"""Give freed heap memory back to the operating system, once per iteration; read a process's peaks.

Why: the trainer and the generation instances allocate tensors of a different shape every
iteration (batches of varying length). glibc's malloc keeps freed chunks inside its arenas and
raises its mmap threshold after large frees, so the resident memory of a long run creeps up
(measured by ``streamrl bench soak``: a few MB per 100 iterations) although nothing is leaked.
``malloc_trim(0)`` returns the free pages of every arena (``madvise`` on whole free pages), at a
cost of milliseconds. Fixed ``MALLOC_*`` settings did the same but slowed the run by a quarter
(docs/experiments.md). A no-op where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
import time


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def release_free_memory() -> bool:
    """``malloc_trim(0)``; True when glibc released something."""
    lib = _libc()
    return bool(lib.malloc_trim(0)) if lib is not None else False


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB (``VmHWM``; ``ru_maxrss`` where /proc is absent):
    what every run's summary reports per process."""
    kb = _status_kb("VmHWM:")
    if kb is not None:
        return kb / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


_private_peak_kb = 0
_watcher: threading.Thread | None = None


def watch_private_memory(interval_s: float = 0.02) -> None:
    """Start (once per process) a daemon thread that keeps the largest ``RssAnon`` it reads every
    ``interval_s``: this process's own anonymous memory (heap, tensors). ``VmHWM`` also counts
    the pages of shared memory the process touched, among them every object-store page it wrote
    (published weights), which belong to the object store and stay mapped after it frees them."""
    global _watcher
    if _watcher is not None or _status_kb("RssAnon:") is None:
        return

    def watch() -> None:
        global _private_peak_kb
        while True:
            _private_peak_kb = max(_private_peak_kb, _status_kb("RssAnon:") or 0)
            time.sleep(interval_s)

    _watcher = threading.Thread(target=watch, name="streamrl-memory-watch", daemon=True)
    _watcher.start()


def peaks_mb() -> dict[str, float]:
    """``{"resident": peak resident (VmHWM), "private": peak RssAnon sampled since
    watch_private_memory started (absent if it did not)}`` in MB."""
    out = {"resident": peak_rss_mb()}
    if _watcher is not None:
        out["private"] = max(_private_peak_kb, _status_kb("RssAnon:") or 0) / 1024
    return out
