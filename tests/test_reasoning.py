import pytest

from verifiers.errors import VerifierError
from verifiers.reasoning import eval_tasks, train_tasks, verify


def test_held_out_tasks_are_never_train_tasks() -> None:
    held_out = eval_tasks("arithmetic", 64)
    questions = {t.question for t in held_out}
    for seed in range(1, 6):
        train = train_tasks("arithmetic", 32, seed=seed, held_out=held_out)
        assert len({t.task_id for t in train}) == 32
        assert not questions & {t.question for t in train}


def test_tasks_are_deterministic() -> None:
    assert eval_tasks("chain_sum", 8) == eval_tasks("chain_sum", 8)


def test_unknown_task_set_is_a_clear_error() -> None:
    with pytest.raises(VerifierError, match="unknown task set 'nope'"):
        eval_tasks("nope", 4)


def test_verify_rewards_only_correct_answers() -> None:
    task = eval_tasks("arithmetic", 1)[0]
    tagged = verify(task, f"<answer>{task.answer}</answer>")
    untagged = verify(task, f"the result is {task.answer}")
    wrong = verify(task, "<answer>123456</answer>")
    hacked = verify(task, f"<answer></answer><answer>{task.answer}</answer>")
    assert (tagged.reward, tagged.correct, tagged.format_ok) == (1.0, True, True)
    assert (untagged.reward, untagged.correct, untagged.format_ok) == (0.5, True, False)
    assert (wrong.reward, wrong.correct) == (0.0, False)
    assert (hacked.reward, hacked.correct) == (0.0, False)


def test_a_correct_answer_its_own_working_contradicts_earns_nothing() -> None:
    task = next(t for t in eval_tasks("arithmetic", 32) if int(t.answer) < 0)
    flipped = verify(task, f"so = {-int(task.answer)}. <answer>{task.answer}</answer>")
    faithful = verify(task, f"so = {task.answer}. <answer>{task.answer}</answer>")
    assert (flipped.reward, flipped.correct) == (0.0, True)
    assert flipped.reason == f"correct, but the working before it ends in = {-int(task.answer)}"
    assert (faithful.reward, faithful.correct) == (1.0, True)


@pytest.mark.parametrize(
    ("reply", "correct"),
    [("<answer>x = {a}</answer>", True), ("<answer>{a}.0</answer>", True),
     ("<answer>\\frac{{{b}}}{{2}}</answer>", True), ("<answer>{a} or 99</answer>", False),
     ("<answer>99</answer>", False), ("<answer>" + "1+" * 300 + "1</answer>", False)],
)  # fmt: skip
def test_math_answers_are_checked_for_equivalence(reply: str, correct: bool) -> None:
    task = eval_tasks("equations", 1)[0]
    answer = int(task.answer)
    verdict = verify(task, reply.format(a=answer, b=2 * answer))
    assert verdict.correct is correct


def test_math_verification_works_off_the_main_thread() -> None:
    import threading

    task = eval_tasks("equations", 1)[0]
    verdicts = []
    thread = threading.Thread(
        target=lambda: verdicts.append(verify(task, f"<answer>{task.answer}</answer>"))
    )
    thread.start()
    thread.join()
    assert verdicts[0].correct
