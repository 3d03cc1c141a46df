"""The synthetic long-tail task: verifiable, deterministic, long-tailed."""

import random

import pytest

from streamrl.tasks.stats import check_criteria, length_figures, spearman
from streamrl.tasks.synthetic import SyntheticTask, make_problem, solve


def test_generated_solutions_match_the_solver():
    rng = random.Random(1)
    for _ in range(2000):
        prompt, solution, answer = make_problem(rng)
        assert solve(prompt) == (solution, answer)


def test_hand_worked_examples():
    assert solve("D 23,20:") == ("22 21 20 =20", "20")
    assert solve("U 5,3,10:") == ("8 11 =11", "11")
    assert solve("S 4819:") == ("4 2 3 2 =2", "2")


def test_reward_requires_the_whole_chain():
    task = SyntheticTask(num_train=10, num_eval=10)
    p = next(p for p in task.eval_prompts() if len(p.meta["solution"].split()) > 3)
    assert task.reward(p, p.meta["solution"]) == 1.0
    assert task.reward(p, "=" + p.answer) == 0.0  # right answer, no work shown
    assert task.reward(p, "") == 0.0
    assert task.reward(p, "\x00garbage=") == 0.0


def test_eval_set_is_fixed_and_disjoint_from_train():
    a, b = SyntheticTask(num_train=500, num_eval=64, seed=0), SyntheticTask(num_train=500, num_eval=64, seed=3)
    assert [p.text for p in a.eval_prompts()] == [p.text for p in b.eval_prompts()]
    assert not {p.text for p in a.eval_prompts()} & {p.text for p in a.train_prompts()}
    assert [p.text for p in a.train_prompts()] != [p.text for p in b.train_prompts()]


def test_reference_solutions_are_long_tailed_and_not_a_function_of_prompt_length():
    task = SyntheticTask(num_train=4000, num_eval=1)
    prompts = task.train_prompts()
    figs = length_figures([len(p.text) + 1 for p in prompts], [len(p.meta["solution"]) + 1 for p in prompts])
    assert all(check_criteria(figs).values()), figs


def test_spearman_handles_ties_and_matches_hand_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks x: 1,2,3 ; y with a tie: 1.5,1.5,3 -> corr = 0.866
    assert spearman([1, 2, 3], [5, 5, 9]) == pytest.approx(0.8660254, abs=1e-6)


def test_partial_credit_rewards_a_correct_prefix_but_never_as_much_as_the_solution():
    from streamrl.types import Prompt

    task = SyntheticTask(num_train=1, num_eval=1, partial_credit=0.5)
    p = Prompt(prompt_id="x", text="D 23,20:", answer="20", meta={"solution": "22 21 20 =20"})
    assert task.reward(p, "22 21 20 =20") == 1.0
    assert task.reward(p, "22 21 =21") == pytest.approx(0.5 * 2 / 4)
    assert task.reward(p, "22 19 20 =20") == pytest.approx(0.5 * 1 / 4)
    assert task.reward(p, "=20") == 0.0
    assert max(task.reward(p, r) for r in ["22 21 20", "22 21 20 =19", "22 21 20 19 =19"]) < 1.0
    assert task.reward(p, "22 21 20 19 18 17 =17") == pytest.approx(0.5 * 3 / 7)  # overshoot costs credit
    with pytest.raises(ValueError, match="partial_credit"):
        SyntheticTask(num_train=1, num_eval=1, partial_credit=1.0)
