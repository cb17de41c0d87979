import pytest

from areal_agents.rewards.extract import extract_answer, strip_thinking


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("We get $\\boxed{\\frac{1}{\\sqrt{2}}}$.", "\\frac{1}{\\sqrt{2}}"),  # nested braces
        ("First \\boxed{3}, corrected: \\boxed{4}", "4"),  # the last box wins
        ("\\fbox{x+1}", "x+1"),
        ("so \\boxed 7 is it", "7"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces inside
        ("Adding them up, the answer is 42.", "42"),
        ("Final answer: $x = 3$", "x = 3"),
        ("The final answer is $10,455$. I hope it is correct.", "10,455"),
        ("... which gives 1,234 apples", "1234"),  # the last number, thousands separators dropped
        ("the ratio is 3/4", "3/4"),
        ("<think>maybe \\boxed{1}?</think>It is \\boxed{2}.", "2"),  # only after the thinking
        ("no numbers here", None),
    ],
)
def test_extract_auto(completion, answer):
    assert extract_answer(completion) == answer


def test_unclosed_thinking_has_no_answer():
    assert strip_thinking("<think> still thinking \\boxed{5}") == ""
    assert extract_answer("<think> still thinking \\boxed{5}") is None


def test_modes():
    text = "the answer is 5 and \\boxed{6} then 7"
    assert extract_answer(text, "boxed") == "6"
    assert extract_answer(text, "answer_is") == "5 and \\boxed{6} then 7"
    assert extract_answer(text, "last_number") == "7"
    with pytest.raises(ValueError, match="mode"):
        extract_answer(text, "first")  # type: ignore[arg-type]


HOSTILE = {
    # (text, the answer); before extraction was linear, the first three took minutes to hours
    "'answer is' then 5,000 spaces": ("the answer is 1" + " " * 5_000 + "x", "1" + " " * 5_000 + "x"),
    "100,000 unclosed boxes": ("\\boxed{" * 100_000, None),
    "a closed box, then 10,000 unclosed ones": ("\\boxed{4} " + "\\boxed{" * 10_000, "4"),
    "5 MB of text": ("a" * 5_000_000 + " so the answer is 7.", "7"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_extraction_is_linear_on_hostile_text(name, finishes_within):
    text, answer = HOSTILE[name]
    assert finishes_within(2.0, extract_answer, text) == answer
