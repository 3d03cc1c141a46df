"""History reweighted to the current policy: an off-policy estimate of each prompt's mean length.

The history ranker (``history.py``) predicts from what the policy did with a prompt in earlier
epochs, but during RL that history is an epoch old and the policy has moved. This ranker keeps
the earlier *responses*, not only their lengths, and asks the current policy, teacher-forced,
how likely each one is now. Estimators (``ReweightedHistoryRanker``): ``tree`` (the default: the
policy's exact probabilities over the trie of remembered responses, ``_tree``), ``sequence``
(self-normalised importance sampling), ``per_decision`` and ``hazard``. Invariants: only the
order of the estimates matters; a prompt with no earlier response gets the prior's score (or the
median of recent lengths); an estimate is cached until the policy or the prompt's history
changes; new weights are built aside and swapped in under the lock. Live use: ``ranker.online``.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from streamrl.ranker.base import Ranker, check_samples

ESTIMATORS = ("sequence", "per_decision", "hazard", "tree")


@dataclass(frozen=True)
class Trace:
    """One generated response as this ranker remembers it."""

    output_ids: tuple[int, ...]
    """The response's tokens as generated (EOS included when generation stopped on it)."""
    logprob: float
    """Sum of the sampled tokens' log-probabilities under the policy that generated them."""
    token_logprobs: tuple[float, ...] | None = None
    """The same log-probabilities token by token (one per ``output_ids``), for the per-decision
    estimator; None where only the sum is known (that trace's weight then applies as a whole)."""

    def __post_init__(self) -> None:
        if self.token_logprobs is not None and len(self.token_logprobs) != len(self.output_ids):
            raise ValueError(f"Trace: {len(self.token_logprobs)} token log-probs for {len(self.output_ids)} tokens")


