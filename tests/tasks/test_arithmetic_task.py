"""The generated arithmetic task of the real-model recipe (tasks/arithmetic.py)."""

import pytest

from streamrl.config import load_config
from streamrl.tasks.arithmetic import ArithmeticTask
from streamrl.tasks.factory import make_task


def test_prompts_are_distinct_seeded_and_their_answers_are_the_expressions_values():
    task = ArithmeticTask(num_train=300, num_eval=40, seed=3, max_operand=20, max_terms=3)
    train, held = task.train_prompts(), task.eval_prompts()
    assert len(train) == 300 and len(held) == 40
    exprs = [p.meta["expression"] for p in train + held]
    assert len(set(exprs)) == len(exprs)  # no expression both trained on and held out
    for p in train + held:
        assert int(p.answer) == eval(p.meta["expression"]) and p.meta["expression"] in p.text
        assert 2 <= p.meta["terms"] <= 3
    assert {p.meta["terms"] for p in train} == {2, 3}
    again = ArithmeticTask(num_train=300, num_eval=40, seed=3, max_operand=20, max_terms=3)
    assert [p.text for p in again.train_prompts()] == [p.text for p in train]
    assert [p.text for p in ArithmeticTask(num_train=300, num_eval=40, seed=4, max_operand=20).train_prompts()] != \
        [p.text for p in train]


def test_the_reward_reads_the_final_number_of_a_chat_answer():
    task = ArithmeticTask(num_train=5, num_eval=5, seed=0)
    p = task.eval_prompts()[0]
    value = int(p.answer)
    assert task.reward(p, f"{p.meta['expression']} = {value}") == 1.0
    assert task.reward(p, f"The answer is \\boxed{{{value}}}.") == 1.0
    assert task.reward(p, f"It is {value + 1}.") == 0.0
    assert task.reward(p, "I cannot compute that.") == 0.0


def test_too_few_distinct_expressions_is_one_clear_error():
    with pytest.raises(ValueError, match="distinct expressions with max_operand=2"):
        ArithmeticTask(num_train=500, num_eval=10, max_operand=2, max_terms=2)


def test_the_config_selects_the_task_with_its_knobs():
    cfg = load_config(None, ["task.name=arithmetic", "task.max_operand=9", "task.max_terms=3", "task.num_train=50",
                             "task.num_eval=8"])
    task = make_task(cfg)
    assert isinstance(task, ArithmeticTask) and len(task.eval_prompts()) == 8
    assert all(int(x) <= 9 for p in task.train_prompts() for x in p.meta["expression"].split()[::2])
