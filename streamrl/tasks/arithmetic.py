"""The arithmetic task: word-free integer expressions for a small chat model, generated here.

Each prompt asks for the value of an expression of two or three integers joined by ``+``, ``-``
and ``*`` (``"What is 47 + 38 - 12?"``); the answer is the exact integer, and the reward is
``math_reward`` (the response's last number, or its last ``\\boxed{}``, checked by math_verify).
Training and held-out prompts are drawn from one seeded stream with no expression in both. Why
this task for the real-model recipe: GSM8K is out of a 135M model's reach in minutes of CPU RL,
while these sums start near a few percent and move within a dozen iterations.
"""

from __future__ import annotations

import random

from streamrl.tasks.base import Task
from streamrl.tasks.math import math_reward
from streamrl.types import Prompt

TEMPLATE = "What is {expr}? Answer with the number."
"""The user turn (the chat template wraps it)."""


def make_expression(rng: random.Random, max_operand: int, terms: int) -> tuple[str, int]:
    """One expression of ``terms`` operands in [1, max_operand] (a product's right factor in [2, 9],
    so products stay checkable by hand) and its value."""
    value = rng.randint(1, max_operand)
    parts = [str(value)]
    for _ in range(terms - 1):
        op = rng.choice("+-*")
        b = rng.randint(2, 9) if op == "*" else rng.randint(1, max_operand)
        parts += [op, str(b)]
    expr = " ".join(parts)
    return expr, int(eval(expr, {"__builtins__": {}}))  # digits and + - * only: built above


class ArithmeticTask(Task):
    """``num_train`` and ``num_eval`` distinct expressions with 2 to ``max_terms`` operands."""

    name = "arithmetic"

    def __init__(self, num_train: int = 4096, num_eval: int = 256, seed: int = 0, max_operand: int = 50,
                 max_terms: int = 2) -> None:
        if max_operand < 2 or max_terms < 2:
            raise ValueError(f"arithmetic needs max_operand >= 2 and max_terms >= 2, got {max_operand}, {max_terms}")
        rng = random.Random(f"arithmetic-{seed}")
        seen: set[str] = set()
        items: list[tuple[str, int]] = []
        tries = 0
        while len(items) < num_train + num_eval:
            tries += 1
            if tries > 50 * (num_train + num_eval):
                raise ValueError(f"only {len(items)} distinct expressions with max_operand={max_operand}, "
                                 f"max_terms={max_terms}; ask for fewer than {num_train + num_eval}")
            expr, value = make_expression(rng, max_operand, rng.randint(2, max_terms))
            if expr not in seen:
                seen.add(expr)
                items.append((expr, value))
        self._eval = [self._prompt(i, "eval", *items[i]) for i in range(num_eval)]
        self._train = [self._prompt(i, "train", *items[num_eval + i]) for i in range(num_train)]

    @staticmethod
    def _prompt(i: int, role: str, expr: str, value: int) -> Prompt:
        return Prompt(f"arith-{role}-{i:06d}", TEMPLATE.format(expr=expr), str(value),
                      {"expression": expr, "terms": expr.count(" ") // 2 + 1})

    def train_prompts(self) -> list[Prompt]:
        return list(self._train)

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    def reward(self, prompt: Prompt, response: str) -> float:
        return math_reward(prompt, response)
