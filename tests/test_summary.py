from reports.summary import RoundSummary, RunSummary, format_table


def summary(base: float, best: float | None, eval_tasks: int = 64) -> RunSummary:
    round_ = RoundSummary(
        round_index=1,
        policy_version="p1" if best is not None else None,
        parent_version="base",
        adapter_path=None,
        rollouts=8,
        successes=2,
        train_tokens=10,
        eval_pass_at_1=best,
        eval_format_rate=0.0,
        promoted=False,
    )
    return RunSummary(
        base_model="base",
        taskset="arithmetic",
        baseline_pass_at_1=base,
        baseline_format_rate=0.0,
        eval_tasks=eval_tasks,
        db_url="sqlite://",
        rounds=[round_],
    )


def test_the_verdict_weighs_the_change_against_evaluation_noise() -> None:
    assert "no clear change" in format_table(summary(0.266, 0.297))
    assert format_table(summary(0.2, 0.6)).endswith(
        "improved: best held-out pass@1 0.600 vs base 0.200, "
        "gain +0.400 (95% +0.245 to +0.555; 64 tasks, unpaired)."
    )
    assert "worse:" in format_table(summary(0.6, 0.2))
    assert "improved" in format_table(summary(0.266, 0.297, eval_tasks=20_000))
    assert "no round produced a new version" in format_table(summary(0.2, None))


def test_the_verdict_is_paired_when_per_task_counts_are_known() -> None:
    run = summary(0.266, 0.406)
    gained = run.model_copy(
        update={"rounds": [run.rounds[0].model_copy(update={"eval_gained": 13, "eval_lost": 4})]}
    )
    table = format_table(gained)
    assert table.endswith(
        "improved: best held-out pass@1 0.406 vs base 0.266, "
        "gain +0.141 (95% +0.018 to +0.263; 13 tasks gained, 4 lost of 64)."
    )
    assert "0.266   0.17-0.38" in table and "0.406   0.29-0.53" in table
    mixed = run.model_copy(
        update={"rounds": [run.rounds[0].model_copy(update={"eval_gained": 10, "eval_lost": 6})]}
    )
    assert "no clear change" in format_table(mixed)


def test_a_time_budget_starts_a_round_only_while_the_time_left_covers_the_last_one() -> None:
    from flows.flywheel import _time_for_a_round

    first = summary(0.2, 0.3).rounds[0].model_copy(update={"started_s": 60.0, "ended_s": 360.0})
    assert _time_for_a_round(None, 10_000.0, [first])
    assert _time_for_a_round(1.0, 10_000.0, [])  # the first round always starts
    assert _time_for_a_round(11.0, 360.0, [first])  # 360 + 300 <= 660
    assert not _time_for_a_round(10.0, 360.0, [first])  # 660 > 600


def test_the_table_gives_each_stages_seconds_and_the_training_hidden_beside_collection() -> None:
    seconds = {"collect": 330.4, "train": 180.0, "hidden": 120.0, "evaluate": 40.0, "total": 620.0}
    run = summary(0.266, 0.297).model_copy(update={"wall_seconds": seconds})
    assert ("seconds: collect 330, train 180, evaluate 40; 620 s in all "
            "(120 s of training ran beside collection); the policy's server had work 60% of "
            "it") in format_table(run)  # fmt: skip
    assert "seconds:" not in format_table(summary(0.266, 0.297))


def test_the_serving_share_counts_the_run_after_the_servers_start() -> None:
    from reports.summary import serving_share

    seconds = {"server_start": 60.0, "baseline": 20.0, "collect": 170.0, "train": 140.0}
    assert serving_share(seconds | {"evaluate": 30.0, "total": 460.0}) == 0.55
    assert serving_share(seconds) is None  # no total: a run cut short