class ReweightedHistoryRanker(Ranker):
    """Per-prompt mean of earlier lengths, importance-weighted to the installed policy.

    ``sequence``, per prompt k with earlier responses y_1..y_m, lengths L_j, behaviour log-probs
    b_j and current policy pi::

        d_j = log pi(y_j | k) - b_j                      one teacher-forced forward pass
        w_j = exp(beta * d_j) / sum_i exp(beta * d_i)    beta < 1 tempers the weights
        est(k) = sum_j w_j L_j                           self-normalised importance sampling

    ``per_decision``: ``E[L] = sum_t P(L > t)``, each ``P(L > t)`` weighted by the ratio over the
    first t + 1 tokens only (``_per_decision``). ``hazard``: the same curve as a product of
    weighted stopping chances among the responses still running, a weighted Kaplan-Meier
    (``_hazard``). Both use per-token behaviour log-probs and reduce to the plain mean with equal
    ratios. ``tree`` needs no behaviour log-probs and no weights (``_tree``): where the policy now
    follows a remembered response closely, the estimate follows that response's length however
    few old samples took it; self-normalised weights cannot, since they only re-share weight
    among the samples drawn. Identical responses are one path: one forward pass per distinct
    response.

    Cost and freshness: ``set_policy`` installs new weights; each prompt's estimate is cached
    until the policy or its history changes. The live system (``OnlineRanker``) installs each
    version the SGS receives and scores the *next* batch in its background thread
    (``prefetch``), so dispatch reads a table and a batch is scored under the policy one version
    older than the one that generates it. On a GPU cluster the same forward pass is a prefill of
    the remembered responses; here it runs in the driver process. Memory: ``max_samples``
    responses (token ids) per prompt seen. Measured recall: docs/results.md.

    Args:
        model_path: the policy checkpoint (``streamrl.models.tiny.load_policy`` format) whose
            architecture and tokenizer the ranker uses; its weights are the policy until
            ``set_policy`` installs newer ones. The SGS passes the run's ``policy.path``.
        beta: temper of the importance weights, in [0, 1]; 0 is the plain mean of the history.
        max_samples: responses remembered per prompt (the most recent).
        prior: ranker name scoring prompts without history (``learned``, ``lm``, or None for the
            median of the recent lengths); ``prior_kwargs`` are its arguments.
        batch_tokens: token budget of one forward batch.
        median_window: recent lengths kept for the median fallback.
        temperature: the sampling temperature (the engine's log-probs are under
            ``softmax(logits / T)``, and so are the current policy's here); the SGS passes the run's.
        estimator: ``tree`` (the current policy's probabilities over the trie of remembered
            responses; the default), ``sequence`` (one importance weight per response),
            ``per_decision`` or ``hazard`` (the survival curve, each step weighted by the tokens
            that decide it); all above. ``beta`` applies to the three weighted ones.
    """

    name = "reweighted"
    needs_policy = True
    uses_traces = True
    scores_with_policy = True
    rescore_all = False  # scoring costs a forward pass per remembered response: score what is asked

    def __init__(self, model_path: str | None = None, beta: float = 0.5, max_samples: int = 16,
                 prior: str | None = "learned", prior_kwargs: dict | None = None, batch_tokens: int = 32768,
                 median_window: int = 4096, temperature: float = 1.0, estimator: str = "tree"):
        if model_path is None:
            raise ValueError("ranker 'reweighted' needs model_path: the policy checkpoint directory "
                             "(the run's policy.path)")
        if not temperature > 0:
            raise ValueError(f"ranker 'reweighted': temperature must be > 0, got {temperature}")
        if estimator not in ESTIMATORS:
            raise ValueError(f"ranker 'reweighted': estimator must be one of {ESTIMATORS}, got {estimator!r}")
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"ranker 'reweighted': beta must be in [0, 1], got {beta}")
        for name, v in (("max_samples", max_samples), ("batch_tokens", batch_tokens), ("median_window", median_window)):
            if int(v) < 1:
                raise ValueError(f"ranker 'reweighted': {name} must be >= 1, got {v}")
        from streamrl.models.tiny import load_policy
        from streamrl.ranker.base import make_ranker

        self.model_path = str(model_path)
        self._model, self._tok = load_policy(model_path)
        self._model.eval()
        self.beta, self.max_samples, self.batch_tokens = float(beta), int(max_samples), int(batch_tokens)
        self.temperature = float(temperature)
        self.estimator = estimator
        self.prior = None if prior is None else make_ranker(prior, policy_path=model_path, **(prior_kwargs or {}))
        self._lock = threading.Lock()
        self._hist: dict[str, deque[tuple[Trace | None, float]]] = {}
        self._prompt_ids: dict[str, list[int]] = {}
        self._changed: dict[str, int] = {}  # key -> history generation (bumped on every new sample)
        self._cache: dict[str, tuple[int, int, float]] = {}  # key -> (policy version, history gen, estimate)
        self._recent: deque[float] = deque(maxlen=int(median_window))
        self.version = -1  # the installed policy's version; -1 = the weights at model_path
        self.counters = {"forward_responses": 0, "cache_hits": 0, "misaligned_traces": 0}

    # -- traces ------------------------------------------------------------------------------
    def trace_of(self, response: str | None, finish_reason: str, logprob: float,
                 token_logprobs: Sequence[float] | None = None, output_ids: Sequence[int] | None = None) -> Trace:
        """The ``Trace`` of a logged response (rollout log row: ``response``, ``finish_reason``,
        ``logprob``, ``logprobs``, ``output_ids``).

        The logged ids are used when the row has them. An older log has only the text, which
        does not always encode back to the generated ids (a special token sampled mid-response
        is dropped from the text); per-token log-probs that then do not line up with the
        re-encoded tokens would weigh the wrong prefixes, so that trace keeps only its sum
        (counted in ``counters["misaligned_traces"]``)."""
        lps = None if token_logprobs is None else tuple(map(float, token_logprobs))
        if output_ids is not None:
            return Trace(tuple(int(t) for t in output_ids), float(logprob), lps)
        if response is None:
            raise ValueError("trace_of needs the response text or its output_ids")
        ids = self._tok.encode(response, add_special_tokens=False)
        if finish_reason == "stop":
            ids.append(self._tok.eos_token_id)
        if lps is not None and len(lps) != len(ids):
            self.counters["misaligned_traces"] += 1
            lps = None
        return Trace(tuple(ids), float(logprob), lps)

    def _prompt(self, key: str, text: str) -> list[int]:
        """The prompt's token ids as the request builder sends them to the engine."""
        from streamrl.models.tiny import encode_prompt

        if key not in self._prompt_ids:
            self._prompt_ids[key] = encode_prompt(self._tok, text)
        return self._prompt_ids[key]

    def _ingest(self, texts: list[str], lens: np.ndarray, keys: list[str], traces) -> None:
        if traces is not None and len(traces) != len(keys):
            raise ValueError(f"traces and texts differ in length: {len(traces)} vs {len(keys)}")
        with self._lock:
            for i, (t, n, k) in enumerate(zip(texts, lens.tolist(), keys)):
                self._prompt(k, t)
                self._hist.setdefault(k, deque(maxlen=self.max_samples)).append(
                    (None if traces is None else traces[i], float(n)))
                self._changed[k] = self._changed.get(k, 0) + 1
            self._recent.extend(lens.tolist())

    # -- Ranker ------------------------------------------------------------------------------
    def fit(self, texts, lengths, keys=None, traces: Sequence[Trace | None] | None = None) -> "ReweightedHistoryRanker":
        texts, lens, keys = check_samples(texts, lengths, keys)
        if self.prior is not None:
            self.prior.fit(texts, lens, keys)
        with self._lock:
            self._hist.clear()
            self._changed.clear()
            self._cache.clear()
            self._recent.clear()
        self._ingest(texts, lens, keys, traces)
        return self

    def update(self, texts, lengths, keys=None, traces: Sequence[Trace | None] | None = None) -> None:
        texts, lens, keys = check_samples(texts, lengths, keys)
        if self.prior is not None:
            self.prior.update(texts, lens, keys)
        self._ingest(texts, lens, keys, traces)

    @property
    def model(self):
        """The installed policy that scores (read-only: ``set_policy`` replaces it)."""
        with self._lock:
            return self._model

    @property
    def tokenizer(self):
        """The tokenizer of the checkpoint at ``model_path`` (prompts and responses are encoded with it)."""
        return self._tok

    def set_policy(self, weights: Mapping | str, version: int) -> None:
        """Install the policy that scores from now on: a state dict, or a checkpoint directory."""
        import copy

        from streamrl.models.tiny import load_policy

        if isinstance(weights, (str, bytes)) or hasattr(weights, "__fspath__"):
            model, _ = load_policy(weights)
        else:
            with self._lock:
                model = copy.deepcopy(self._model)
            model.load_state_dict(weights)
        model.eval()
        with self._lock:
            self._model, self.version = model, int(version)

    def score(self, texts, keys=None) -> np.ndarray:
        texts, _, keys = check_samples(texts, None, keys)
        prior = self.prior.score(texts, keys) if self.prior is not None else None
        with self._lock:
            if not self._recent:
                raise RuntimeError("ReweightedHistoryRanker.score called before fit")
            out = prior.copy() if prior is not None else np.full(len(keys), float(np.median(self._recent)))
            model, version = self._model, self.version
            todo: dict[str, list[tuple[Trace | None, float]]] = {}
            for i, k in enumerate(keys):
                if k not in self._hist:
                    continue
                hit = self._cache.get(k)
                if hit is not None and hit[0] == version and hit[1] == self._changed[k]:
                    out[i] = hit[2]
                    self.counters["cache_hits"] += 1
                else:
                    todo[k] = list(self._hist[k])
            gens = {k: self._changed[k] for k in todo}
            prompts = {k: self._prompt_ids[k] for k in todo}
        if todo:
            est = self._estimates(model, todo, prompts)
            with self._lock:
                for k, v in est.items():
                    self._cache[k] = (version, gens[k], v)
            for i, k in enumerate(keys):
                if k in est:
                    out[i] = est[k]
        return out

    # -- the estimate ------------------------------------------------------------------------
    def _estimates(self, model, todo: dict[str, list], prompts: dict[str, list[int]]) -> dict[str, float]:
        """Each key's expected length under ``model`` by the configured ``estimator`` (class docstring)."""
        rows = [(k, j, prompts[k], t) for k, hist in todo.items() for j, (t, _) in enumerate(hist) if t is not None]
        # A prompt's history repeats responses (a quarter of a run's are distinct): one pass per distinct one.
        distinct = list(dict.fromkeys((k, t.output_ids) for k, _, _, t in rows))
        at = {kr: i for i, kr in enumerate(distinct)}
        passes = self.response_token_logprobs(model, [prompts[k] for k, _ in distinct], [ids for _, ids in distinct])
        current = [passes[at[k, t.output_ids]] for k, _, _, t in rows]
        with self._lock:
            self.counters["forward_responses"] += len(distinct)
        # Per response, the cumulative log-ratio after each of its tokens (empty: no trace, ratio 0).
        cum: dict[str, list[np.ndarray]] = {k: [np.zeros(0)] * len(h) for k, h in todo.items()}
        paths: dict[str, list] = {k: [] for k in todo}  # the tree estimator's (ids, current log-probs, length)
        for (k, j, _, t), lp in zip(rows, current):
            if self.estimator == "tree":
                paths[k].append((t.output_ids, lp, todo[k][j][1]))
                continue
            if t.token_logprobs is None or self.estimator == "sequence":
                step = np.zeros(len(lp))
                step[-1] = lp.sum() - t.logprob  # only the whole response's ratio is known (or used)
            else:
                step = lp - np.asarray(t.token_logprobs)
            cum[k][j] = np.cumsum(self.beta * step)
        out = {}
        for k, hist in todo.items():
            lengths = np.array([n for _, n in hist], dtype=float)
            if self.estimator == "tree":
                out[k] = _tree(paths[k]) if paths[k] else float(lengths.mean())
            elif self.estimator == "sequence":
                d = np.array([c[-1] if len(c) else 0.0 for c in cum[k]])
                w = np.exp(d - d.max())
                out[k] = float(np.dot(w, lengths) / w.sum())
            else:
                out[k] = (_per_decision if self.estimator == "per_decision" else _hazard)(cum[k], lengths)
        return out

    def response_logprobs(self, model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> np.ndarray:
        """Sum of log pi(response token | prefix) per (prompt, response), teacher-forced."""
        return np.array([lp.sum() for lp in self.response_token_logprobs(model, prompts, responses)])

    def response_token_logprobs(self, model, prompts: Sequence[Sequence[int]],
                                responses: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """log pi(response token | prefix) per token of each (prompt, response), teacher-forced, in
        length-sorted batches of at most ``batch_tokens``."""
        import torch

        from streamrl.models.logprobs import token_logprobs

        n = len(prompts)
        out = [np.zeros(len(r)) for r in responses]
        order = sorted(range(n), key=lambda i: len(prompts[i]) + len(responses[i]))
        pad = self._tok.pad_token_id or 0
        start = 0
        with torch.no_grad():
            while start < n:
                stop = start + 1
                while stop < n and (stop - start + 1) * (len(prompts[order[stop]]) + len(responses[order[stop]])) <= self.batch_tokens:
                    stop += 1
                idx = order[start:stop]
                width = max(len(prompts[i]) + len(responses[i]) for i in idx)
                x = torch.full((len(idx), width), pad, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for r, i in enumerate(idx):
                    ids = list(prompts[i]) + list(responses[i])
                    x[r, :len(ids)] = torch.tensor(ids)
                    mask[r, :len(ids)] = 1
                logits = model(input_ids=x, attention_mask=mask).logits
                for r, i in enumerate(idx):
                    p, m = len(prompts[i]), len(responses[i])
                    if m:  # logits at position t score token t + 1
                        lp = token_logprobs(logits[r:r + 1, p - 1:p + m - 1], x[r:r + 1, p:p + m], self.temperature)
                        out[i] = lp[0].double().numpy()
                start = stop
        return out


def _per_decision(cum: Sequence[np.ndarray], lengths: np.ndarray) -> float:
    """Expected length as the sum of a per-decision importance-weighted survival curve.

    ``E[L] = sum_t P(L > t)``. Whether response j is still running after t tokens depends on its
    first t + 1 tokens only, so ``P(L > t)`` is estimated with each response weighted by its
    likelihood ratio over those tokens, ``exp(cum_j[min(t, n_j - 1)])`` (a finished response keeps
    its whole ratio; one without a trace, ``cum_j`` empty, has ratio 1), self-normalised at each t.
    Ratios of tokens after t, which do not decide the event, are left out: the per-decision
    estimator of off-policy evaluation (Precup, Sutton and Singh, 2000), lower in variance than one
    weight per whole response. With equal ratios it is the plain mean of ``lengths``."""
    horizon = int(np.ceil(lengths.max()))
    t = np.arange(horizon)
    logw = np.zeros((len(lengths), horizon))
    for j, c in enumerate(cum):
        if len(c):
            logw[j] = c[np.minimum(t, len(c) - 1)]
    w = np.exp(logw - logw.max(axis=0, keepdims=True))
    alive = lengths[:, None] > t[None, :]
    return float(((w * alive).sum(axis=0) / w.sum(axis=0)).sum())


def _hazard(cum: Sequence[np.ndarray], lengths: np.ndarray) -> float:
    """Expected length from a weighted product-limit survival curve.

    The hazard ``h(t) = P(L = t | L >= t)`` is the weighted share of the responses still running
    at length t that stop there, each weighted by its ratio over its first t tokens (the t-th
    token is the one that stops it or not); ``P(L > t) = prod_{s <= t} (1 - h(s))`` and
    ``E[L] = sum_{t >= 0} P(L > t)``. With equal ratios it is the plain mean of ``lengths``."""
    horizon = int(np.ceil(lengths.max()))
    t = np.arange(1, horizon + 1)
    logw = np.zeros((len(lengths), horizon))
    for j, c in enumerate(cum):
        if len(c):
            logw[j] = c[np.minimum(t - 1, len(c) - 1)]
    running = lengths[:, None] >= t[None, :]
    stops = running & (lengths[:, None] < t[None, :] + 1)
    logw = np.where(running, logw, -np.inf)
    top = logw.max(axis=0, keepdims=True)
    w = np.exp(logw - np.where(np.isfinite(top), top, 0.0))
    denom = w.sum(axis=0)
    h = np.divide((w * stops).sum(axis=0), denom, out=np.ones(horizon), where=denom > 0)
    return float(1.0 + np.cumprod(1.0 - h)[:-1].sum())


def _tree(paths: Sequence[tuple[Sequence[int], np.ndarray, float]]) -> float:
    """Expected length under the current policy over the tree of the remembered responses.

    ``paths``: (output ids, the current policy's log-prob of each of those tokens after its prefix,
    recorded length). The responses form a trie; every node is a prefix, every edge a token the
    current policy takes there with a probability it gave exactly (teacher-forced), whatever
    policy sampled it. A node's value is the expected length from it::

        V(leaf) = its length (a response that ended with EOS, or was cut at the cap)
        V(n)    = sum over children c of pi(c | n) V(n c)  +  (1 - sum_c pi(c | n)) G(n)

    The mass the current policy puts on tokens no remembered response took at ``n`` leaves the
    tree; ``G(n)``, what such a response's length would be, is the mean length of the remembered
    responses through ``n`` (at least one token longer than ``n``). So the estimator trusts the
    policy's own probabilities where the history went and the history's lengths only where it
    did not: a prompt whose earlier responses the policy now follows closely is estimated from
    them almost exactly, however few there are, and one where the policy now strays from every
    remembered path keeps the lengths seen past the point where it strays. With the behaviour
    policy's own probabilities and responses that never share a prefix, it is near the plain mean.
    """
    root: dict = {"kids": {}, "sum": 0.0, "count": 0}
    for ids, lp, n in paths:
        node = root
        node["sum"] += n
        node["count"] += 1
        for depth, (tok, logp) in enumerate(zip(ids, lp), 1):
            kid = node["kids"].get(tok)
            if kid is None:
                kid = node["kids"][tok] = {"kids": {}, "sum": 0.0, "count": 0, "logp": float(logp), "depth": depth}
            node = kid
            node["sum"] += n
            node["count"] += 1
        node["end"] = float(n)

    # Iterative post-order: a response can be thousands of tokens, deeper than Python's recursion.
    stack, done = [(root, False)], {}
    while stack:
        n, expanded = stack.pop()
        if not n["kids"]:
            done[id(n)] = n.get("end", n["sum"] / n["count"])
        elif not expanded:
            stack.append((n, True))
            stack.extend((c, False) for c in n["kids"].values())
        else:
            probs = [math.exp(c["logp"]) for c in n["kids"].values()]
            stay = sum(p * done[id(c)] for p, c in zip(probs, n["kids"].values()))
            leave = max(0.0, 1.0 - sum(probs))
            unseen = max(n["sum"] / n["count"], n.get("depth", 0) + 1.0)
            done[id(n)] = stay + leave * unseen
    return done[id(root)]
