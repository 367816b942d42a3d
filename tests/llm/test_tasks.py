import json

import pytest

from edurl.llm.tasks import (
    FILLER_COUNTS,
    OPENINGS,
    ArithmeticTask,
    JsonlTask,
    Problem,
    StyledProblem,
    TaskConfig,
    format_answer,
    make_problem,
)


def test_problems_are_correct_and_reproducible():
    task = ArithmeticTask(num_digits=3, ops=("+", "-"))
    a = task.sample(200, seed=1)
    assert a == task.sample(200, seed=1)
    assert a != task.sample(200, seed=2)
    for p in a:
        expr = p.question.removesuffix("=?")
        assert int(p.answer) == eval(expr)
        assert int(p.answer) >= 0  # no negatives by default
        assert max(int(x) for x in expr.replace("-", "+").split("+")) < 1000


def test_train_and_test_are_disjoint_by_construction():
    task = ArithmeticTask(num_digits=2)
    train = {p.question for p in task.sample(5000, "train", seed=0)}
    valid = {p.question for p in task.sample(500, "valid", seed=0)}
    test = {p.question for p in task.sample(1000, "test", seed=0)}
    assert train and valid and test and not train & test and not train & valid and not valid & test
    # Every possible problem has exactly one split, so no seed can make them overlap.
    for a in range(100):
        for b in range(a + 1):
            assert task.split_of(a, "+", b) in ("train", "valid", "test")
    share = sum(task.split_of(a, "+", b) == "test" for a in range(100) for b in range(100)) / 10_000
    assert 0.08 < share < 0.12
    share = sum(task.split_of(a, "+", b) == "valid" for a in range(100) for b in range(100)) / 10_000
    assert 0.035 < share < 0.065


def test_difficulty_knob_and_negatives():
    one = ArithmeticTask(num_digits=1, ops=("-",), allow_negative=True).sample(300)
    assert all(abs(int(p.answer)) < 10 for p in one)
    assert any(int(p.answer) < 0 for p in one)


def test_demonstration_format():
    p = make_problem(12, "+", 34)
    assert p == Problem("12+34=?", "46")
    assert p.demonstration() == format_answer(46) == "\\boxed{46}"
    assert p.messages() == [{"role": "user", "content": "12+34=?"}]


def test_styled_task_asks_the_same_questions_with_a_manner_drawn_per_demonstration():
    plain, styled = ArithmeticTask(ops=("+",)), ArithmeticTask(ops=("+",), styled=True)
    problems = styled.sample(600, seed=4)
    assert [(p.question, p.answer) for p in problems] == [(p.question, p.answer) for p in plain.sample(600, seed=4)]
    assert styled.sample(600, seed=4) == problems
    p = StyledProblem("12+34=?", "46", opening="The answer is ", fillers=2)
    assert p.demonstration() == "The answer is \\boxed{46} ok ok"
    assert {p.opening for p in problems} == set(OPENINGS)
    assert {p.fillers for p in problems} == set(FILLER_COUNTS)
    assert sum(p.fillers for p in problems) / 600 == pytest.approx(1.2, abs=0.15)
    assert TaskConfig(styled=True).task().styled and not TaskConfig().task().styled


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_digits": 0}, "num_digits"),
        ({"ops": ("*",)}, "ops"),
        ({"test_fraction": 1.0}, "test_fraction"),
        ({"valid_fraction": 0.95}, "valid_fraction"),
    ],
)
def test_bad_settings_are_explained(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)
    with pytest.raises(ValueError, match="split"):
        ArithmeticTask().sample(3, split="validation")


def test_an_empty_split_is_explained_instead_of_drawn_from_forever():
    task = ArithmeticTask(valid_fraction=0.0)
    assert len(task.sample(3, split="train")) == 3 and task.sample(0, split="valid") == []
    with pytest.raises(ValueError, match="no problem of the 'valid' split.*valid_fraction=0.0"):
        task.sample(1, split="valid")


def test_jsonl_task(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"question": f"Capital number {i}?", "answer": i} for i in range(60)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = JsonlTask(path, test_fraction=0.3, valid_fraction=0.0)
    train, test = task.problems["train"], task.problems["test"]
    assert len(train) + len(test) == 60 and train and test and not task.problems["valid"]
    assert not {p.question for p in train} & {p.question for p in test}
    assert all(isinstance(p.answer, str) for p in train)
    assert set(task.sample(20, "test")) <= set(test)

    path.write_text('{"question": "no answer"}\n')
    with pytest.raises(ValueError, match=r"mine.jsonl:1: expected a JSON object with 'question' and 'answer'"):
        JsonlTask(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        JsonlTask(tmp_path / "missing.jsonl")


def test_jsonl_task_refuses_a_negative_count(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"question": "1+1=?", "answer": 2}\n')
    with pytest.raises(ValueError, match="n must be an int >= 0, got -3"):  # returned [], as ArithmeticTask refuses
        JsonlTask(path, test_fraction=0.5).sample(-3)


def test_sample_refuses_a_count_that_is_not_a_whole_number(tmp_path):
    """ArithmeticTask.sample(2.5) gave 3 problems, (True) 1, and (None) a TypeError from a comparison."""
    import numpy as np

    path = tmp_path / "mine.jsonl"
    path.write_text('{"question": "1+1=?", "answer": 2}\n')
    for task in (ArithmeticTask(), JsonlTask(path, test_fraction=0.5)):
        for bad in (2.5, True, None, -1, "3"):
            with pytest.raises(ValueError, match=f"n must be an int >= 0, got {bad!r}"):
                task.sample(bad)
    assert len(ArithmeticTask().sample(np.int64(3))) == 3  # a NumPy count, as the helpers take


def test_jsonl_task_reads_line_separators_inside_strings(tmp_path):
    # json.dumps(..., ensure_ascii=False) writes U+2028 as it is; str.splitlines() split the line there
    path = tmp_path / "unicode.jsonl"
    rows = [{"question": f"line\u2028break and \u0085 next {i}?", "answer": i} for i in range(3)]
    path.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    task = JsonlTask(path)
    assert sorted(p.question for split in task.problems.values() for p in split) == sorted(r["question"] for r in rows)
