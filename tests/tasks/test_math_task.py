"""Math task: loading jsonl/parquet (good and malformed rows), splits, and math_verify rewards."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from streamrl.config import TaskConfig
from streamrl.tasks.base import default_data_dir
from streamrl.tasks.math import DataError, MathTask, RowSpec, extract_final_answer, load_math_items, math_reward
from streamrl.types import Prompt

GARBAGE = [
    "",
    "\x00\xff\x89PNG\r\n\x1a\n" * 64,
    "{" * 10_000,
    "}" * 10_000,
    "\\boxed{" * 2_000,
    "\\boxed{\\frac{1}{",
    "\\frac{\\sqrt{\\left(",
    "$$$$ \\int\\int \\begin{pmatrix} & \\\\",
    "\\boxed{" + "\\frac{" * 300 + "}",
    "the answer is \\boxed{}",
]


def data_file(name: str) -> Path:
    path = default_data_dir() / name
    if not path.is_file():
        pytest.skip(f"../shared/data not found: {path} (set STREAMRL_DATA_DIR)")
    return path


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def gsm8k_line(question: str = "What is 2+3?", answer: str = "2+3=5\n#### 5") -> str:
    return json.dumps({"question": question, "answer": answer})


@pytest.fixture(scope="module")
def gsm8k() -> MathTask:
    return MathTask(data_file("gsm8k_test.jsonl"), name="gsm8k", fmt="gsm8k", num_train=40, num_eval=10)


@pytest.fixture(scope="module")
def math500() -> MathTask:
    return MathTask(data_file("math500_test.jsonl"), name="math500", fmt="math500", num_train=40, num_eval=10)


def test_gsm8k_reference_answer_scores_one_and_wrong_answer_zero(gsm8k: MathTask) -> None:
    for p in gsm8k.train_prompts()[:20]:
        assert math_reward(p, f"Let me think. The answer is \\boxed{{{p.answer}}}.") == 1.0, p
        assert math_reward(p, f"so she makes {p.answer} dollars") == 1.0, p  # last number, no box
        wrong = str(int(float(p.answer)) + 1)
        assert math_reward(p, f"The answer is \\boxed{{{wrong}}}.") == 0.0, p


def test_gsm8k_reference_solution_text_scores_one(gsm8k: MathTask) -> None:
    rows = [json.loads(line) for line in data_file("gsm8k_test.jsonl").read_text().splitlines()[:10]]
    for i, row in enumerate(rows, start=1):
        p = Prompt(f"gsm8k-{i:06d}", row["question"], row["answer"].split("####")[-1].strip().replace(",", ""))
        assert math_reward(p, row["answer"]) == 1.0, row["answer"]


def test_math500_reference_answer_scores_one_and_other_answer_zero(math500: MathTask) -> None:
    prompts = math500.train_prompts()[:20]
    for p, other in zip(prompts, prompts[1:] + prompts[:1]):
        assert math_reward(p, f"Therefore the answer is $\\boxed{{{p.answer}}}$.") == 1.0, p.answer
        if other.answer != p.answer:
            assert math_reward(p, f"\\boxed{{{other.answer}}}") == 0.0, (p.answer, other.answer)


def test_math500_reference_solution_scores_one() -> None:
    rows = [json.loads(line) for line in data_file("math500_test.jsonl").read_text().splitlines()[:10]]
    for row in rows:
        p = Prompt(row["unique_id"], row["problem"], row["answer"])
        assert math_reward(p, row["solution"]) == 1.0, (row["answer"], row["solution"][-120:])


@pytest.mark.parametrize("garbage", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_response_neither_crashes_nor_scores(gsm8k: MathTask, math500: MathTask, garbage: str) -> None:
    for p in gsm8k.eval_prompts()[:2] + math500.eval_prompts()[:2]:
        assert math_reward(p, garbage) == 0.0


def test_final_answer_is_last_complete_box_else_last_number() -> None:
    assert extract_final_answer("\\boxed{1} then \\boxed{\\frac{2}{3}}") == ("boxed", "\\frac{2}{3}")
    assert extract_final_answer("\\boxed{7} and a broken \\boxed{\\frac{1}{") == ("boxed", "7")
    assert extract_final_answer("costs $1,234.50 after 3 days") == ("number", "3")
    assert extract_final_answer("total: 1,234") == ("number", "1234")
    assert extract_final_answer("no digits here") is None


def test_split_is_deterministic_by_seed_and_disjoint() -> None:
    path = data_file("math500_test.jsonl")
    a = MathTask(path, name="m", num_train=300, num_eval=100, seed=1)
    b = MathTask(path, name="m", num_train=300, num_eval=100, seed=1)
    c = MathTask(path, name="m", num_train=300, num_eval=100, seed=2)
    ids = lambda prompts: [p.prompt_id for p in prompts]  # noqa: E731
    assert ids(a.train_prompts()) == ids(b.train_prompts()) and ids(a.eval_prompts()) == ids(b.eval_prompts())
    assert ids(a.eval_prompts()) != ids(c.eval_prompts())
    assert not set(ids(a.train_prompts())) & set(ids(a.eval_prompts()))
    assert len(a.train_prompts()) == 300 and len(a.eval_prompts()) == 100
    assert len(set(ids(a.train_prompts()))) == 300


def test_prompt_text_wraps_problem_and_asks_for_boxed_answer(gsm8k: MathTask) -> None:
    p = gsm8k.eval_prompts()[0]
    assert p.meta["problem"] in p.text and "\\boxed{}" in p.text
    assert p.prompt_id == f"gsm8k-{p.meta['line']:06d}"


def test_parquet_round_trip_matches_jsonl(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1:,}"} for i in range(998, 1003)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "small.parquet")
    write_jsonl(tmp_path / "small.jsonl", [json.dumps(r) for r in rows])
    from_parquet, report = load_math_items(tmp_path / "small.parquet", fmt="gsm8k")
    from_jsonl, _ = load_math_items(tmp_path / "small.jsonl", fmt="gsm8k")
    assert from_parquet == from_jsonl
    assert [i.answer for i in from_parquet] == ["999", "1000", "1001", "1002", "1003"]
    assert report.rows_read == 5 and report.rows_skipped == 0
    task = MathTask(tmp_path / "small.parquet", name="pq", num_train=10, num_eval=1)
    p = task.train_prompts()[0]
    assert math_reward(p, f"\\boxed{{{p.answer}}}") == 1.0


def bad_file(tmp_path: Path) -> Path:
    return write_jsonl(
        tmp_path / "bad.jsonl",
        [
            gsm8k_line(),  # 1 ok
            '{"question": "unterminated', # 2 bad JSON
            json.dumps({"question": "no answer here"}),  # 3 missing field
            "",  # 4 blank: not a row
            json.dumps({"question": 12, "answer": "#### 1"}),  # 5 non-string field
            json.dumps({"question": "q", "answer": "no final marker"}),  # 6 no '#### N'
            json.dumps(["a", "list"]),  # 7 not an object
            gsm8k_line("What is 1+1?", "#### 2"),  # 8 ok
        ],
    )


def test_bad_rows_are_skipped_counted_and_logged_with_line_numbers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = bad_file(tmp_path)
    with caplog.at_level(logging.WARNING):
        items, report = load_math_items(path, fmt="gsm8k", on_bad_row="skip")
    assert [i.line for i in items] == [1, 8]
    assert report.rows_read == 7 and report.rows_kept == 2 and report.rows_skipped == 5
    reasons = {s.line: s.reason for s in report.skipped}
    assert sorted(reasons) == [2, 3, 5, 6, 7]
    assert "invalid JSON" in reasons[2]
    assert "missing field 'answer'" in reasons[3]
    assert "field 'question' must be a string, got int" in reasons[5]
    assert "####" in reasons[6]
    assert "JSON object" in reasons[7]
    logged = [r.getMessage() for r in caplog.records]
    assert any(f"{path} line 3: missing field 'answer'" in m for m in logged), logged
    assert report.metrics()["task/rows_skipped"] == 5.0


def test_bad_row_in_raise_mode_names_file_line_and_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [gsm8k_line(), json.dumps({"question": "q"})])
    with pytest.raises(DataError, match=rf"{path}:2: missing field 'answer'"):
        load_math_items(path, fmt="gsm8k", on_bad_row="raise")
    path = write_jsonl(tmp_path / "bad2.jsonl", ["{not json", gsm8k_line()])
    with pytest.raises(DataError, match=rf"{path}:1: invalid JSON"):
        MathTask(path, num_eval=1, on_bad_row="raise")


def test_invalid_utf8_line_is_a_counted_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(gsm8k_line().encode() + b"\n\xff\xfe\x00junk\n" + gsm8k_line().encode() + b"\n")
    items, report = load_math_items(path)
    assert len(items) == 2 and [(s.line, "invalid UTF-8" in s.reason) for s in report.skipped] == [(2, True)]


def test_empty_or_all_bad_or_missing_file_raises_naming_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=rf"{empty}: file has no rows"):
        load_math_items(empty)
    all_bad = write_jsonl(tmp_path / "all_bad.jsonl", ["{", "[]"])
    with pytest.raises(DataError, match=r"no usable rows.*line 1: invalid JSON"):
        load_math_items(all_bad)
    with pytest.raises(DataError, match="does not exist"):
        load_math_items(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        (tmp_path / "x.txt").write_text("a,b\n")
        load_math_items(tmp_path / "x.txt")


def test_custom_columns_from_csv_datasets_dir_and_separate_eval_file(tmp_path: Path) -> None:
    rows = [{"query": f"What is {i} + {i}?", "target": str(2 * i), "topic": "add"} for i in range(12)]
    csv_path = tmp_path / "train.csv"
    csv_path.write_text("query,target,topic\n" + "".join(f'"{r["query"]}",{r["target"]},{r["topic"]}\n' for r in rows)
                        + '"broken row",1,add,extra\n')
    datasets = pytest.importorskip("datasets")
    ds_dir = tmp_path / "eval_ds"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:4])}).save_to_disk(str(ds_dir))
    cfg = TaskConfig(name="file", train_path=str(csv_path), eval_path=str(ds_dir), prompt_key="query",
                     answer_key="target", prompt_template="[{topic}] {prompt}", num_train=8, num_eval=3)
    task = MathTask.from_config(cfg, seed=1)
    train, held = task.train_prompts(), task.eval_prompts()
    assert len(train) == 8 and len(held) == 3
    assert all(p.text.startswith("[add] What is ") for p in train + held)
    assert {p.answer for p in held} <= {"0", "2", "4", "6"}
    assert train[0].meta["topic"] == "add"
    report = task.load_report()
    assert report.rows_read == 13 and report.rows_kept == 12  # the over-long csv row is skipped, named
    with pytest.raises(DataError, match="split 'validation' not in the DatasetDict"):
        MathTask.from_config(cfg.model_copy(update={"eval_split": "validation"}))


def test_template_naming_a_missing_column_rejects_the_row_naming_the_column(tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": f"p{i}", "answer": "1", **({"ctx": "c"} if i else {})}) for i in range(6)]
    path = write_jsonl(tmp_path / "t.jsonl", lines)
    task = MathTask(path, name="file", fmt=RowSpec(), template="{ctx}: {prompt}", num_train=4, num_eval=1)
    assert task.load_report().rows_kept == 5
    assert [row.line for row in task.load_report().skipped] == [1]
    assert "names {ctx}" in task.load_report().skipped[0].reason
    assert all(p.text.startswith("c: p") for p in task.train_prompts() + task.eval_prompts())


def test_math500_rows_fall_back_to_boxed_solution_and_auto_detects_format(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            json.dumps({"problem": "Compute 1/2+1/4.", "solution": "It is $\\boxed{\\frac{3}{4}}$."}),
            json.dumps({"problem": "p", "answer": "\\sqrt{2}", "level": 3}),
            gsm8k_line(),
            json.dumps({"prompt": "neither"}),
        ],
    )
    items, report = load_math_items(path, fmt="auto")
    assert [i.answer for i in items] == ["\\frac{3}{4}", "\\sqrt{2}", "5"]
    assert items[1].meta["level"] == 3
    assert report.skipped[0].line == 4 and "'question' (gsm8k) or 'problem' (math500)" in report.skipped[0].reason


def test_num_eval_must_leave_training_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "two.jsonl", [gsm8k_line(), gsm8k_line()])
    with pytest.raises(DataError, match="num_eval=2 leaves no training rows"):
        MathTask(path, num_eval=2)


def test_prompts_over_max_tokens_are_counted_skips(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "long.jsonl", [gsm8k_line(), gsm8k_line("word " * 500), gsm8k_line()])
    task = MathTask(path, num_eval=1, max_prompt_tokens=100, count_tokens=lambda s: len(s.split()))
    report = task.load_report()
    assert report.rows_kept == 2 and report.skipped[0].line == 2
    assert "max_prompt_tokens=100" in report.skipped[0].reason


def test_from_config_reads_default_shared_file() -> None:
    data_file("gsm8k_test.jsonl")
    task = MathTask.from_config(TaskConfig(name="gsm8k", num_train=50, num_eval=5), seed=3)
    assert task.name == "gsm8k" and len(task.train_prompts()) == 50 and len(task.eval_prompts()) == 5
    assert task.load_report().rows_read == 1319
    named = MathTask.from_config(TaskConfig(name="file", train_path="math500_test.jsonl", prompt_key="problem",
                                               num_train=5, num_eval=5))
    assert "subject" in named.eval_prompts()[0].meta and "Problem:" not in named.eval_prompts()[0].text
