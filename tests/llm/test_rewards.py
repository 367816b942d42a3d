import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edurl.llm.rewards import canonical_integer, extract_boxed, grade


@pytest.mark.parametrize(
    "reply, answer, complete, expected",
    [
        ("\\boxed{46}", "46", True, (1.0, 1.0, 1.0)),  # correct
        ("The sum is \\boxed{ 46 }", "46", True, (1.0, 1.0, 1.0)),  # spaces inside the box
        ("\\boxed{046}", "46", True, (1.0, 1.0, 1.0)),  # the same integer
        ("\\boxed{45}", "46", True, (0.0, 0.0, 1.0)),  # well formed, wrong
        ("46", "46", True, (-0.1, 0.0, 0.0)),  # right number, no box: malformed
        ("\\boxed{46", "46", True, (-0.1, 0.0, 0.0)),  # unclosed box
        ("\\boxed{}", "46", True, (-0.1, 0.0, 0.0)),  # empty box
        ("\\boxed{46}", "46", False, (0.9, 1.0, 0.0)),  # truncated before the stop token
        ("\\boxed{1} then \\boxed{46}", "46", True, (1.0, 1.0, 1.0)),  # the last box counts
        ("", "46", True, (-0.1, 0.0, 0.0)),
    ],
)
def test_worked_examples(reply, answer, complete, expected):
    g = grade(reply, answer, complete=complete)
    assert (g.reward, g.correct, g.format) == pytest.approx(expected)


def test_extract_boxed():
    assert extract_boxed("x \\boxed{7} y") == "7"
    assert extract_boxed("no box") is None


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(),
        st.text(max_size=10_000).map(lambda s: s * 2),
        st.builds(lambda a, b: a + "\\boxed{" + b, st.text(), st.text()),
    ),
    st.one_of(st.integers().map(str), st.text()),
    st.booleans(),
)
def test_grade_never_raises_and_is_bounded(reply, answer, complete):
    g = grade(reply, answer, complete=complete)
    assert g.correct in (0.0, 1.0) and g.format in (0.0, 1.0)
    assert g.reward == pytest.approx(g.correct + 0.1 * (g.format - 1.0))
    assert -0.1 <= g.reward <= 1.0


def test_long_unicode_reply():
    assert grade("é∑😀" * 4000 + "\\boxed{5}", "5").reward == 1.0
    with pytest.raises(TypeError, match="str"):
        grade(None, "5")


@pytest.mark.parametrize(
    "reply",
    [
        "\\boxed{4_6}",
        "\\boxed{\u0664\u0666}",
        "\\boxed{\uff14\uff16}",
        "\\boxed{4 6}",
        "\\boxed{46.0}",
        "\\boxed{+-46}",
    ],
)
def test_only_a_sign_and_ascii_digits_can_be_correct(reply):
    # Python's int() reads "4_6", Arabic-Indic "٤٦" and full-width "４６" as 46; the old grade did too
    assert grade(reply, "46").correct == 0.0
    assert grade("\\boxed{+46}", "46").correct == 1.0 and grade("\\boxed{-7}", "-7").correct == 1.0


def test_jsonl_answers_must_be_integers(tmp_path):
    from edurl.llm.tasks import JsonlTask

    path = tmp_path / "mine.jsonl"
    path.write_text('{"question": "Capital of France?", "answer": "Paris"}\n')
    with pytest.raises(ValueError, match=r"mine.jsonl:1: answer 'Paris' is not an integer"):
        JsonlTask(path)


def test_integers_of_thousands_of_digits_are_graded():
    # int() refuses strings of more than 4300 digits (CPython >= 3.11); grade once raised on them, so a model that
    # repeats one digit with a large max_tokens crashed a GRPO step
    many = "9" * 5000
    assert grade("\\boxed{" + many + "}", "46").correct == 0.0
    assert grade("\\boxed{" + "0" * 5000 + "46}", "46").correct == 1.0  # leading zeros, as "046"
    assert grade("\\boxed{-" + many + "}", "-" + many).correct == 1.0
    assert grade("\\boxed{" + many + "}", "-" + many).correct == 0.0


@given(st.integers(-(10**30), 10**30), st.integers(0, 3), st.sampled_from(["", "+", "-"]))
def test_canonical_integer_agrees_with_int(value, zeros, sign):
    text = (sign if value >= 0 else "-") + "0" * zeros + str(abs(value))
    assert canonical_integer(text) == str(int(text))
