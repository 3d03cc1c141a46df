"""The synthetic long-tail task: the default workload of the CPU demo and benchmarks.

Each prompt asks for a chain of simple steps whose *number* is drawn log-uniformly (1 to
``max_steps``), so correct responses range from a handful of characters to a couple of hundred,
with a heavy tail like reasoning traces. ``U a,s:`` counts up from ``a`` in steps of ``s`` to the
next multiple of 100; ``D a,s:`` counts down below the multiple of 100 at or under ``a`` (the
exact rules: ``_chain``). A response is the chain followed by ``=answer`` (``"U 194,3:"`` ->
``"197 200 =200"``); the reward is 1 only for the whole worked chain and the answer
(``SyntheticTask.reward``). Invariants: the number of steps does not depend on the prompt's
length (every prompt is 6 to 8 characters), so predicting the response length is a real ranking
problem; the policy is character-level, one character one token. Why this shape: ``SyntheticTask``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from streamrl.tasks.base import Task
from streamrl.types import Prompt

TASK_VERSION = 2
"""Bumped whenever the prompts or solutions change; a policy warm-started on another version is rebuilt."""
SUBTASKS = ("D", "U")
ALPHABET = "0123456789DU,:= "


@dataclass(frozen=True)
class SyntheticSpec:
    """Knobs of the generator; the defaults meet the long-tail criteria with the tiny policy."""

    min_steps: int = 1
    max_steps: int = 56
    """Step counts are log-uniform on [min_steps, max_steps]; a chain stays inside one hundred,
    so at most 100 steps (step size 1)."""
    max_step_size: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps <= 100:
            raise ValueError(f"synthetic steps need 1 <= min_steps <= max_steps <= 100, "
                             f"got min_steps={self.min_steps}, max_steps={self.max_steps}")
        if not 1 <= self.max_step_size <= 9:
            raise ValueError(f"synthetic max_step_size={self.max_step_size} must be in 1..9")


def _log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def _chain(kind: str, a: int, s: int) -> list[int]:
    """The worked values of ``kind`` (``U`` or ``D``) from ``a`` in steps of ``s``.

    ``U``: count up until the value reaches the next multiple of 100 (the first value
    ``>= 100 * (a // 100 + 1)``). ``D`` (``a >= 100``): count down until the value falls below the
    multiple of 100 at or under ``a`` (the first value ``< 100 * (a // 100)``). The last value is
    the answer."""
    if kind == "U":
        top, values, v = 100 * (a // 100 + 1), [], a
        while v < top:
            v += s
            values.append(v)
        return values
    low, values, v = 100 * (a // 100), [], a
    while v >= low:
        v -= s
        values.append(v)
    return values


def make_problem(rng: random.Random, spec: SyntheticSpec = SyntheticSpec()) -> tuple[str, str, str]:
    """Return ``(prompt_text, solution_text, answer)`` for one random problem whose number of
    steps is drawn log-uniformly from ``[spec.min_steps, spec.max_steps]``."""
    kind = rng.choice(SUBTASKS)
    steps = _log_uniform_int(rng, spec.min_steps, spec.max_steps)
    # A chain stays inside one hundred, so a step size is possible only if the steps fit in it.
    s = rng.choice([x for x in range(1, spec.max_step_size + 1) if (steps - 1) * x <= 99])
    if kind == "U":
        # ceil(d / s) == steps for a distance d to the next hundred.
        a = 100 * rng.randint(1, 10) - rng.randint((steps - 1) * s + 1, min(steps * s, 100))
    else:
        # floor(e / s) + 1 == steps for an offset e above the hundred below.
        a = 100 * rng.randint(1, 9) + rng.randint((steps - 1) * s, min(steps * s - 1, 99))
    values = _chain(kind, a, s)
    answer = str(values[-1])
    return f"{kind} {a},{s}:", " ".join(map(str, values)) + " =" + answer, answer


def extract_answer(response: str) -> str | None:
    """The text after the last ``=``, stripped; None when there is none."""
    if "=" not in response:
        return None
    return response.rsplit("=", 1)[1].strip()


def solve(prompt_text: str) -> tuple[str, str]:
    """Recompute ``(solution, answer)`` from a prompt text (used to verify and to build SFT data)."""
    kind, body = prompt_text[:1], prompt_text[2:].rstrip(":")
    if kind not in SUBTASKS:
        raise ValueError(f"unknown synthetic sub-task {kind!r} in prompt {prompt_text!r}")
    try:
        a, s = map(int, body.split(","))
    except ValueError:
        raise ValueError(f"malformed synthetic prompt {prompt_text!r}: want '{kind} a,s:'") from None
    if s < 1 or a < 0 or (kind == "D" and a < 100):
        raise ValueError(f"synthetic prompt {prompt_text!r} out of range: s >= 1, a >= 0 (a >= 100 for D)")
    values = _chain(kind, a, s)
    answer = str(values[-1])
    return " ".join(map(str, values)) + " =" + answer, answer


class SyntheticTask(Task):
    """Deterministic train and held-out prompt sets for a seed; the reward is exact match.

    Why this shape: every decision the policy makes is *local*: the next value is the previous
    one plus or minus a one-digit step, and the chain stops when the hundreds digit changes. A
    tiny character-level model learns such rules in a short SFT, so RL starts from a policy that
    is often right on short chains and often wrong on long ones, which is where GRPO has signal
    (a task that was not learnable this way: docs/design.md). The number of steps depends on the
    last two digits of ``a`` and on ``s``, not on the prompt's length: ``streamrl task stats``
    reports Spearman(prompt tokens, response tokens) near 0.
    """

    name = "synthetic"
    reward_is_fast = True

    def __init__(self, num_train: int = 4096, num_eval: int = 256, seed: int = 0,
                 spec: SyntheticSpec = SyntheticSpec(), partial_credit: float = 0.0, length_ramp: bool = False) -> None:
        if not 0 <= partial_credit < 1:
            raise ValueError(f"partial_credit={partial_credit!r} must be in [0, 1)")
        self.spec = spec
        self.partial_credit = partial_credit
        # The held-out set depends only on its size, so every run and seed sees the same one;
        # training prompts never repeat a held-out prompt's text.
        self._eval = self._make("eval", num_eval, 424242, exclude=set())
        self._train = self._make("train", num_train, seed * 1_000_003 + 1, exclude={p.text for p in self._eval})
        self.ordered = length_ramp  # the stream keeps this order (``PromptStream(shuffle=False)``)
        if length_ramp:
            self._train.sort(key=lambda p: len(p.meta["solution"]))

    def _make(self, split: str, n: int, seed: int, exclude: set[str]) -> list[Prompt]:
        rng = random.Random(seed)
        out: list[Prompt] = []
        while len(out) < n:
            text, solution, answer = make_problem(rng, self.spec)
            if text in exclude:
                continue
            out.append(Prompt(prompt_id=f"{split}-{len(out):06d}", text=text, answer=answer,
                              meta={"subtask": text[0], "solution": solution}))
        return out

    def train_prompts(self) -> list[Prompt]:
        return list(self._train)

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    def reward(self, prompt: Prompt, response: str) -> float:
        """1.0 for the exact worked solution; otherwise ``partial_credit`` times the length of the
        correct prefix of the chain over the longer of the two chains (0 with ``partial_credit=0``). Accuracy
        everywhere counts only exact solutions (reward 1.0).

        The whole worked chain is checked, not only the answer ("show your work"): a policy
        rewarded for the answer alone learns to guess (the answer is within ``s`` of a multiple
        of 100) and the long tail the benchmarks need collapses. ``partial_credit``
        (``task.partial_credit``) shapes a correct prefix, strictly below the exact 1.0."""
        solution = prompt.meta["solution"]
        if response.strip() == solution:
            return 1.0
        if self.partial_credit <= 0:
            return 0.0
        want = solution.split(" =")[0].split()
        got = response.split("=")[0].split()
        prefix = 0
        for a, b in zip(want, got):
            if a != b:
                break
            prefix += 1
        # Dividing by the longer of the two chains makes writing past the end cost credit.
        return self.partial_credit * prefix / (max(len(want), len(got)) + 1)
