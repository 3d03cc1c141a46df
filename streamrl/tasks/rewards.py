"""Run a reward function safely: per-call timeout, exception accounting, metrics.

``RewardRunner(fn, timeout_s=5.0, on_error="zero")`` turns any ``fn(prompt, response) -> float``
(or a dict of named components, see ``normalize``) into ``runner(prompt, response) -> (reward,
info)``. Invariants: a failed call (exception, timeout, worker crash, non-finite or non-numeric
value) is either counted, logged and scored 0.0 with ``info = {"error": "..."}``
(``on_error="zero"``) or raised as ``RewardError`` naming the prompt id and the cause
(``"raise"``); an isolated call (the default) costs at most ``timeout_s`` plus a kill, since it
runs in a worker *process* that is SIGKILLed on expiry and replaced on the next call; workers
never outlive the runner. ``fast=True`` runs a trusted pure function in the caller's thread,
with no timeout. The two paths, their costs and why processes: ``RewardRunner``.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import traceback
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Callable, Literal, Mapping

from streamrl.types import Prompt

log = logging.getLogger(__name__)

RewardFn = Callable[[Prompt, str], float]


class RewardError(RuntimeError):
    """A reward call failed and ``on_error="raise"``; the message names the prompt id and cause."""


def normalize(value: Any) -> tuple[float, dict[str, float]]:
    """A reward function's return value as ``(score, components)``: a number; a dict of named
    components (its ``score`` entry, else their sum); or ``(score, components)`` already
    (``UserReward``). Raises ``TypeError`` for anything else, which counts as a failed call."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        return float(value[0]), {str(k): float(v) for k, v in value[1].items()}
    if isinstance(value, Mapping):
        parts = {str(k): float(v) for k, v in value.items()}
        return (parts["score"] if "score" in parts else sum(parts.values())), parts
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise TypeError(f"reward is {type(value).__name__} {value!r}, not a number or a dict of numbers")
    return float(value), {}


def _worker_main(fd: int) -> None:
    """Worker process loop: load ``fn``, warm it up, then answer (prompt, response) jobs."""
    conn = Connection(fd)
    try:
        sys_path, fn_blob, warmup = conn.recv()
        sys.path[:] = sys_path  # so ``fn`` unpickles from the same modules as in the parent
        fn = pickle.loads(fn_blob)
    except BaseException as exc:  # report why the worker cannot start, then exit
        conn.send(("fail", f"could not load reward function: {type(exc).__name__}: {exc}"))
        return
    try:  # first calls may import heavy modules (sympy); keep that out of the timed calls
        if hasattr(fn, "prepare"):  # a user's reward: import its modules, call nothing
            fn.prepare()
        elif warmup is not None:
            fn(*warmup)
    except Exception:
        pass  # a reward that cannot load fails on its first call, where it is counted
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return  # parent went away
        if job is None:
            return
        try:  # an environment host (``agent.env.EnvHost``) answers with its own records
            value = fn(*job)
            conn.send(("ok", value if getattr(fn, "raw_results", False) else normalize(value)))
        except Exception as exc:
            tb = traceback.format_exc(limit=-3)
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{tb}"))


class _Worker:
    """One reward worker process and the parent's end of its socket.

    Started with ``subprocess`` running ``python -c`` rather than ``multiprocessing``: spawn and
    forkserver re-import the parent's ``__main__`` script in the child, which breaks under
    ``python -`` / REPLs and re-runs unguarded driver scripts; fork is unsafe in threaded hosts
    (Ray, torch). The socket is an inherited ``multiprocessing`` Connection.
    """

    def __init__(self, fn_blob: bytes, warmup: tuple[Prompt, str] | None, startup_timeout_s: float):
        self.conn, child = multiprocessing.Pipe()
        code = f"from {__name__} import _worker_main; _worker_main({child.fileno()})"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)),
        )
        child.close()
        try:
            self.conn.send((sys.path, fn_blob, warmup))
            ready = self.conn.poll(startup_timeout_s)
            tag, detail = self.conn.recv() if ready else ("fail", f"did not start within {startup_timeout_s:.0f}s")
        except (EOFError, OSError):
            tag, detail = "fail", f"exited during startup (exit code {self.proc.wait(5)})"
        if tag != "ready":
            self.kill()
            raise RewardError(f"reward worker failed to start: {detail}")

    def call(self, job: tuple, timeout_s: float) -> tuple[str, Any]:
        """Run ``fn(*job)``: ("ok", value) | ("error", message) | ("timeout", None) | ("died", message)."""
        try:
            self.conn.send(job)
            if not self.conn.poll(timeout_s):
                return "timeout", None
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            try:
                code = self.proc.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
            return "died", f"reward worker died ({type(exc).__name__}, exit code {code})"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()


