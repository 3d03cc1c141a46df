"""The synthetic long-tail task: verifiable, deterministic, long-tailed."""

import random

import pytest

from streamrl.metrics.stats import spearman
from streamrl.tasks.stats import check_criteria, length_figures
from streamrl.tasks.synthetic import SyntheticSpec, SyntheticTask, make_problem, solve


def test_generated_solutions_match_the_solver():
    rng = random.Random(1)
    for _ in range(2000):
        prompt, solution, answer = make_problem(rng)
        assert solve(prompt) == (solution, answer)


def test_hand_worked_examples():
    assert solve("U 194,3:") == ("197 200 =200", "200")
    assert solve("U 95,1:") == ("96 97 98 99 100 =100", "100")
    assert solve("U 300,50:") == ("350 400 =400", "400")  # from a hundred, up to the next one
    assert solve("D 203,2:") == ("201 199 =199", "199")
    assert solve("D 900,1:") == ("899 =899", "899")
    assert solve("D 1000,3:") == ("997 =997", "997")


@pytest.mark.parametrize("bad", ["X 12,3:", "U 12:", "U a,b:", "D 99,1:", "U 5,0:", ""])
def test_malformed_prompts_are_rejected_naming_the_prompt(bad):
    with pytest.raises(ValueError, match="synthetic"):
        solve(bad)


def test_step_counts_cover_the_configured_range_and_each_chain_stays_inside_one_hundred():
    rng = random.Random(2)
    spec = SyntheticSpec(max_steps=40)
    steps = []
    for _ in range(3000):
        prompt, solution, _ = make_problem(rng, spec)
        values = [int(v) for v in solution.split(" =")[0].split()]
        a = int(prompt[2:].split(",")[0])
        assert {v // 100 for v in values[:-1]} <= {a // 100}  # all but the last stay in a's hundred
        assert values[-1] // 100 != a // 100
        steps.append(len(values))
    assert min(steps) == 1 and max(steps) == 40
    with pytest.raises(ValueError, match="max_steps"):
        SyntheticSpec(max_steps=101)


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
    p = Prompt(prompt_id="x", text="D 203,1:", answer="199", meta={"solution": "202 201 200 199 =199"})
    assert task.reward(p, "202 201 200 199 =199") == 1.0
    assert task.reward(p, "202 201 =201") == pytest.approx(0.5 * 2 / 5)
    assert task.reward(p, "202 209 200 199 =199") == pytest.approx(0.5 * 1 / 5)
    assert task.reward(p, "=199") == 0.0
    assert max(task.reward(p, r) for r in ["202 201 200 199", "202 201 200 199 =198", "202 201 200 199 198 =198"]) < 1.0
    assert task.reward(p, "202 201 200 199 198 197 =197") == pytest.approx(0.5 * 4 / 7)  # overshoot costs credit
    with pytest.raises(ValueError, match="partial_credit"):
        SyntheticTask(num_train=1, num_eval=1, partial_credit=1.0)
