"""Environment calls off the driver's thread: a few isolated worker processes, one trajectory per
worker slot, each call under ``task.env_timeout_s``.

``EnvRunner.submit(tid, op, row, texts)`` returns a ``Future`` of ``(kind, value)`` as the reward
workers answer it (``tasks.rewards._Worker``): ``ok``, ``error`` (the env raised), ``timeout`` or
``died``. A trajectory always goes to the same slot, so its env object is found there; a worker
that timed out is killed and started again on the slot's next call (its other trajectories'
envs are then replayed: ``agent.env.EnvHost``).
"""

from __future__ import annotations

import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

from streamrl.agent.env import EnvHost


class _Slot:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.worker = None


class EnvRunner:
    def __init__(self, host: EnvHost, workers: int = 4, timeout_s: float = 30.0, startup_timeout_s: float = 60.0) -> None:
        import cloudpickle

        self._blob = cloudpickle.dumps(host)
        self.timeout_s, self.startup_timeout_s = float(timeout_s), float(startup_timeout_s)
        self._slots = [_Slot() for _ in range(max(1, workers))]
        self._pool = ThreadPoolExecutor(max_workers=len(self._slots), thread_name_prefix="env")
        self._lock = threading.Lock()
        self.counts = {"calls": 0, "errors": 0, "timeouts": 0, "worker_restarts": 0}
        self._closed = False

    def submit(self, tid: str, op: str, row: dict, texts: list[str]) -> Future:
        slot = self._slots[zlib.crc32(tid.encode()) % len(self._slots)]
        return self._pool.submit(self._call, slot, (op, tid, row, list(texts)))

    def _call(self, slot: _Slot, job: tuple) -> tuple[str, object]:
        from streamrl.tasks.rewards import RewardError, _Worker

        with slot.lock:
            if self._closed:
                return "died", "the environment runner is closed"
            if slot.worker is not None and not slot.worker.alive():
                slot.worker.kill()
                slot.worker = None
                self._count("worker_restarts")
            if slot.worker is None:
                try:
                    slot.worker = _Worker(self._blob, None, self.startup_timeout_s)
                except RewardError as exc:
                    self._count("errors")
                    return "error", str(exc)
            kind, value = slot.worker.call(job, self.timeout_s)
            if kind in ("timeout", "died"):
                slot.worker.kill()
                slot.worker = None
                self._count("worker_restarts")
        self._count("calls")
        if kind != "ok":
            self._count("timeouts" if kind == "timeout" else "errors")
        return kind, value

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def close(self) -> None:
        """Stop every worker (idempotent); calls still queued answer ``died``."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for slot in self._slots:
            with slot.lock:
                if slot.worker is not None:
                    slot.worker.kill()
                    slot.worker = None