def _stop_workers(workers: list[_Worker]) -> None:
    """Ask each worker to exit, then make sure it has (also run at interpreter exit)."""
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    for w in workers:
        try:
            w.proc.wait(0.5)
        except subprocess.TimeoutExpired:
            pass
        w.kill()
    workers.clear()


class RewardRunner:
    """Wraps a reward function with a timeout and error accounting.

    ``info["components"]`` holds a dict reward's components. Counters come back from
    ``metrics()`` as ``reward/calls``, ``reward/errors``, ``reward/timeouts``,
    ``reward/worker_restarts`` (and ``reward/mean_call_ms``). Two paths:

    - **fast** (``fast=True``, for trusted pure functions such as the synthetic task's string
      compare): called in the caller's thread. Exceptions are caught; there is no timeout. The
      overhead is a try/except and a lock-protected counter bump.
    - **isolated** (default, e.g. ``math_verify``, which can hang on adversarial LaTeX): the call
      runs in a small pool of persistent worker *processes*, each fed over a socket. The caller
      waits ``timeout_s`` with ``Connection.poll``; on expiry the worker is SIGKILLed and
      replaced lazily on the next call.

    Why processes and not threads or ``signal.alarm``: a Python thread cannot be killed, so a
    hung thread leaks forever and pins a core; ``signal.alarm`` only works in the main thread of
    the main interpreter, which rules out Ray actor threads and the reward thread pools (it is
    also why ``math_verify`` runs with its own signal-based timeouts disabled). Workers are plain
    ``python -c`` subprocesses talking over an inherited socket (``_Worker``). Costs: one socket
    round trip per call (pickle prompt + response), one interpreter start + imports per worker
    (paid again after each timeout or crash, outside the timed call; figures: docs/design.md),
    and the reward function must be picklable by cloudpickle (module-level functions travel by
    reference, ``__main__`` ones and closures by value). Each worker runs one call at a time;
    ``num_workers`` bounds the concurrency of callers sharing one runner. Workers are killed on
    ``close()``, when the runner is garbage-collected, and at interpreter exit; an orphaned
    worker exits as soon as it reads EOF from its parent.
    """

    def __init__(
        self,
        fn: RewardFn,
        *,
        timeout_s: float = 5.0,
        on_error: Literal["zero", "raise"] = "zero",
        fast: bool = False,
        num_workers: int = 1,
        warmup: tuple[Prompt, str] | None = None,
        startup_timeout_s: float = 60.0,
    ):
        if on_error not in ("zero", "raise"):
            raise ValueError(f"on_error must be 'zero' or 'raise', got {on_error!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers!r}")
        self.fn = fn
        self.timeout_s = float(timeout_s)
        self.on_error = on_error
        self.fast = fast
        self._lock = threading.Lock()
        self._counts = {"calls": 0, "errors": 0, "timeouts": 0, "worker_restarts": 0}
        self._busy_s = 0.0
        self._callers = None  # threads feeding the workers (``submit``), made on first use
        self.num_workers = num_workers
        if fast:
            return
        try:  # cloudpickle: a function from the user's own script or __main__ travels by value
            import cloudpickle

            self._fn_blob = cloudpickle.dumps(fn)
        except Exception as exc:
            raise ValueError(
                f"reward function {fn!r} is not picklable ({type(exc).__name__}: {exc}); use a module-level "
                "function, or fast=True for a trusted in-process reward"
            ) from exc
        self._warmup = warmup
        self._startup_timeout_s = startup_timeout_s
        self._workers: list[_Worker] = []
        # Slots hold a live worker or None (start on demand). Callers block until a slot is free.
        self._slots: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(num_workers):
            self._slots.put(None)
        self._closed = False
        # Kill workers when the runner is garbage-collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    @classmethod
    def for_task(cls, task: Any, cfg: Any, reward_fn: Any = None, **kwargs: Any) -> "RewardRunner":
        """A runner for ``reward_fn`` (a ``UserReward``) or else ``task.reward``, configured from a
        ``TaskConfig`` (timeout, on_reward_error). A user's reward always runs isolated."""
        fast = reward_fn is None and getattr(task, "reward_is_fast", False)
        warmup = None
        if not fast and reward_fn is None:
            evals = task.eval_prompts()
            warmup = (evals[0], f"\\boxed{{{evals[0].answer}}}") if evals else None
        kwargs.setdefault("warmup", warmup)
        kwargs.setdefault("num_workers", getattr(cfg, "reward_workers", 1))
        return cls(
            reward_fn if reward_fn is not None else task.reward,
            timeout_s=cfg.reward_timeout_s,
            on_error=cfg.on_reward_error,
            fast=fast,
            **kwargs,
        )

    def __call__(self, prompt: Prompt, response: str) -> tuple[float, dict[str, Any]]:
        """Score one response: ``(reward, info)``; ``info`` is ``{}`` unless the call failed."""
        t0 = time.perf_counter()
        if self.fast:
            try:
                outcome: tuple[str, Any] = ("ok", normalize(self.fn(prompt, response)))
            except Exception as exc:
                outcome = ("error", f"{type(exc).__name__}: {exc}")
        else:
            outcome = self._call_isolated(prompt, response)
        kind, detail = outcome
        if kind == "ok" and not math.isfinite(detail[0]):
            kind, detail = "error", f"reward is not finite: {detail[0]!r}"
        with self._lock:
            self._counts["calls"] += 1
            self._busy_s += time.perf_counter() - t0
            if kind == "ok":
                score, components = detail
                return score, ({"components": components} if components else {})
            self._counts["errors"] += 1
            if kind == "timeout":
                self._counts["timeouts"] += 1
        message = f"timeout after {self.timeout_s}s" if kind == "timeout" else detail
        if self.on_error == "raise":
            raise RewardError(f"reward for prompt {prompt.prompt_id!r} failed: {message}")
        log.warning("reward for prompt %r scored 0.0: %s", prompt.prompt_id, (message.splitlines() or [''])[0])
        return 0.0, {"error": message}

    def submit(self, prompt: Prompt, response: str) -> "Future[tuple[float, dict[str, Any]]]":
        """``self(prompt, response)`` without waiting: up to ``num_workers`` calls run at once, one
        per worker process. A fast runner scores here and returns a finished future."""
        if self.fast:
            done: Future = Future()
            try:
                done.set_result(self(prompt, response))
            except BaseException as exc:  # on_error="raise": the caller's result() raises it
                done.set_exception(exc)
            return done
        with self._lock:
            if self._callers is None:
                self._callers = ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="reward")
        return self._callers.submit(self, prompt, response)

    def _call_isolated(self, prompt: Prompt, response: str) -> tuple[str, Any]:
        if self._closed:
            raise RewardError("RewardRunner is closed")
        worker = self._slots.get()
        try:
            if worker is not None and not worker.alive():  # died while idle (e.g. killed externally)
                worker.kill()
                worker = None
                with self._lock:
                    self._counts["worker_restarts"] += 1
            if worker is None:
                worker = self._start_worker()
            outcome = worker.call((prompt, response), self.timeout_s)
            if outcome[0] in ("timeout", "died"):
                worker.kill()  # a hung worker cannot be trusted again; replace it on the next call
                worker = None
                with self._lock:
                    self._counts["worker_restarts"] += 1
            return outcome
        finally:
            self._slots.put(worker)

    def _start_worker(self) -> _Worker:
        worker = _Worker(self._fn_blob, self._warmup, self._startup_timeout_s)
        with self._lock:
            self._workers[:] = [w for w in self._workers if w.alive()] + [worker]
        return worker

    def metrics(self) -> dict[str, float]:
        """Counters since construction, namespaced ``reward/...`` (``mean_call_ms`` includes worker starts)."""
        with self._lock:
            calls = self._counts["calls"]
            out = {f"reward/{k}": float(v) for k, v in self._counts.items()}
            out["reward/mean_call_ms"] = 1000.0 * self._busy_s / calls if calls else 0.0
        return out

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self.fast or self._closed:
            return
        self._closed = True
        if self._callers is not None:
            self._callers.shutdown(wait=False, cancel_futures=True)
        self._finalizer()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
