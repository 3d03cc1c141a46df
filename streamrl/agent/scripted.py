"""Scripted multi-turn environments for the tiny policy: one synthetic chain per turn.

The trajectory opens with the row's prompt; after each answer the env scores it and asks the
next chain, 1 to 4 turns in all (drawn from the row's id, so trajectories differ in their number
of turns). Reward: 1/turns per exactly solved chain, so a perfect trajectory scores 1.0.
``task.env: streamrl.agent.scripted:ChainEnv`` with ``task.name: synthetic``. ``SlowChainEnv``
also waits like a remote tool of variable latency on each step (``streamrl bench agent``).
"""

import random
import time

from streamrl.tasks.synthetic import make_problem, solve


class ChainEnv:
    max_turns = 4

    def __init__(self, row):
        rng = random.Random(row["prompt_id"])
        self.turns = 1 + rng.randrange(self.max_turns)
        self.prompts = [row["prompt"]] + [make_problem(rng)[0] for _ in range(self.turns - 1)]
        self.k = 0

    def reset(self):
        return self.prompts[0]

    def step(self, assistant_text):
        solution, _ = solve(self.prompts[self.k])
        reward = float(assistant_text.strip() == solution) / self.turns
        self.k += 1
        if self.k == self.turns:
            return None, reward, True
        return self.prompts[self.k], reward, False


class SlowChainEnv(ChainEnv):
    """ChainEnv whose every step first waits like a call to a remote tool: log-uniform between
    ``latency_s`` (drawn from the row's id and the step, so a rerun waits the same)."""

    latency_s = (0.02, 0.5)

    def step(self, assistant_text):
        lo, hi = self.latency_s
        rng = random.Random(f"{self.prompts[0]}/{self.k}")
        time.sleep(lo * (hi / lo) ** rng.random())
        return super().step(assistant_text)
