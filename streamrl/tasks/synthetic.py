"""The synthetic long-tail task: the default workload of the CPU demo and benchmarks.

Each prompt asks for a chain of simple steps whose *number* is drawn log-uniformly, so correct
responses range from a handful of characters to a couple of hundred, with a heavy tail like
reasoning traces. Three sub-tasks, all verifiable:

- ``D a,c:`` count down by one from ``a - 1`` to ``c``, writing each value; the answer is ``c``.
  Steps = ``a - c``.
- ``U a,s,b:`` count up: add ``s`` to ``a`` until the value exceeds ``b``; the answer is that
  first value above ``b``. Steps = ``(b - a) // s + 1``.
- ``S d1d2...dk:`` running digit sum modulo 10: write the running total (mod 10) after each
  digit; the answer is the last one. Steps = ``k``.

A response is the chain followed by ``=answer`` (e.g. ``"S 4819:"`` -> ``"4 2 3 2 =2"``). The reward
is 1 when the whole worked chain and the answer are right ("show your work"), else 0. Checking
the chain, not only the answer, matters: a policy rewarded for the answer alone learns to guess
short answers to long problems (the answer of ``U`` is within ``s`` of ``b``), and the long tail
the later benchmarks need collapses. Optional ``partial_credit`` (``task.partial_credit``) adds a
shaped term for a correct prefix of the chain, strictly below the exact solution's 1.0: without
it, GRPO sees no signal on long prompts (every sample wrong) and learns from short prompts to
write ``=`` early, which shortens long responses too. For the count tasks the
response length is not a function of the prompt length (``D 412,409:`` is a short chain, ``D 412,370:`` a
long one), so predicting length is a real ranking problem; for the digit
sum it is. Mixed, prompt and response lengths correlate only moderately (``streamrl task stats``).

The policy is character-level, so one character is one token.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from streamrl.tasks.base import Task
from streamrl.types import Prompt

SUBTASKS = ("D", "U", "S")
ALPHABET = "0123456789DUS,:= "


@dataclass(frozen=True)
class SyntheticSpec:
    """Knobs of the generator; the defaults meet the long-tail criteria with the tiny policy."""

    min_steps: int = 1
    max_steps: int = 48
    """Step counts are log-uniform on [min_steps, max_steps]."""
    max_step_size: int = 3


def _log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def make_problem(rng: random.Random, spec: SyntheticSpec = SyntheticSpec()) -> tuple[str, str, str]:
    """Return ``(prompt_text, solution_text, answer)`` for one random problem."""
    kind = rng.choice(SUBTASKS)
    steps = _log_uniform_int(rng, spec.min_steps, spec.max_steps)
    if kind == "D":
        c = rng.randint(0, 400)
        a = c + steps
        values = list(range(a - 1, c - 1, -1))
        prompt = f"D {a},{c}:"
    elif kind == "U":
        s = rng.randint(1, spec.max_step_size)
        a = rng.randint(0, 400)
        b = a + (steps - 1) * s + rng.randint(0, s - 1)
        values = list(range(a + s, b + s + 1, s))
        values = [v for v in values if v <= b] + [next(v for v in values if v > b)]
        prompt = f"U {a},{s},{b}:"
    else:
        digits = [rng.randint(0, 9) for _ in range(steps)]
        total, values = 0, []
        for d in digits:
            total = (total + d) % 10
            values.append(total)
        prompt = "S " + "".join(map(str, digits)) + ":"
    answer = str(values[-1])
    solution = " ".join(map(str, values)) + " =" + answer
    return prompt, solution, answer


def extract_answer(response: str) -> str | None:
    """The text after the last ``=``, stripped; None when there is none."""
    if "=" not in response:
        return None
    return response.rsplit("=", 1)[1].strip()


def solve(prompt_text: str) -> tuple[str, str]:
    """Recompute ``(solution, answer)`` from a prompt text (used to verify and to build SFT data)."""
    kind, body = prompt_text[0], prompt_text[2:].rstrip(":")
    if kind == "D":
        a, c = map(int, body.split(","))
        values = list(range(a - 1, c - 1, -1)) or [a]
    elif kind == "U":
        a, s, b = map(int, body.split(","))
        values, v = [], a
        while v <= b:
            v += s
            values.append(v)
    elif kind == "S":
        total, values = 0, []
        for ch in body:
            total = (total + int(ch)) % 10
            values.append(total)
    else:
        raise ValueError(f"unknown synthetic sub-task {kind!r} in prompt {prompt_text!r}")
    answer = str(values[-1])
    return " ".join(map(str, values)) + " =" + answer, answer


class SyntheticTask(Task):
    """Deterministic train and held-out prompt sets for a seed; the reward is exact match."""

    name = "synthetic"
    reward_is_fast = True

    def __init__(self, num_train: int = 4096, num_eval: int = 256, seed: int = 0,
                 spec: SyntheticSpec = SyntheticSpec(), partial_credit: float = 0.0) -> None:
        if not 0 <= partial_credit < 1:
            raise ValueError(f"partial_credit={partial_credit!r} must be in [0, 1)")
        self.spec = spec
        self.partial_credit = partial_credit
        # The held-out set depends only on its size, so every run and seed sees the same one;
        # training prompts never repeat a held-out prompt's text.
        self._eval = self._make("eval", num_eval, 424242, exclude=set())
        self._train = self._make("train", num_train, seed * 1_000_003 + 1, exclude={p.text for p in self._eval})

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
        everywhere counts only exact solutions (reward 1.0)."""
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
