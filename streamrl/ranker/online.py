"""The ranker as the live system uses it: scored ahead, refreshed in the background (PAPER.md §3.6).

The SGS owns one ``OnlineRanker`` in the driver process. The dataset is scored once before RL
(``register``), dispatch reads a table (``predict``: a dict lookup per request, no model call),
and each generation batch is queued (``observe``) for a background thread that updates the
ranker and swaps a new table in under a lock (the calls and their order: ``OnlineRanker``).
Invariants: dispatch never waits for training or scoring (a batch submitted while a refresh runs
uses the previous table, one iteration old); only registered prompts are learned from; a failure
in the refresh thread is kept and re-raised by the next ``predict``/``observe``/``wait``, so a
broken ranker fails the run loudly instead of silently dispatching on stale scores. The thread
uses the driver's CPU: on a 2-core machine that CPU is shared with the instances and the trainer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from streamrl.ranker.base import Ranker
from streamrl.ranker.metrics import rank_metrics

if TYPE_CHECKING:
    from streamrl.config import Config

log = logging.getLogger(__name__)


class OnlineRanker:
    """Predicted output lengths by prompt key, kept in a table that a background thread refreshes::

        register(keys, texts)  once, before RL: the whole dataset is scored now, off the critical
                               path; the scores go in ``_table`` (key -> predicted length)
        predict(keys)          at dispatch: a dict lookup per request (no model call)
        observe(keys, lengths[, traces])
                               after each generation batch: queued for the refresh thread;
                               returns at once
        refresh thread         fit (first batch) or update the ranker with the batch, re-score
                               every registered prompt, swap the new table in under ``_lock``

    Rankers that score with the current policy (``reweighted``: ``set_policy``, ``rescore_all =
    False``) take two more calls, queued to the same thread in call order::

        set_policy(load, version)  the SGS installed new weights: ``load()`` returns their state
                                   dict (the thread fetches it, so the caller never waits)
        prefetch(keys)             score the *next* batch's prompts now, under the newest
                                   installed policy, so its dispatch is again a table lookup

    For them a refresh does not re-score the dataset (a forward pass per remembered response):
    it drops the observed prompts from the table, and ``prefetch`` (or, on a miss, ``predict``
    itself) scores what a batch needs. An observed prompt that the last ``prefetch`` also asked
    for (the same prompt at the end of one epoch and the start of the next) is scored again at
    once, in the thread, with its new history, so the next dispatch still finds it in the table.

    Lengths of unregistered prompts (e.g. held-out evaluation prompts) are skipped and counted
    (``rank/unregistered_skipped``): the ranker reads a prompt's text to learn from it.
    """

    def __init__(self, ranker: Ranker, default_length: float = 1.0, refresh: bool = True) -> None:
        if not default_length > 0:
            raise ValueError(f"default_length={default_length!r} must be > 0")
        self.ranker = ranker
        self.default_length = float(default_length)
        self.refresh_enabled = refresh
        # False for rankers whose scores cost a policy forward pass per remembered response
        # (``reweighted``): the table then holds only what was prefetched or asked for.
        self._rescore_all = ranker.rescore_all
        self._lock = threading.Lock()
        self._texts: dict[str, str] = {}
        self._table: dict[str, float] = {}
        self._ahead: set[str] = set()  # the last prefetch's keys: the next batch
        self._fitted = False
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._busy = 0
        self._error: BaseException | None = None
        self._closed = False
        self._history: list[tuple[list[str], list[float]]] = []  # every observed batch (keys, lengths): checkpointed
        self.counters = {"rank/refreshes": 0, "rank/refresh_s": 0.0, "rank/unknown": 0, "rank/scored_on_demand": 0,
                         "rank/unregistered_skipped": 0}
        self._thread = threading.Thread(target=self._loop, name="ranker-refresh", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ set-up
    def fit(self, keys: Sequence[str], texts: Sequence[str], lengths: Sequence[float]) -> None:
        """Fit on earlier (prompt, length) records now (blocking) and re-score registered prompts."""
        self.ranker.fit(list(texts), list(lengths), [str(k) for k in keys])
        with self._lock:
            self._fitted = True
            for k, t in zip(keys, texts):
                self._texts.setdefault(str(k), t)
            self._table.clear()
        if self._rescore_all:
            self._rescore()

    def register(self, keys: Sequence[str], texts: Sequence[str]) -> None:
        """Remember the prompts' texts and score them ahead of time (if the ranker is fitted)."""
        keys = [str(k) for k in keys]
        if len(keys) != len(texts):
            raise ValueError(f"register: {len(keys)} keys but {len(texts)} texts")
        with self._lock:
            self._texts.update(zip(keys, texts))
            fitted = self._fitted
        if fitted and self._rescore_all:
            scores = self.ranker.score(list(texts), keys)
            with self._lock:
                self._table.update(zip(keys, scores.tolist()))

    # ------------------------------------------------------------------------------ hot path
    def predict(self, keys: Sequence[str]) -> np.ndarray:
        """Predicted length per key (a table lookup).

        Before the first refresh (and with no ``fit`` records) every prompt gets
        ``default_length``: dispatch then sees equal predictions (Algorithm 2 degenerates to
        balancing request counts). A registered prompt missing from the table (registered after
        a refresh, or not prefetched) is scored now; a key that was never registered gets
        ``default_length`` and is counted (``rank/unknown``)."""
        self._raise_if_failed()
        keys = [str(k) for k in keys]
        with self._lock:
            if not self._fitted:
                return np.full(len(keys), self.default_length)
            out = np.array([self._table.get(k, np.nan) for k in keys], dtype=np.float64)
            missing = [i for i in np.flatnonzero(np.isnan(out)) if keys[i] in self._texts]
            texts = [self._texts[keys[i]] for i in missing]
        if missing:
            scores = self.ranker.score(texts, [keys[i] for i in missing])
            out[missing] = scores
            with self._lock:
                self._table.update(zip((keys[i] for i in missing), scores.tolist()))
                self.counters["rank/scored_on_demand"] += len(missing)
        unknown = np.isnan(out)
        if unknown.any():
            with self._lock:
                self.counters["rank/unknown"] += int(unknown.sum())
            out[unknown] = self.default_length
        return out

    def observe(self, keys: Sequence[str], lengths: Sequence[float], traces: Sequence | None = None) -> None:
        """Queue one batch of finished generations for the background refresh; returns at once.

        ``traces`` (one per length) go to rankers that read responses (``uses_traces``)."""
        self._raise_if_failed()
        keys = [str(k) for k in keys]
        lens = [float(x) for x in lengths]
        if len(keys) != len(lens):
            raise ValueError(f"observe: {len(keys)} keys but {len(lens)} lengths")
        bad = [(k, x) for k, x in zip(keys, lens) if not 0 <= x < float("inf")]
        if bad:
            raise ValueError(f"observe: lengths must be finite and >= 0, got (key, length) {bad[:5]}")
        if traces is not None and len(traces) != len(keys):
            raise ValueError(f"observe: {len(keys)} keys but {len(traces)} traces")
        if not self.refresh_enabled:
            return
        with self._lock:
            known = [i for i, k in enumerate(keys) if k in self._texts]
            self.counters["rank/unregistered_skipped"] += len(keys) - len(known)
            if not known:
                return
            self._history.append(([keys[i] for i in known], [lens[i] for i in known]))
        use_traces = traces is not None and self.ranker.uses_traces
        self._put(("observe", [keys[i] for i in known], [lens[i] for i in known],
                   [traces[i] for i in known] if use_traces else None))

    def history_state(self) -> dict:
        """Every batch of (key, length) observed so far: what a checkpoint keeps so that a resumed
        run's ranker has seen what the stopped run's had, batch by batch."""
        with self._lock:
            return {"batches": [[list(k), list(v)] for k, v in self._history]}

    def restore(self, state: dict | None) -> None:
        """Observe a checkpoint's batches again, in order (lengths only: no traces), and wait."""
        for keys, lengths in (state or {}).get("batches", []):
            self.observe(keys, lengths)
        self.wait()

    def set_policy(self, load, version: int) -> None:
        """Queue installing policy ``version`` (``load()`` gives its state dict); a no-op for text rankers."""
        if self.ranker.scores_with_policy:
            self._raise_if_failed()
            self._put(("policy", load, int(version)))

    def prefetch(self, keys: Sequence[str]) -> None:
        """Queue scoring ``keys`` (the next batch) ahead of their dispatch; a no-op when the table is complete."""
        self._raise_if_failed()
        if self._rescore_all:
            return
        with self._lock:
            keys = [str(k) for k in keys if str(k) in self._texts]
        if keys:
            self._put(("prefetch", keys))

    def _put(self, item: tuple) -> None:
        with self._lock:
            self._busy += 1
        self._queue.put(item)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every observed batch is folded in (tests, benches); False on timeout."""
        with self._idle:
            ok = self._idle.wait_for(lambda: self._busy == 0 or self._error is not None, timeout=timeout)
        self._raise_if_failed()
        return ok

    # ------------------------------------------------------------------------------ thread
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if item[0] == "observe":
                    self._refresh(*item[1:])
                elif item[0] == "policy":
                    _, load, version = item
                    self.ranker.set_policy(load(), version)
                    with self._lock:
                        self.counters["rank/policy_version"] = version
                else:
                    self._score_ahead(item[1])
            except BaseException as exc:  # noqa: BLE001 - kept and re-raised on the caller's thread
                log.error("ranker refresh failed: %r", exc)
                with self._lock:
                    self._error = exc
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def _refresh(self, keys: list[str], lens: list[float], traces: list | None) -> None:
        t0 = time.perf_counter()
        with self._lock:
            texts = [self._texts[k] for k in keys]
            fitted = self._fitted
        extra = {} if traces is None else {"traces": traces}
        if fitted:
            self.ranker.update(texts, lens, keys, **extra)
        else:
            self.ranker.fit(texts, lens, keys, **extra)
            with self._lock:
                self._fitted = True
        if self._rescore_all:
            self._rescore()
        else:
            with self._lock:
                for k in keys:
                    self._table.pop(k, None)
                again = [k for k in dict.fromkeys(keys) if k in self._ahead]
            if again:
                self._fill(again)
                with self._lock:
                    self.counters["rank/rescored_ahead"] = self.counters.get("rank/rescored_ahead", 0) + len(again)
        with self._lock:
            self.counters["rank/refreshes"] += 1
            self.counters["rank/refresh_s"] = time.perf_counter() - t0

    def _fill(self, keys: list[str]) -> None:
        """Score ``keys`` now and put them in the table."""
        with self._lock:
            texts = [self._texts[k] for k in keys]
        scores = self.ranker.score(texts, keys)
        with self._lock:
            self._table.update(zip(keys, scores.tolist()))

    def _score_ahead(self, keys: list[str]) -> None:
        with self._lock:
            if not self._fitted:
                return
            self._ahead = set(keys)
        t0 = time.perf_counter()
        self._fill(keys)
        with self._lock:
            self.counters["rank/prefetched"] = self.counters.get("rank/prefetched", 0) + len(keys)
            self.counters["rank/prefetch_s"] = time.perf_counter() - t0

    def _rescore(self) -> None:
        """Score every registered prompt with the current ranker and swap the table in."""
        with self._lock:
            keys = list(self._texts)
            texts = [self._texts[k] for k in keys]
        scores = self.ranker.score(texts, keys) if keys else np.zeros(0)
        with self._lock:
            self._table = dict(zip(keys, scores.tolist()))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the ranker's background refresh failed: {self._error!r}") from self._error

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout=30)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counters)


def batch_rank_metrics(predicted: Sequence[float], actual: Sequence[float], prefix: str = "rank/") -> dict[str, float]:
    """Recall of the true longest 20/10/5% and Spearman of one batch's predictions (namespaced).

    Spearman is NaN when the predictions (or the lengths) are all equal, e.g. before the first fit.
    """
    if len(predicted) != len(actual):
        raise ValueError(f"{len(predicted)} predictions but {len(actual)} actual lengths")
    if len(actual) < 2:
        return {}
    return {f"{prefix}{k}": v for k, v in rank_metrics(actual, predicted).items()}


def state_dict_of(handle) -> dict:
    """The weights behind a ``WeightHandle`` as owned tensors (for the driver's ranker)."""
    from streamrl.weights.flat import unflatten
    from streamrl.weights.transfer import RayObjectStoreTransport

    return unflatten(RayObjectStoreTransport().fetch(handle), copy=True)


def make_online_ranker(cfg: "Config") -> "OnlineRanker | None":
    """The configured ranker wrapped for online use, fitted on ``ranker.fit_file`` if given; None for ``none``."""
    r = cfg.ranker
    if r.name == "none":
        return None
    from streamrl.ranker.base import make_ranker

    ranker = make_ranker(r.name, policy_path=cfg.policy.path, temperature=cfg.generation.temperature, **r.kwargs)
    online = OnlineRanker(ranker, default_length=max(1.0, cfg.generation.max_new_tokens / 2),
                          refresh=r.refresh)
    if r.fit_file:
        from streamrl.ranker.records import load_samples_jsonl

        recs = load_samples_jsonl(r.fit_file)
        online.fit([x.key for x in recs], [x.text for x in recs], [x.length for x in recs])
    return online
