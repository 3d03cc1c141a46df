"""A scripted multi-turn environment for the tiny policy: one synthetic chain per turn.

The trajectory opens with the row's prompt; after each answer the env scores it and asks the
next chain, 1 to 4 turns in all (drawn from the row's id, so trajectories differ in their number
of turns). Reward: 1/turns per exactly solved chain, so a perfect trajectory scores 1.0.
``task.env: examples/agent/chain_env.py:ChainEnv`` with ``task.name: synthetic``.
"""

import random

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
