"""The exploration benchmark's accounting: what counts as solved within a budget, and what the
guidance found that bare attempts did not."""

from __future__ import annotations

from bench.explore import compare, guidance_found, solved_within, source
from tests.helpers import make_group, with_attempts


def test_sources_and_the_tasks_only_guidance_solved() -> None:
    bare_win = make_group([0.0, 1.0])
    first, second = make_group([1.0, 0.0], task_id="t2").attempts
    strategy_win = [first.model_copy(update={"strategy": "count up"}), second]
    guided_win = make_group([0.0, 1.0], task_id="t3").attempts
    guided_win = [guided_win[0], guided_win[1].model_copy(update={"context": "demo"})]
    retry = make_group([1.0], task_id="t4").attempts[0].model_copy(update={"kind": "retry"})
    reflection = retry.model_copy(update={"kind": "reflection", "correct": True})
    lost = make_group([0.0, 0.0], task_id="t4")
    groups = [
        [bare_win],
        [with_attempts(bare_win, strategy_win)],
        [with_attempts(bare_win, guided_win)],
        [with_attempts(lost, [*lost.attempts, reflection, retry])],
    ]
    assert [source(a) for a in strategy_win + guided_win] == ["strategy", "bare", "bare", "guided"]
    found = guidance_found(groups)
    assert found["successes_by_source"] == {"bare": 1, "strategy": 1, "guided": 1, "retry": 1}
    assert found["tasks_only_guidance_solved"] == 3  # a reflection is not a success


def test_a_success_past_the_budget_is_not_solved_and_pairs_are_counted() -> None:
    group = make_group([0.0, 0.0, 1.0])
    late = with_attempts(
        group, [a.model_copy(update={"generated_tokens": 5}) for a in group.attempts]
    )
    # the success ends at token 15
    assert solved_within([late], budget=15) and not solved_within([late], budget=14)
    method = {"solved_per_task": [True, True, False], "solved": 2 / 3}
    method |= {"solved_at_cost_per_task": [True, False, False], "solved_at_cost": 1 / 3}
    plain = {"solved_per_task": [False, True, True], "solved": 2 / 3, "solved_at_cost": 2 / 3}
    compare({"m": method}, plain)
    assert (method["solved_not_plain"], method["plain_not_solved"]) == (1, 1)
    assert method["solved_vs_plain"] == 1.0 and method["solved_at_cost_vs_plain"] == 0.5


def test_a_revision_spends_the_budget_but_is_not_the_policys_success() -> None:
    from bench.explore import policy_own

    group = make_group([0.0, 0.0])
    revision = group.attempts[0].model_copy(
        update={"kind": "revision", "policy_version": "reviewer", "correct": True, "reward": 1.0,
                "generated_tokens": 20}
    )  # fmt: skip
    revised = with_attempts(group, [*group.attempts, revision])
    own = policy_own("base")
    assert solved_within([revised], budget=1000)  # any verified success
    assert not solved_within([revised], budget=1000, counts=own)  # the reviewer's answer
    later = make_group([1.0], task_id="t1")
    assert solved_within([revised, later], budget=1000, counts=own)  # the policy's own, later
    assert not solved_within([revised, later], budget=19, counts=own)  # the revision spent it


def test_a_method_is_set_against_plain_sampling_at_equal_wall_time() -> None:
    """Measured cost: the tasks the policy solved in the method's run against those plain
    sampling had solved after as many seconds; a revision's success is not the policy's."""
    from bench.explore import at_equal_time, first_solved, policy_own

    lost, won = make_group([0.0, 0.0]), make_group([0.0, 1.0])
    counts = policy_own(won.attempts[0].policy_version)
    assert first_solved([lost, won, won], [3.0, 7.0, 9.0], counts) == 7.0
    revised = with_attempts(lost, [*lost.attempts, won.attempts[1].model_copy(
        update={"kind": "revision"})])  # fmt: skip
    assert first_solved([revised], [2.0], counts) is None
    plain = {"seconds": 100.0, "policy_solved_at_second_per_task": [10.0, 60.0, None, 90.0]}
    method = {"seconds": 50.0, "policy_solved_at_second_per_task": [40.0, 45.0, 30.0, None]}
    results = {"plain": plain, "r3l": method}
    at_equal_time(results, plain)
    timed = method["equal_time"]
    assert timed["plain_solved"] == 0.25 and timed["policy_solved"] == 0.75  # plain: 10 s only
    assert timed["ratio"] == 3.0 and not timed["plain_ran_out"]
    assert "equal_time" not in plain
    longer = {"seconds": 150.0, "policy_solved_at_second_per_task": [1.0, None, None, None]}
    at_equal_time({"plain": plain, "slow": longer}, plain)
    assert longer["equal_time"]["plain_ran_out"] and longer["equal_time"]["plain_solved"] == 0.75


def test_the_reviewer_answering_itself_counts_as_the_reviewers_work() -> None:
    from bench.explore import at_equal_time, figures

    def arm(seconds: list[float | None]) -> dict:
        solved = [s is not None for s in seconds]
        return {"seconds": 100.0, "policy_solved_at_second_per_task": seconds,
                "solved_at_cost_per_task": solved,
                "policy_solved_at_cost_per_task": solved}  # fmt: skip

    plain, reviewer = arm([10.0, None]), arm([5.0, 20.0])
    result = {"methods": {"plain": plain, "reviewer": reviewer}}
    at_equal_time(result["methods"], plain)
    found = {f.name: f for f in figures(result)}
    mine = found["reviewer: solved by the reviewer answering itself"]
    assert mine.value == 1.0 and mine.counts == "reviewer"
    timed = found[
        "reviewer minus plain at equal wall time, solved by the reviewer against the policy"
    ]
    assert timed.value == 0.5 and timed.counts == "reviewer"
    assert not [f for f in found if f.startswith("reviewer") and "policy itself" in f]


def test_retries_are_counted_with_those_that_kept_a_pivot() -> None:
    from bench.explore import figures

    solved = [True, False]
    r3l = {"solved_at_cost_per_task": solved, "policy_solved_at_cost_per_task": solved,
           "retries": 4, "retries_from_a_pivot": 3, "retries_verified": 1}  # fmt: skip
    found = {f.name: f for f in figures({"methods": {"r3l": r3l}})}
    kept = found["r3l: retries that kept the parent's first steps"]
    assert (kept.value, kept.n, kept.counts) == (0.75, 4, "policy")
    assert found["r3l: retries the verifier passed"].value == 0.25
