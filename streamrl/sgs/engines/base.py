"""The generation-engine interface every backend implements, and the factory that picks one.

An engine turns ``GenRequest`` records into ``Completion`` records with real token-by-token
generation on one model replica. It is the innermost layer of the Stream Generation Service:

    caller (instance actor / test)                 engine                        caller
    ------------------------------                 ------                        ------
    add_request(GenRequest) ──► admission queue (priority order) ──► running batch
                                                                          │ finishes
    get_completions(timeout) ◄──────────── finished queue ◄───────────────┘
    update_weights(state_dict, v): pause the running batch → copy in place → resume

Contract (what callers may rely on, whatever the backend):

* ``add_request`` never blocks on generation; it is callable while other requests run.
* A request leaves the admission queue in ``GenRequest.priority`` order (larger first; ties
  FIFO) whenever the running batch has room: this is the in-instance LPT order.
* ``get_completions`` returns each request as soon as it finishes, not in submission order.
  It blocks up to ``timeout`` for at least one; it returns ``[]`` on timeout, and returns
  ``[]`` at once when nothing is pending or finished (so a caller can never hang on an idle
  engine).
* Every ``Completion`` carries ``version_start`` (policy version installed when the engine
  admitted it) and ``version_end`` (installed when its last token was sampled); they differ
  exactly when an ``update_weights`` happened while it was generating. ``logprobs`` holds the
  log-probability of each sampled token under the distribution it was sampled from
  (temperature and top-p applied), one per output token; the trainer uses them as the
  old-policy log-probs.
* Each request is returned at most once; a cancelled request is never returned.
* Engine failures raise (``EngineError``) from ``get_completions`` with the offending request;
  nothing is silently dropped.

Backends register here by name; ``make_engine`` imports a backend only when asked for, so
importing this module pulls in no model library.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from streamrl.types import Completion, GenRequest, Partial

if TYPE_CHECKING:  # torch is only needed by callers that pass weights
    import torch

# name -> "module:Class"; the module is imported lazily by make_engine.
ENGINES: dict[str, str] = {
    "transformers": "streamrl.sgs.engines.transformers_cb:TransformersCBEngine",
    "vllm": "streamrl.sgs.engines.vllm_engine:VLLMEngine",  # needs vllm (`make test-vllm` venv); model = checkpoint dir
}


class EngineError(RuntimeError):
    """A request failed inside the engine, or the engine's generation loop died."""


class QueueBookkeeping:
    """``version``, ``num_pending`` and ``stats`` of an engine that keeps its requests in
    ``_waiting_ids`` (admitted by us, not yet in the engine), ``_inflight`` (in the engine) and
    ``_done`` (finished, not yet collected), its counters in ``_stats``, all under ``_lock``;
    ``_busy_since`` is when the engine last went busy (None while idle)."""

    @property
    def version(self) -> int:
        return self._version

    def num_pending(self) -> int:
        with self._lock:
            return len(self._waiting_ids) + len(self._inflight) + len(self._done)

    def stats(self) -> dict[str, float]:
        import time

        with self._lock:
            s = dict(self._stats)
            if self._busy_since is not None:
                s["gen/busy_s"] += time.perf_counter() - self._busy_since
            s["gen/waiting"] = float(len(self._waiting_ids))
            s["gen/running"] = float(len(self._inflight))
            s["gen/tokens_per_s"] = s["gen/tokens"] / s["gen/busy_s"] if s["gen/busy_s"] > 0 else 0.0
            s["gen/version"] = float(self._version)
            return s


class GenerationEngine(ABC):
    """One model replica generating many requests at once (continuous batching)."""

    @abstractmethod
    def add_request(self, req: GenRequest) -> None:
        """Queue ``req`` for generation. Raises ``ValueError`` for a malformed request or a
        duplicate ``request_id`` and ``EngineError`` after ``shutdown``."""

    @abstractmethod
    def get_completions(self, timeout: float | None = None, max_items: int | None = None) -> list[Completion]:
        """Finished requests, oldest-finished first: blocks up to ``timeout`` seconds (``None`` =
        until one finishes) for at least one, returns at most ``max_items``."""

    @abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Drop a queued or running request. True if it was pending (it will never be returned);
        False if unknown or already finished."""

    @abstractmethod
    def update_weights(self, state_dict: dict[str, "torch.Tensor"], version: int) -> None:
        """Install new weights in place and set ``version``. In-flight requests keep their
        KV cache and continue with the new weights. Returns once the new weights are live."""

    @abstractmethod
    def num_pending(self) -> int:
        """Requests added but not yet returned by ``get_completions`` (queued + running +
        finished-but-unread)."""

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """Counters since construction, namespaced ``gen/...`` (tokens, busy seconds, ...)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop generating and release the model. Idempotent. Pending requests are dropped."""

    @property
    @abstractmethod
    def version(self) -> int:
        """The policy version currently installed."""

    # Optional: progress and preemption, for runtime rebalancing of running requests.
    supports_preempt = False

    def progress(self) -> dict[str, int]:
        """Tokens generated so far by each started, unfinished request (by ``request_id``);
        requests still queued in the engine are left out. Empty where the backend cannot tell."""
        return {}

    def waiting_ids(self) -> list[str]:
        """Requests queued in the engine that have not started."""
        return []

    def preempt(self, request_id: str, running: bool = True) -> Partial | None:
        """Stop ``request_id`` and return what it generated so far (empty outputs if it had not
        started), so it can resume elsewhere; it is then never returned by this engine. None if
        it is unknown, finished, about to finish, or started while ``running`` is False (it is
        then returned as usual)."""
        raise NotImplementedError(f"{type(self).__name__} cannot preempt requests")

    def __enter__(self) -> "GenerationEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def make_engine(name: str, model: Any, **kwargs: Any) -> GenerationEngine:
    """Build the engine registered as ``name`` around an already loaded ``model``.

    ``kwargs`` go to the backend's constructor (sampling and batching settings)."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known engines: {sorted(ENGINES)}")
    module_name, cls_name = ENGINES[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(model, **kwargs)
