"""The paper's ranker: a small language model fine-tuned to estimate output lengths (PAPER.md §3.6).

``lm`` takes a causal LM checkpoint (by default the policy itself: on the CPU path the tiny policy
that ``streamrl make-policy`` builds), replaces its LM head by a linear regression head on the
hidden state of the prompt's last token, and fine-tunes the whole network on (prompt, length)::

    samples (text, length) ──group by text──> m distinct prompts, y = log1p(mean length), w = count
    ├─ probe: train on 80 % of the prompts, keep the epoch with the lowest weighted MSE on the rest
    └─ final: refit on all m prompts for that many epochs (AdamW, cosine learning rate, batches of prompts)
    score(texts) = expm1(mean over {probe, final} of head(h_last(texts)))     (only the order matters)

Why the policy's weights, the online ``update`` and the cold start: ``FinetunedLMRanker``.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import deque
from typing import Sequence

import numpy as np

from streamrl.ranker.base import Ranker, check_samples


class FinetunedLMRanker(Ranker):
    """A causal LM with a regression head on the last prompt token, fine-tuned on lengths.

    Why start from the policy's weights: the ranker has to predict what *this* policy will do
    with a prompt, including its systematic mistakes, and the policy's network already computes
    the features that drive them. A prompt-only regression on the text (``learned``) can at best
    learn the task; on the synthetic task the policy's runaway and early-stopping chains decide
    the longest groups, and the task's own solution length ranks them worse than the fine-tuned
    policy does. The same network from random weights ranks far worse: the start carries the
    signal (docs/experiments.md).

    The probe is kept as a second ensemble member because it is already trained, and the average
    of the two ranked held-out groups better than the final network alone. ``update`` trains
    both networks on the window of recent samples for a few epochs, aside, and swaps them in
    under a lock. While fewer than ``min_prompts`` distinct prompts have been seen the prediction
    is a constant (the mean), so a cold start does not fine-tune on a handful of groups. A fit
    runs before the first iteration and in the online refresh's background thread; scoring is
    off the critical path.

    Args:
        model_path: checkpoint directory of the base model (``streamrl.models.tiny.load_policy``
            format: ``config.json`` + weights + ``tokenizer.json``). The SGS and the benches pass
            the run's ``policy.path`` when it is not given.
        epochs: most epochs of the first fit; the epoch count is picked on a held-out 20 % of the
            prompts (``val_frac``) and the final model refit on all of them.
        update_epochs: epochs of the online refresh, continuing from the current network.
        lr / weight_decay / batch_size: AdamW over prompts, cosine schedule to 0.
        max_prompt_tokens: prompts are cut to their first this many tokens.
        window: samples kept for online refreshes (the most recent ones).
        min_prompts: fewer distinct prompts than this -> constant prediction, no fine-tuning.
        seed: initialisation of the head and batch order.
    """

    name = "lm"
    needs_policy = True

    def __init__(self, model_path: str | None = None, epochs: int = 40, update_epochs: int = 4,
                 lr: float = 1e-3, weight_decay: float = 0.01, batch_size: int = 64, val_frac: float = 0.2,
                 max_prompt_tokens: int = 256, window: int = 32768, min_prompts: int = 20, seed: int = 0):
        if model_path is None:
            raise ValueError("ranker 'lm' needs model_path: a causal-LM checkpoint directory "
                             "(the run's policy.path; `streamrl make-policy` writes one)")
        for name, v, lo in (("epochs", epochs, 1), ("update_epochs", update_epochs, 0), ("batch_size", batch_size, 1),
                            ("max_prompt_tokens", max_prompt_tokens, 1), ("window", window, 1),
                            ("min_prompts", min_prompts, 2)):
            if int(v) < lo:
                raise ValueError(f"ranker 'lm': {name} must be >= {lo}, got {v}")
        if not 0.0 < val_frac < 1.0:
            raise ValueError(f"ranker 'lm': val_frac must be in (0, 1), got {val_frac}")
        if not lr > 0:
            raise ValueError(f"ranker 'lm': lr must be > 0, got {lr}")
        from streamrl.models.tiny import load_policy

        model, self._tok = load_policy(model_path)
        self._base = model.base_model  # the decoder stack without the LM head
        self.model_path = str(model_path)
        self.epochs, self.update_epochs = int(epochs), int(update_epochs)
        self.lr, self.weight_decay, self.batch_size = float(lr), float(weight_decay), int(batch_size)
        self.val_frac, self.max_prompt_tokens = float(val_frac), int(max_prompt_tokens)
        self.min_prompts, self.seed = int(min_prompts), int(seed)
        self._buffer: deque[tuple[str, float]] = deque(maxlen=int(window))
        self._lock = threading.Lock()
        self._nets = None  # ((decoder, head), ...) once fine-tuned: the probe and the final network
        self._const: float | None = None
        self.params_: dict = {}
        self.loo_rmse_: float | None = None  # held-out RMSE of log prompt means (the blend's prior count)

    # -- data -------------------------------------------------------------------------------
    def _encode(self, texts: Sequence[str]):
        import torch

        bos = self._tok.bos_token_id
        ids = [([bos] if bos is not None else []) + self._tok.encode(t, add_special_tokens=False) for t in texts]
        ids = [s[: self.max_prompt_tokens] or [self._tok.pad_token_id or 0] for s in ids]
        width = max(len(s) for s in ids)
        x = torch.full((len(ids), width), self._tok.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, s in enumerate(ids):
            x[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        return x, mask

    @staticmethod
    def _groups(pairs: Sequence[tuple[str, float]]) -> tuple[list[str], np.ndarray, np.ndarray]:
        by_text: dict[str, list[float]] = {}
        for t, n in pairs:
            by_text.setdefault(t, []).append(n)
        texts = sorted(by_text)
        y = np.log1p(np.array([np.mean(by_text[t]) for t in texts]))
        w = np.array([len(by_text[t]) for t in texts], dtype=np.float64)
        return texts, y, w

    # -- the network ------------------------------------------------------------------------
    @staticmethod
    def _forward(net, x, mask):
        import torch

        decoder, head = net
        h = decoder(input_ids=x, attention_mask=mask).last_hidden_state
        last = h[torch.arange(x.shape[0]), mask.sum(1) - 1]
        return head(last).squeeze(-1)

    def _fresh(self, y_mean: float):
        import torch

        torch.manual_seed(self.seed)
        decoder = copy.deepcopy(self._base)
        head = torch.nn.Linear(decoder.config.hidden_size, 1)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.constant_(head.bias, y_mean)
        return decoder, head

    def _train(self, net, texts, y, w, epochs: int, val=None) -> list[float]:
        """Train ``net`` in place; returns the weighted validation MSE after each epoch (if ``val``)."""
        import torch

        decoder, head = net
        params = list(decoder.parameters()) + list(head.parameters())
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        x, mask = self._encode(texts)
        yt, wt = torch.tensor(y, dtype=torch.float32), torch.tensor(w, dtype=torch.float32)
        n, bs = len(texts), self.batch_size
        total, step = epochs * math.ceil(n / bs), 0
        gen = torch.Generator().manual_seed(self.seed)
        history = []
        for _ in range(epochs):
            decoder.train()
            for b in torch.randperm(n, generator=gen).split(bs):
                for group in opt.param_groups:
                    group["lr"] = self.lr * 0.5 * (1.0 + math.cos(math.pi * step / total))
                pred = self._forward(net, x[b], mask[b])
                loss = (wt[b] * (pred - yt[b]) ** 2).sum() / wt[b].sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
            if val is not None:
                history.append(self._mse(net, *val))
        decoder.eval()
        return history

    def _mse(self, net, texts, y, w) -> float:
        pred = self._predict([net], texts)
        return float(np.average((pred - y) ** 2, weights=w))

    def _predict(self, nets, texts: Sequence[str]) -> np.ndarray:
        """Mean log-length prediction of ``nets`` (each a (decoder, head)), each chunk encoded once."""
        import torch

        for decoder, _ in nets:
            decoder.eval()
        out = []
        with torch.no_grad():
            for i in range(0, len(texts), 512):  # one forward pass per 512 prompts
                x, mask = self._encode(texts[i:i + 512])
                out.append(np.mean([self._forward(net, x, mask).double().numpy() for net in nets], axis=0))
        return np.concatenate(out) if out else np.zeros(0)

    # -- Ranker -----------------------------------------------------------------------------
    def fit(self, texts, lengths, keys=None) -> "FinetunedLMRanker":
        texts, lens, _ = check_samples(texts, lengths, keys)
        if not texts:
            raise ValueError("fit needs at least one sample")
        with self._lock:
            self._buffer.clear()
            self._buffer.extend(zip(texts, lens.tolist()))
            pairs = list(self._buffer)
        uniq, y, w = self._groups(pairs)
        if len(uniq) < self.min_prompts:
            self._install(None, float(np.average(y, weights=w)), {"prompts": len(uniq), "epochs": 0})
            return self
        rng = np.random.default_rng(self.seed)
        order = rng.permutation(len(uniq))
        n_val = max(1, int(round(self.val_frac * len(uniq))))
        if n_val >= len(uniq):
            raise ValueError(f"ranker 'lm': val_frac={self.val_frac} leaves no training prompt of {len(uniq)}")
        val, tr = order[:n_val], order[n_val:]
        probe = self._fresh(float(np.average(y[tr], weights=w[tr])))
        history = self._train(probe, [uniq[i] for i in tr], y[tr], w[tr], self.epochs,
                              val=([uniq[i] for i in val], y[val], w[val]))
        best = int(np.argmin(history)) + 1
        net = self._fresh(float(np.average(y, weights=w)))
        self._train(net, uniq, y, w, best)
        self._install((probe, net), None, {"prompts": len(uniq), "epochs": best, "val_mse": history[best - 1]})
        self.loo_rmse_ = float(np.sqrt(history[best - 1]))
        return self

    def update(self, texts, lengths, keys=None) -> None:
        texts, lens, _ = check_samples(texts, lengths, keys)
        with self._lock:
            self._buffer.extend(zip(texts, lens.tolist()))
            pairs, nets = list(self._buffer), self._nets
        if nets is None:  # not fine-tuned yet: a full fit once there are enough prompts
            self.fit([t for t, _ in pairs], [n for _, n in pairs])
            return
        if self.update_epochs == 0 or not texts:
            return
        uniq, y, w = self._groups(pairs)
        new = copy.deepcopy(nets)  # trained aside; score keeps using the current ones meanwhile
        for net in new:
            self._train(net, uniq, y, w, self.update_epochs)
        self._install(new, None, {**self.params_, "prompts": len(uniq), "updates": self.params_.get("updates", 0) + 1})

    def _install(self, nets, const: float | None, params: dict) -> None:
        with self._lock:
            self._nets, self._const, self.params_ = nets, const, params

    def score(self, texts, keys=None) -> np.ndarray:
        texts, _, _ = check_samples(texts, None, keys)
        with self._lock:
            nets, const = self._nets, self._const
        if nets is None and const is None:
            raise RuntimeError("FinetunedLMRanker.score called before fit")
        if not texts:
            return np.zeros(0)
        log_pred = (np.full(len(texts), const) if nets is None
                    else self._predict(nets, texts))
        return np.expm1(np.minimum(log_pred, 50.0))
