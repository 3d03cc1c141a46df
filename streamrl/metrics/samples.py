"""The rollout log: every trained sample of a run as one JSONL row (``logging.samples: true``).

The driver writes one row per sample after each iteration's ``pipeline.step``, so the file holds
what the trainer consumed, in iteration order (the fields: ``SampleLog.write``). A run resumed at
iteration k keeps the rows of iterations before k and drops later ones (written after the
checkpoint it resumes from, they will be generated again); a fresh run starts an empty file.
The rows are ``streamrl rank eval --data samples`` records as they are (``key``, ``text``,
``length``; ``--step-field epoch`` or ``iteration`` says which column orders them), so a ranker
can be evaluated on the lengths a real RL run produced, with the history an online ranker would
have had.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable

from streamrl.types import Sample

SAMPLES_FILE = "samples.jsonl"


class SampleLog:
    """Appends each iteration's samples to ``out_dir/samples.jsonl`` (from ``start_iteration`` on)."""

    def __init__(self, out_dir: str | Path, start_iteration: int = 0) -> None:
        self.path = Path(out_dir) / SAMPLES_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        self._visits: Counter[str] = Counter()
        if start_iteration > 0 and self.path.is_file():
            for line in filter(str.strip, self.path.read_text().splitlines()):
                row = json.loads(line)
                if row["iteration"] < start_iteration:
                    kept.append(line + "\n")
                    self._visits[row["key"]] = max(self._visits[row["key"]], int(row["epoch"]) + 1)
        self.path.write_text("".join(kept))
        self._file = open(self.path, "a")

    def write(self, iteration: int, samples: Iterable[Sample]) -> int:
        """Write one iteration's samples; returns how many rows were written. A row::

            {"iteration", "epoch", "key", "text", "sample_idx", "length", "reward", "finish_reason",
             "version_start", "version_end", "instance", "response", "prompt_ids", "reward_error",
             "logprob", "logprobs", "output_ids"}

        ``epoch`` is how many earlier iterations drew the same prompt: 0 the first time the run
        saw it, 1 the second, ... (the prompt stream's epoch where batches do not straddle an
        epoch boundary). ``logprob`` is the sum of the sampled tokens' log-probabilities under the
        policy that generated them (the behaviour policy), so a later policy's likelihood of the
        same response can be compared with it (importance weights; ``ranker/reweighted.py``);
        ``logprobs`` the same token by token (rounded to 1e-6), for the per-decision estimator;
        both are null when the engine returned no log-prob per token. ``output_ids`` are the
        generated token ids (EOS included): the response text alone does not always encode back
        to them (a special token sampled mid-response is dropped from the text). A multi-turn
        trajectory adds ``turns``, ``env_tokens`` (its tokens the policy did not sample, loss mask
        0), ``tool_calls``, ``tool_errors``, ``cut`` (``max_turns``, ``max_new_tokens``, ``context``
        or null), ``turn_instances`` (the instance of each turn) and ``loss_mask``; its ``length`` counts the sampled tokens only."""
        samples = list(samples)
        keys = {s.prompt.prompt_id for s in samples}
        for s in samples:
            c = s.completion
            row = {"iteration": iteration, "epoch": self._visits[s.prompt.prompt_id], "key": s.prompt.prompt_id,
                   "text": s.prompt.text, "sample_idx": s.sample_idx, "length": s.num_response_tokens,
                   "reward": s.reward, "finish_reason": c.finish_reason, "version_start": c.version_start,
                   "version_end": c.version_end, "instance": c.instance, "response": s.response_text,
                   "prompt_ids": list(c.prompt_ids),
                   # an errored or timed-out reward scores 0.0: flagged, so it never reads as a real 0
                   "reward_error": s.reward_info.get("error"),
                   **_logprobs(c), **_episode(c)}
            self._file.write(json.dumps(row) + "\n")
        self._visits.update(keys)
        self._file.flush()
        return len(samples)

    def close(self) -> None:
        self._file.close()


def _episode(c) -> dict:
    """A trajectory's account (``agent.loop``); nothing for a single-turn response."""
    if not c.episode:
        return {}
    e = c.episode
    return {"turns": e["turns"], "env_tokens": e["env_tokens"], "tool_calls": e["tool_calls"],
            "tool_errors": e["tool_errors"], "cut": e["cut"], "turn_instances": e["instances"],
            "loss_mask": list(c.mask())}


def _logprobs(c) -> dict:
    """``logprob`` and ``logprobs`` of a completion; null when it has no log-prob per token."""
    if len(c.logprobs) != len(c.output_ids):
        return {"logprob": None, "logprobs": None, "output_ids": list(c.output_ids)}
    return {"logprob": float(sum(c.logprobs)), "logprobs": [round(float(x), 6) for x in c.logprobs],
            "output_ids": list(c.output_ids)}
