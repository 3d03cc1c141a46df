"""Pieces every controller shares: the prompt stream, request building, scoring, statistics.

Nothing here starts processes; the controllers (one module per mode) wire these to the SGS and
the Trainer.
"""

from __future__ import annotations

import logging
import random
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from streamrl.config import Config
from streamrl.types import Completion, GenRequest, Group, Prompt, Sample

log = logging.getLogger(__name__)


@dataclass
class PromptStream:
    """Training prompts in a seeded order, reshuffled every epoch (``shuffle=False``: in the
    task's own order, every epoch); its position is checkpointed."""

    prompts: list[Prompt]
    seed: int
    epoch: int = 0
    index: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("the task has no training prompts")
        self._order = self._shuffle(self.epoch)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 7919 + epoch).shuffle(order)
        return order

    def next_batch(self, k: int) -> list[Prompt]:
        out = []
        for _ in range(k):
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
        return out

    def peek_batch(self, k: int) -> list[Prompt]:
        """The batch ``next_batch(k)`` would return, without moving the stream."""
        ahead = PromptStream(self.prompts, self.seed, self.epoch, self.index, self.shuffle)
        return ahead.next_batch(k)

    def upcoming(self, k: int, batches: int) -> list[Prompt] | None:
        """The next ``batches`` batches of ``k`` prompts, as one list (None for none): what a
        pipeline that admits later iterations early (``Pipeline.lookahead``) is handed."""
        return self.peek_batch(k * batches) if batches > 0 else None

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._shuffle(self.epoch)


class RequestBuilder:
    """Tokenises prompts into ``GenRequest``s: ``n`` per prompt (a GRPO group), rendered with the
    policy's chat template where it has one. A prompt longer than ``task.max_prompt_tokens`` is not
    sent; it is counted and logged (``data/oversized``)."""

    def __init__(self, tokenizer, cfg: Config) -> None:
        from streamrl.models.hf import PromptFormatter

        self.formatter = PromptFormatter(tokenizer, cfg.task.chat_template, cfg.task.system_prompt)
        self.encode = self.formatter.encode  # prompt text -> the ids the engine sees
        self.n = cfg.generation.n_samples
        self.max_new_tokens = cfg.generation.max_new_tokens
        self.max_prompt_tokens = cfg.task.max_prompt_tokens
        self.oversized = 0
        self.agent = None  # an ``agent.loop.AgentLoop``: requests open multi-turn trajectories

    def build(self, prompts: list[Prompt], iteration: int, tag: str = "") -> list[GenRequest]:
        if self.agent is not None:
            return self.agent.build(prompts, self.n, iteration, tag, self.max_new_tokens, self.max_prompt_tokens)
        reqs = []
        for p in prompts:
            ids = tuple(self.encode(p.text))
            if len(ids) > self.max_prompt_tokens:
                self.oversized += 1
                log.warning("prompt %s has %d tokens > task.max_prompt_tokens=%d; not generated",
                            p.prompt_id, len(ids), self.max_prompt_tokens)
                continue
            for j in range(self.n):
                reqs.append(GenRequest(request_id=f"{tag}{iteration}:{p.prompt_id}/{j}", prompt_id=p.prompt_id,
                                       sample_idx=j, prompt_ids=ids, max_new_tokens=self.max_new_tokens))
        return reqs


class Scoring:
    """One completion being scored (``Scorer.submit``): ``done()``, then ``sample()``."""

    def __init__(self, make, future) -> None:
        self._make, self._future = make, future

    def done(self) -> bool:
        return self._future.done()

    def sample(self) -> Sample:
        return self._make(*self._future.result())


class Scorer:
    """Turns engine completions into scored ``Sample``s with the task's verifiable reward, up to
    ``task.reward_workers`` at once (``submit``), so scoring keeps up with a stream of completions."""

    def __init__(self, task, tokenizer, reward_runner) -> None:
        self.tokenizer = tokenizer
        self.reward = reward_runner
        self.prompts: dict[str, Prompt] = {}
        self.task = task

    def register(self, prompts: list[Prompt]) -> None:
        for p in prompts:
            self.prompts[p.prompt_id] = p

    def submit(self, c: Completion, iteration: int) -> Scoring:
        """Start scoring ``c``. A trajectory with an environment keeps the env's reward (its turn
        rewards summed); anything else is scored by the task's reward on the decoded text (for a
        trajectory: the whole conversation after the prompt)."""
        prompt = self.prompts[c.prompt_id]
        text = self.tokenizer.decode(list(c.output_ids), skip_special_tokens=True)

        def make(reward: float, info: dict) -> Sample:
            return Sample(prompt=prompt, sample_idx=c.sample_idx, completion=c, response_text=text,
                          reward=float(reward), reward_info=info, iteration=iteration)

        if "env_reward" in c.episode:
            error = c.episode.get("error")
            future: Future = Future()
            future.set_result((c.episode["env_reward"], {"error": error} if error else {}))
            return Scoring(make, future)
        return Scoring(make, self.reward.submit(prompt, text))

    def score(self, c: Completion, iteration: int) -> Sample:
        return self.submit(c, iteration).sample()

    def score_many(self, completions, iteration: int) -> list[Sample]:
        """Every completion scored, in their order, the rewards computed in parallel."""
        return [p.sample() for p in [self.submit(c, iteration) for c in completions]]


def length_stats(lengths: list[int] | np.ndarray, prefix: str = "resp_len") -> dict[str, float]:
    arr = np.asarray(lengths, dtype=float)
    if arr.size == 0:
        return {}
    return {f"{prefix}/mean": float(arr.mean()), f"{prefix}/p50": float(np.percentile(arr, 50)),
            f"{prefix}/p90": float(np.percentile(arr, 90)), f"{prefix}/p99": float(np.percentile(arr, 99)),
            f"{prefix}/max": float(arr.max())}


def group_samples(samples: list[Sample]) -> list[list[Sample]]:
    """Samples grouped by prompt, groups in first-seen order, members by sample index."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.prompt.prompt_id, []).append(s)
    return [sorted(g, key=lambda s: s.sample_idx) for g in groups.values()]


def units_of(samples: list[Sample], algo: str) -> list[Group]:
    """What the trainer receives: a prompt's whole group for GRPO (advantages need it), one
    sample at a time for PPO."""
    return [Group.of(g) for g in (group_samples(samples) if algo == "grpo" else [[s] for s in samples])]
