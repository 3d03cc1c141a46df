"""The generation-engine interface every backend implements, and the factory that picks one.

An engine turns ``GenRequest`` records into ``Completion`` records with real token-by-token
generation on one model replica: the innermost layer of the Stream Generation Service.
``GenerationEngine`` states the contract every backend keeps (non-blocking ``add_request``,
admission in priority order, completions as they finish, exact version stamps, each request
returned at most once, failures raised as ``EngineError``); ``QueueBookkeeping`` is the request
bookkeeping both backends share; ``tests/sgs/test_engine_conformance.py`` checks every backend.

Backends register in ``ENGINES`` by name; ``make_engine`` imports a backend only when asked for,
so importing this module pulls in no model library.
"""

from __future__ import annotations

import heapq
import importlib
import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
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


def check_arg(ok: bool, name: str, value: Any, expected: str) -> None:
    """Raise ``ValueError`` naming the constructor argument and its bad value unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}={value!r}: expected {expected}")


def check_engine_args(temperature: float, top_p: float, max_requests_per_batch: int, max_inflight: int | None,
                      **positive_ints: int) -> int:
    """The constructor checks both backends share; returns ``max_inflight`` (default: the batch)."""
    check_arg(temperature >= 0, "temperature", temperature, ">= 0 (0 = greedy)")
    check_arg(0 < top_p <= 1, "top_p", top_p, "in (0, 1]")
    for name, value in {"max_requests_per_batch": max_requests_per_batch, **positive_ints}.items():
        check_arg(isinstance(value, int) and value >= 1, name, value, "an int >= 1")
    max_inflight = max_requests_per_batch if max_inflight is None else max_inflight
    check_arg(isinstance(max_inflight, int) and max_inflight >= 1, "max_inflight", max_inflight, "an int >= 1")
    return max_inflight


def eos_ids(eos_token_id: int | list[int] | None, vocab_size: int) -> list[int]:
    """``eos_token_id`` as a list, each id checked against the vocabulary."""
    ids = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    for e in ids:
        check_arg(0 <= e < vocab_size, "eos_token_id", eos_token_id, f"within the vocabulary [0, {vocab_size})")
    return ids


def check_update_shapes(state_dict: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """``update_weights``: every incoming name must be the model's, with the model's shape."""
    unknown = sorted(set(state_dict) - set(shapes))
    if unknown:
        raise KeyError(f"update_weights: {len(unknown)} unknown tensor names, e.g. {unknown[:5]}")
    bad = [(k, tuple(v.shape), tuple(shapes[k])) for k, v in state_dict.items() if tuple(v.shape) != tuple(shapes[k])]
    if bad:
        raise ValueError(f"update_weights: shape mismatch (name, got, expected): {bad[:5]}")


class QueueBookkeeping:
    """The request bookkeeping both backends share: our priority heap in front of the backend,
    the finished queue, cancellation, failure and the counters.

    State, all under ``_lock`` (``_done_cv`` is a condition on it):

    * ``_waiting``: heap of ``(-priority, seq, t_added, req)``; ``_waiting_ids`` maps a request
      to the ``seq`` of its live entry (a cancelled or preempted one leaves a stale entry behind).
    * ``_inflight``: backend id -> the backend's entry (its first item is the ``GenRequest``);
      ``_engine_id_of``: ``request_id`` -> backend id (``"<request_id>#<seq>"``, unique even when
      a cancelled ``request_id`` is reused).
    * ``_done``: finished ``Completion`` records not yet collected; ``_error``: the failure every
      caller hears about; ``_closed``; ``_stats`` (``gen/...``); ``_busy_since``: when the engine
      last went busy (None while idle).

    A backend sets ``_vocab_size``, ``_max_seq_tokens``, ``_max_inflight`` and ``instance``,
    calls ``_init_queues`` and implements ``_start_locked`` (hand one admitted request to the
    backend) and ``_abort_locked`` (stop one it holds)."""

    _seq_limit = "the KV cache"
    """What bounds prompt + max_new_tokens, for ``add_request``'s message."""

    def _init_queues(self, initial_version: int, extra_stats: tuple[str, ...] = ()) -> None:
        self._lock = threading.Lock()
        self._done_cv = threading.Condition(self._lock)
        self._seq = itertools.count()
        self._waiting: list[tuple[float, int, float, GenRequest]] = []
        self._waiting_ids: dict[str, int] = {}
        self._inflight: dict[str, Any] = {}
        self._engine_id_of: dict[str, str] = {}
        self._done: deque[Completion] = deque()
        self._error: EngineError | None = None
        self._closed = False
        self._version = initial_version
        self._stats = dict.fromkeys(
            ["gen/tokens", "gen/requests_finished", "gen/requests_cancelled", "gen/busy_s", "gen/queue_wait_s",
             "gen/weight_updates", "gen/weight_update_s", "gen/pause_wait_s", *extra_stats], 0.0)
        self._busy_since: float | None = None

    # ------------------------------------------------------------------ hooks
    def _start_locked(self, engine_id: str, req: GenRequest) -> None:
        """Put ``req`` in ``_inflight[engine_id]`` and hand it to the backend (caller holds _lock)."""
        raise NotImplementedError

    def _abort_locked(self, engine_id: str) -> None:
        """Stop a request already removed from ``_inflight``; a late result for it must be dropped."""
        raise NotImplementedError

    # ------------------------------------------------------------------ requests
    def add_request(self, req: GenRequest) -> None:
        prompt = req.prompt_ids
        if not prompt:
            raise ValueError(f"request {req.request_id!r}: empty prompt_ids")
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < self._vocab_size)]
        if bad:
            raise ValueError(f"request {req.request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {self._vocab_size})")
        if not (isinstance(req.max_new_tokens, int) and req.max_new_tokens >= 1):
            raise ValueError(f"request {req.request_id!r}: max_new_tokens={req.max_new_tokens!r} must be an int >= 1")
        if len(prompt) + req.max_new_tokens > self._max_seq_tokens:
            raise ValueError(f"request {req.request_id!r}: prompt ({len(prompt)}) + max_new_tokens ({req.max_new_tokens})"
                             f" exceeds {self._seq_limit}: {self._max_seq_tokens} tokens")
        with self._lock:
            self._raise_if_unusable()
            if req.request_id in self._waiting_ids or req.request_id in self._engine_id_of:
                raise ValueError(f"request_id {req.request_id!r} is already pending in this engine")
            seq = next(self._seq)
            heapq.heappush(self._waiting, (-float(req.priority), seq, time.perf_counter(), req))
            self._waiting_ids[req.request_id] = seq
            self._admit_locked()

    def _admit_locked(self) -> None:
        """Hand the backend the highest-priority waiting requests while it has free slots."""
        while self._waiting and len(self._inflight) < self._max_inflight:
            _, seq, t_added, req = heapq.heappop(self._waiting)
            if self._waiting_ids.get(req.request_id) != seq:
                continue  # cancelled or preempted while waiting (stale heap entry)
            del self._waiting_ids[req.request_id]
            now = time.perf_counter()
            self._stats["gen/queue_wait_s"] += now - t_added
            if not self._inflight:
                self._busy_since = now
            engine_id = f"{req.request_id}#{seq}"
            self._engine_id_of[req.request_id] = engine_id
            self._start_locked(engine_id, req)

    def _remove_inflight_locked(self, engine_id: str) -> Any:
        """Forget an in-flight request (finished, cancelled or preempted); returns its entry."""
        entry = self._inflight.pop(engine_id)
        del self._engine_id_of[entry[0].request_id]
        if not self._inflight and self._busy_since is not None:
            self._stats["gen/busy_s"] += time.perf_counter() - self._busy_since
            self._busy_since = None
        return entry

    def _stop_inflight_locked(self, engine_id: str, counter: str) -> Any:
        """Remove, abort in the backend, count, refill the freed slot; returns the entry."""
        entry = self._remove_inflight_locked(engine_id)
        self._abort_locked(engine_id)
        self._stats[counter] = self._stats.get(counter, 0.0) + 1
        self._admit_locked()
        return entry

    def _pop_waiting_locked(self, request_id: str) -> GenRequest | None:
        """Take a not-yet-admitted request out of the queue (its heap entry goes stale)."""
        seq = self._waiting_ids.pop(request_id, None)
        return None if seq is None else next(r for _, s, _, r in self._waiting if s == seq)

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            if request_id in self._waiting_ids:
                del self._waiting_ids[request_id]
                self._stats["gen/requests_cancelled"] += 1
                return True
            engine_id = self._engine_id_of.get(request_id)
            if engine_id is None:
                return False
            self._stop_inflight_locked(engine_id, "gen/requests_cancelled")
            return True

    def heartbeat(self) -> int:
        """A counter that grows whenever the engine makes progress on running requests (the SGS's
        liveness check reads it): tokens of the running requests, unless the backend counts steps."""
        return sum(self.progress().values())

    def waiting_ids(self) -> list[str]:
        with self._lock:
            return list(self._waiting_ids)

    # ------------------------------------------------------------------ results
    def get_completions(self, timeout: float | None = None, max_items: int | None = None) -> list[Completion]:
        if max_items is not None and max_items < 1:
            raise ValueError(f"max_items={max_items!r} must be >= 1 or None")
        with self._done_cv:
            self._done_cv.wait_for(
                lambda: self._done or self._error is not None or self._closed
                or not (self._waiting_ids or self._inflight), timeout=timeout)
            if self._error is not None and not self._done:
                raise self._error
            n = len(self._done) if max_items is None else min(max_items, len(self._done))
            return [self._done.popleft() for _ in range(n)]

    def _completion(self, req: GenRequest, tokens: tuple[int, ...], logprobs: tuple[float, ...], finish: str,
                    v_start: int, v_end: int, t_start: float, t_end: float) -> Completion:
        """The ``Completion`` of a finished request, counted; raises ``EngineError`` for a result
        that breaks the contract (no tokens, one log-prob per token, a length stop at the limit)."""
        if not tokens or len(tokens) != len(logprobs):
            raise EngineError(f"request {req.request_id!r}: {len(tokens)} tokens but {len(logprobs)} logprobs")
        if finish == "length" and len(tokens) != req.max_new_tokens:
            raise EngineError(f"request {req.request_id!r}: stopped at {len(tokens)} tokens without EOS "
                              f"(max_new_tokens={req.max_new_tokens})")
        self._stats["gen/tokens"] += len(tokens)
        self._stats["gen/requests_finished"] += 1
        return Completion(
            request_id=req.request_id, prompt_id=req.prompt_id, sample_idx=req.sample_idx,
            prompt_ids=tuple(req.prompt_ids), output_ids=tokens, logprobs=logprobs, finish_reason=finish,
            version_start=v_start, version_end=v_end, t_start=t_start, t_end=t_end, instance=self.instance,
        )

    # ------------------------------------------------------------------ failure and shutdown
    def _fail(self, error: EngineError) -> None:
        with self._done_cv:
            self._error = error
            self._done_cv.notify_all()

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise EngineError(f"engine {self.instance!r} is shut down")
        if self._error is not None:
            raise self._error

    def _check_version(self, version: int) -> None:
        if version < self._version:
            raise ValueError(f"update_weights: version {version} is older than the installed {self._version}")

    def _close(self) -> bool:
        """Mark the engine shut down and drop the queued requests; False if it already was."""
        with self._done_cv:
            if self._closed:
                return False
            self._closed = True
            self._waiting.clear()
            self._waiting_ids.clear()
            self._done_cv.notify_all()
            return True

    # ------------------------------------------------------------------ reads
    @property
    def version(self) -> int:
        return self._version

    def num_pending(self) -> int:
        with self._lock:
            return len(self._waiting_ids) + len(self._inflight) + len(self._done)

    def stats(self) -> dict[str, float]:
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
    """One model replica generating many requests at once (continuous batching)::

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
    * Engine failures raise (``EngineError``) from ``get_completions`` with the offending
      request; nothing is silently dropped."""

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

    def update_adapter(self, adapter: dict[str, "torch.Tensor"], scaling: float, version: int) -> None:
        """Install a LoRA adapter (``models.lora.adapter_tensors``: ``<module>.lora_A``/``.lora_B``)
        in place of the one this engine holds, as ``version``; the base weights stay."""
        raise NotImplementedError(f"{type(self).__name__} cannot apply LoRA adapters")

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

    # Capabilities, declared here so callers never probe with getattr/hasattr.
    supports_preempt: bool = False
    """Whether ``preempt`` can stop a running request and hand back its prefix."""
    _max_inflight: int | None = None

    @property
    def max_inflight(self) -> int | None:
        """Requests the engine runs at once (its batch); None where the backend does not say."""
        return self._max_inflight

    def progress(self) -> dict[str, int]:
        """Tokens generated so far by each started, unfinished request (by ``request_id``);
        requests still queued in the engine are left out. Empty where the backend cannot tell."""
        return {}

    def waiting_ids(self) -> list[str]:
        """Requests queued in the engine that have not started."""
        return []

    def stall(self) -> None:
        """Fault injection: stop stepping for good while every call keeps answering (a hung
        engine behind a live process). Tests and ``bench faults`` use it; nothing else should."""
        raise NotImplementedError(f"{type(self).__name__} cannot be stalled")

    def slow_down(self, seconds: float) -> None:
        """Fault injection: stop stepping for ``seconds``, then go on (a straggler); returns at once."""
        raise NotImplementedError(f"{type(self).__name__} cannot be slowed down")

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
