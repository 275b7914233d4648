import pytest

from verifiers.answer import extract_answer


@pytest.mark.parametrize(
    ("text", "answer", "format_ok"),
    [
        ("so <answer>42</answer>", "42", True),
        ("<ANSWER> -7 </ANSWER>", "-7", True),
        ("it is 12, no wait 13", "13", False),
        ("<answer></answer>", None, False),
        ("<answer>   </answer> 5", None, False),
        ("<answer>1</answer><answer>2</answer>", None, False),
        ("<answer>1 <answer>2</answer>", None, False),
        ("<answer>12", None, False),
        ("12</answer>", None, False),
        ("no digits here", None, False),
        ("\x00<answer>3</answer>\x00", "3", True),
        ("```\n<answer>5</answer>\n```", None, False),
        ("```python\nprint(5)\n```", None, False),
        ("```python\nprint(5)", None, False),
        ("```<answer>5</answer>``` so <answer>6</answer>", "6", True),
    ],
)
def test_extraction_resists_format_hacks(text: str, answer: str | None, format_ok: bool) -> None:
    result = extract_answer(text)
    assert result.answer == answer
    assert result.format_ok is format_ok


@pytest.mark.parametrize(
    ("text", "stated", "contradicted"),
    [
        ("7 - 9 = -2. <answer>-2</answer>", "-2", False),
        ("7 - 9 = 2. <answer>-2</answer>", "2", True),
        ("(-4) * 2 = (-8) <answer>-8.0</answer>", "-8", False),
        ("x = 7 - 4 = 3.\n<answer>4</answer>", "3", True),
        ("7 - 9 = 2, so the answer is <answer>-2</answer>", None, False),
        ("the sum is = 5 <answer>five</answer>", "5", False),
        ("<answer>3</answer>", None, False),
    ],
)
def test_the_result_the_working_ends_on_is_read(
    text: str, stated: str | None, contradicted: bool
) -> None:
    result = extract_answer(text)
    assert (result.stated, result.contradicted) == (stated, contradicted)
