"""Exploration benchmark: tasks solved at an equal budget, per method, with 95% intervals.

For each method, every task gets groups of attempts until it has used its budget of policy
tokens (strategies, answers, retries; and reflections and judgements when the policy writes
them). A task counts as solved when a verified success comes before the budget runs out,
attempts taken in the order they were made, so the last group's overshoot earns nothing.

With `--reviewer` (a model served beside the policy, each on cores of its own) reflections and
judgements come from the reviewer, and each method is judged twice: at equal policy tokens
(reviewer tokens free) and at equal cost, where a reviewer token costs `--reviewer-cost` policy
tokens (measured by `bench/reviewer.py` on this machine: both servers busy, each on its cores).
Reported per method: the share solved with Wilson's 95% interval, the paired difference from
plain sampling on the same tasks with its 95% interval (and the tasks each solved that the other
did not), first-attempt pass@1, tokens spent, and what the method's guidance found: successes by
source (bare attempts, self-written strategies, guided prompts, retries after a reflection, the
reviewer's verified revisions of a group that all failed: HeRL; attempts with the reviewer's
hint for such a group: NudgeRL) and the tasks only guidance
solved, where none of the method's own bare attempts did. A revision is a success to train on,
written by the reviewer: its tokens are priced as the reviewer's.

Cost is also measured, not only priced: each group's finishing time is kept, and each method is
set against plain sampling at equal wall time on this machine (both servers in place, the
reviewer's prefill included): the tasks the policy itself solved in the method's whole run
against those plain sampling had solved after as many seconds. Plain sampling runs on past its
token budget (`--plain-stretch` times it) so that its clock outlasts the methods'; its figures
at the token budget are read from the same run.

`demo` shows every slot the task set's worked example; `examples` shows each group the
policy's own verified answer to the most similar task it had solved by then (`agents.examples`),
the worked example until it has one; the `-half` variants guide half of each group (EDGE's).

The `reviewer` method is the reviewer answering the tasks itself, plain sampling on its own
server: the baseline a user would pick instead of any method that uses it. Its successes are the
reviewer's, and its figures say so.

Real SmolLM2 on the CPU vLLM server.

    .venv/bin/python -m bench.explore [--tasks 128] [--budget 256] [--reviewer qwen2.5-coder-0.5b]
        [--reviewer-cost C] [--methods plain,r3l,...] [--plain-from JSON] [--server-url URL]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from agents.collector import GroupSpec, collect_group
from agents.examples import ExampleBook
from agents.insight import InsightBoard
from agents.policy import Endpoint, PolicyClient
from agents.settings import (
    AnnealSettings,
    CollectSettings,
    RetrySettings,
    ReviseSettings,
)
from agents.strategy import StrategySettings
from bench.common import ROOT, Figure, provenance, write_results
from bench.smollm2_server import policy_and_reviewer
from memory.records import FIRST_KINDS, VERIFIED_KINDS, Attempt, Group
from reports.intervals import paired_difference, wilson
from reports.table import text_table
from verifiers.catalog import train_tasks
from verifiers.task import Task

R3L, HERL = RetrySettings(enabled=True), ReviseSettings(enabled=True)
SGE = StrategySettings(enabled=True)
METHODS: dict[str, dict[str, Any]] = {
    "plain": {},
    "r3l": {"retry": R3L},  # brief reflections, the default
    "r3l-brief": {"retry": RetrySettings(enabled=True, reflection="brief")},
    "r3l-full": {"retry": RetrySettings(enabled=True, reflection="full")},
    "herl": {"revise": HERL},
    "nudge": {"nudge": True},
    "nudge+herl": {"nudge": True, "revise": HERL},
    "ead": {"anneal": AnnealSettings(enabled=True)},
    "r3l+herl": {"retry": R3L, "revise": HERL},
    "sge": {"strategy": SGE},
    "sge+r3l": {"strategy": SGE, "retry": R3L},
    "sge+r3l+insights": {"strategy": SGE, "retry": R3L, "insights": True},
    "demo": {"guided_fraction": 1.0},  # every slot shows the task set's worked example
    "demo-half": {"guided_fraction": 0.5},  # EDGE's half-groups, the worked example as guidance
    "examples": {"guided_fraction": 1.0, "own_examples": True},  # the policy's own, nearest
    "examples-half": {"guided_fraction": 0.5, "own_examples": True},
    "reviewer": {},  # the reviewer answering the tasks itself: what a user could pick instead
}
BY_REVIEWER = ("reviewer",)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--taskset", default="arithmetic")
    parser.add_argument("--tasks", type=int, default=128)
    parser.add_argument("--budget", type=int, default=256, help="policy tokens per task")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--reviewer", default=None, help="a reviewer model name or folder")
    parser.add_argument(
        "--reviewer-cost",
        type=float,
        default=None,
        help="policy tokens per reviewer token (default: bench/reviewer.py's)",
    )
    parser.add_argument(
        "--plain-from",
        type=Path,
        default=None,
        help="take the plain arm from an earlier run's JSON (the same tasks and budget)",
    )
    parser.add_argument(
        "--plain-stretch",
        type=float,
        default=2.0,
        help="plain sampling runs to this many times the budget, for the equal-time comparison",
    )
    parser.add_argument("--server-url", default=None)
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.reviewer and args.reviewer_cost is None:
        args.reviewer_cost = measured_cost(parser)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := set(methods) - set(METHODS):
        parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    tasks = train_tasks(args.taskset, args.tasks, seed=7, held_out=[])
    made = provenance()
    servers = policy_and_reviewer(args.server_url, args.port, "vllm-explore.log", args.reviewer)
    with servers as (url, model, reviewer_url, reviewer_model):
        reviewer = (reviewer_url, reviewer_model) if reviewer_url and reviewer_model else None
        results = stored_plain(parser, args) if args.plain_from else {}
        result = {"settings": {k: str(v) for k, v in vars(args).items()}, "methods": results}
        for method in methods:  # the JSON is rewritten after each method: a stop keeps them
            if method in BY_REVIEWER and reviewer is None:
                parser.error(f"{method} needs --reviewer")
            at = reviewer if method in BY_REVIEWER and reviewer else (url, model.name)
            results[method] = anyio.run(run_method, method, tasks, args, *at, reviewer)
            if "plain" in results:
                compare(results, results["plain"])
                at_equal_time(results, results["plain"])
            if args.json:
                write_results(args.json, result, made, figures(result))
    print_table(result)


def figures(result: dict[str, Any]) -> list[Figure]:
    """Per method, the share of tasks solved at equal cost, counting every verified success
    (the reviewer's revisions included) and counting only the policy's own; the latter's paired
    difference from plain sampling on the same tasks."""
    methods = result["methods"]
    plain = methods.get("plain")
    found = []
    for method, m in methods.items():
        everyone, n = m["solved_at_cost_per_task"], len(m["solved_at_cost_per_task"])
        revised = "revise" in METHODS.get(method, {})
        if revised:
            found.append(Figure.share(f"{method}: solved at equal cost, revisions counted",
                                      sum(everyone), n, "policy and reviewer"))  # fmt: skip
        # Files from before the policy's own count was kept: only unrevised methods equal it.
        own = m.get("policy_solved_at_cost_per_task", None if revised else everyone)
        if own is None:
            continue
        if method in BY_REVIEWER:
            found.append(Figure.share(f"{method}: solved by the reviewer answering itself",
                                      sum(own), n, "reviewer"))  # fmt: skip
            found += equal_time_figures(method, m.get("equal_time"), n, "reviewer")
            continue
        found.append(Figure.share(f"{method}: solved at equal cost by the policy itself",
                                  sum(own), n, "policy"))  # fmt: skip
        if retries := m.get("retries"):
            kept = m["retries_from_a_pivot"]
            found.append(Figure.share(f"{method}: retries that kept the parent's first steps",
                                      kept, retries, "policy"))  # fmt: skip
            found.append(Figure.share(f"{method}: retries the verifier passed",
                                      m["retries_verified"], retries, "policy"))  # fmt: skip
        if plain is not None and method != "plain":
            base = plain.get("policy_solved_at_cost_per_task", plain["solved_at_cost_per_task"])
            diff, low, high = paired_difference(own, base)
            found.append(Figure(f"{method} minus plain, solved by the policy at equal cost",
                                diff, n, low, high, counts="policy"))  # fmt: skip
        found += equal_time_figures(method, m.get("equal_time"), n)
    return found


def equal_time_figures(
    method: str, timed: dict[str, Any] | None, n: int, whose: str = "policy"
) -> list[Figure]:
    """The measured comparison: the tasks the method's run solved (the policy's own, or for
    the reviewer answering itself, the reviewer's), plain sampling's after as many seconds, and
    their paired difference."""
    if timed is None:
        return []
    seconds = f"{timed['seconds']:.0f} s"
    diff, low, high = timed["minus_plain"]
    ran_out = ", plain's whole run (it ended first)" if timed["plain_ran_out"] else ""
    by = "the policy itself" if whose == "policy" else f"the {whose}"
    return [
        Figure.share(f"{method}: solved by {by} in its {seconds}",
                     round(timed["policy_solved"] * n), n, whose),
        Figure.share(f"plain: solved after the same {seconds}{ran_out}",
                     round(timed["plain_solved"] * n), n, "policy"),
        Figure(f"{method} minus plain at equal wall time, solved by {by}"
               + ("" if whose == "policy" else " against the policy"),
               diff, n, low, high, counts=whose),
    ]  # fmt: skip


SAME = ("taskset", "tasks", "budget", "group_size", "max_tokens")


def stored_plain(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The plain arm of an earlier run on the same tasks (seeded), checked to match."""
    try:
        earlier = json.loads(args.plain_from.read_text())
        settings, plain = earlier["settings"], earlier["methods"]["plain"]
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"--plain-from {args.plain_from}: no plain arm there ({exc})")
    differ = [k for k in SAME if settings.get(k) != str(getattr(args, k))]
    if differ:
        parser.error(f"--plain-from {args.plain_from}: its {', '.join(differ)} differ from these")
    return {"plain": {**plain, "from": str(args.plain_from)}}


def measured_cost(parser: argparse.ArgumentParser) -> float:
    measured = ROOT / "bench" / "results" / "reviewer.json"
    if not measured.is_file():
        parser.error(f"give --reviewer-cost, or run python -m bench.reviewer --json {measured}")
    return float(json.loads(measured.read_text())["reviewer_token_cost"])


async def run_method(
    method: str,
    tasks: list[Task],
    args: argparse.Namespace,
    url: str,
    model: str,
    reviewer_at: tuple[str, str] | None,
) -> dict[str, Any]:
    settings = CollectSettings(
        group_size=args.group_size, temperature=1.0, max_tokens=args.max_tokens, **METHODS[method]
    )
    client = PolicyClient(url)
    reviewer = Endpoint(PolicyClient(reviewer_at[0]), reviewer_at[1]) if reviewer_at else None
    limiter = anyio.CapacityLimiter(args.concurrency)
    board = InsightBoard() if settings.insights else None
    examples = ExampleBook() if settings.own_examples else None
    groups: dict[str, list[Group]] = {t.task_id: [] for t in tasks}
    finished: dict[str, list[float]] = {t.task_id: [] for t in tasks}  # seconds, per group
    spent = dict.fromkeys(groups, 0)
    cost = args.reviewer_cost or 1.0
    # the reviewer answering itself spends reviewer tokens, each priced at `cost` policy tokens
    own_price = cost if method in BY_REVIEWER else 1.0
    budget = args.budget * (args.plain_stretch if method == "plain" else 1.0) / own_price
    started = time.monotonic()

    async def explore(task: Task) -> None:
        while spent[task.task_id] < budget:
            group = await collect_group(
                Endpoint(client, model), task, GroupSpec(0, "train", settings), limiter,
                board=board, reviewer=reviewer, examples=examples,
            )  # fmt: skip
            groups[task.task_id].append(group)
            finished[task.task_id].append(time.monotonic() - started)
            used = sum(a.generated_tokens for a in group.attempts if a.policy_version == model)
            spent[task.task_id] += max(used, 1)

    try:
        async with anyio.create_task_group() as tg:
            for task in tasks:
                tg.start_soon(explore, task)
    finally:
        await client.aclose()
        if reviewer is not None:
            await reviewer.client.aclose()

    def priced(attempt: Attempt, reviewer_price: float) -> float:
        price = own_price if attempt.policy_version == model else reviewer_price
        return attempt.generated_tokens * price

    at_tokens = [solved_within(gs, args.budget, lambda a: priced(a, 0.0)) for gs in groups.values()]
    at_cost = [solved_within(gs, args.budget, lambda a: priced(a, cost)) for gs in groups.values()]
    own = [solved_within(gs, args.budget, lambda a: priced(a, cost), policy_own(model))
           for gs in groups.values()]  # fmt: skip
    first = [next((a for a in gs[0].attempts if not a.guided), None) for gs in groups.values()]
    attempts = [a for gs in groups.values() for g in gs for a in g.attempts]
    reviewer_tokens = sum(a.generated_tokens for a in attempts if a.policy_version != model)
    reflections = [a for a in attempts if a.kind == "reflection"]
    revisions = [a for a in attempts if a.kind == "revision"]
    hints = [a for a in attempts if a.kind == "hint"]
    nudged = [a for a in attempts if a.kind == "nudge"]
    retries = [a for a in attempts if a.kind == "retry"]
    print(f"[{method}] done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return {
        "solved_per_task": at_tokens,
        "solved_at_cost_per_task": at_cost,
        "solved": statistics.fmean(at_tokens),
        "solved_interval": wilson(sum(at_tokens), len(at_tokens)),
        "solved_at_cost": statistics.fmean(at_cost),
        "solved_at_cost_interval": wilson(sum(at_cost), len(at_cost)),
        "policy_solved_at_cost_per_task": own,
        "policy_solved_at_cost": statistics.fmean(own),
        "policy_solved_at_second_per_task": [
            first_solved(gs, ts, policy_own(model))
            for gs, ts in zip(groups.values(), finished.values(), strict=True)
        ],
        "first_attempt_pass_at_1": statistics.fmean(bool(a and a.correct) for a in first),
        "tokens_per_task": statistics.fmean(spent.values()),
        **guidance_found(list(groups.values())),
        "reviewer_tokens_per_task": reviewer_tokens / len(tasks),
        "reflections": len(reflections),
        "reflections_valid": sum(a.format_ok for a in reflections),
        "revisions": len(revisions),
        "revisions_verified": sum(a.correct for a in revisions),
        "retries": len(retries),
        "retries_from_a_pivot": sum(a.pivot_tokens > 0 for a in retries),
        "retries_verified": sum(a.correct for a in retries),
        "hints": len(hints),
        "hints_refused": sum(a.error is not None for a in hints),
        "nudged": len(nudged),
        "nudged_verified": sum(a.correct for a in nudged),
        "attempts": len(attempts),
        "errors": sum(a.error is not None for a in attempts),
        "seconds": time.monotonic() - started,
    }


def source(attempt: Attempt) -> str:
    """What led to an attempt: nothing (bare), the policy's own strategy line, guidance in the
    prompt (a worked example, insights, lessons), a reflection (a retry), or the reviewer's
    revision of a failure (HeRL), or an attempt with the reviewer's hint (NudgeRL)."""
    if attempt.kind in ("retry", "revision", "nudge"):
        return attempt.kind
    if attempt.guided:
        return "guided"
    return "strategy" if attempt.strategy else "bare"


def guidance_found(groups_per_task: list[list[Group]]) -> dict[str, Any]:
    """Successes by source, and the tasks that guidance solved where no bare attempt did."""
    by_source: Counter[str] = Counter()
    only_guidance = 0
    for groups in groups_per_task:
        rollouts = [a for g in groups for a in g.attempts if a.kind in VERIFIED_KINDS]
        sources = [source(a) for a in rollouts if a.correct]
        by_source.update(sources)
        only_guidance += bool(sources) and "bare" not in sources
    return {"successes_by_source": dict(by_source), "tasks_only_guidance_solved": only_guidance}


def compare(results: dict[str, dict[str, Any]], plain: dict[str, Any]) -> None:
    """Each method against plain sampling on the same tasks: ratio, paired difference, and
    the tasks each solved that the other did not."""
    for figures in results.values():
        pairs = list(zip(figures["solved_per_task"], plain["solved_per_task"], strict=True))
        figures["solved_not_plain"] = sum(m and not p for m, p in pairs)
        figures["plain_not_solved"] = sum(p and not m for m, p in pairs)
        for key in ("solved", "solved_at_cost"):
            base = plain[key]
            figures[f"{key}_vs_plain"] = figures[key] / base if base else None
            figures[f"{key}_minus_plain"] = paired_difference(
                figures[f"{key}_per_task" if key == "solved" else "solved_at_cost_per_task"],
                plain["solved_per_task"],
            )


def solved_within(
    groups: list[Group],
    budget: int,
    price: Callable[[Attempt], float] | None = None,
    counts: Callable[[Attempt], bool] | None = None,
) -> bool:
    """A success before `budget` is spent (`price(attempt)`: by default its generated tokens):
    first attempts by slot, then the extras (reflections, retries, insights) in the order they
    were made. `counts(attempt)` says whose successes count (by default any attempt's); every
    attempt's price is spent either way."""
    spent = 0.0
    for group in groups:
        ordered = sorted(group.first_attempts, key=lambda a: a.sample_index)
        ordered += [a for a in group.attempts if a.kind not in FIRST_KINDS]
        for attempt in ordered:
            spent += price(attempt) if price else attempt.generated_tokens
            if spent > budget:
                return False
            if attempt.correct and (counts is None or counts(attempt)):
                return True
    return False


def first_solved(
    groups: list[Group], finished: list[float], counts: Callable[[Attempt], bool]
) -> float | None:
    """The second the first group with a success that `counts` finished, if any."""
    return next(
        (at for g, at in zip(groups, finished, strict=True)
         if any(a.correct and counts(a) for a in g.attempts)),
        None,
    )  # fmt: skip


def at_equal_time(results: dict[str, dict[str, Any]], plain: dict[str, Any]) -> None:
    """Each method's tasks solved by the policy in its whole run, against the tasks plain
    sampling had solved after as many seconds (paired on the same tasks); `plain_ran_out` where
    plain's stretched budget ended before the method's clock did (plain then counts whole)."""
    plain_at = plain.get("policy_solved_at_second_per_task")
    if plain_at is None:
        return
    for method, figures in results.items():
        own_at = figures.get("policy_solved_at_second_per_task")
        if method == "plain" or own_at is None:
            continue
        seconds = figures["seconds"]
        own = [at is not None for at in own_at]
        base = [at is not None and at <= seconds for at in plain_at]
        figures["equal_time"] = {
            "seconds": seconds,
            "plain_ran_out": plain["seconds"] < seconds,
            "policy_solved": statistics.fmean(own),
            "plain_solved": statistics.fmean(base),
            "ratio": statistics.fmean(own) / statistics.fmean(base) if any(base) else None,
            "minus_plain": paired_difference(own, base),
        }


def policy_own(model: str) -> Callable[[Attempt], bool]:
    """An attempt the policy wrote itself (bare, guided, a retry after a reflection, under a
    hint), not the reviewer's revision: the successes that count as the policy's."""
    return lambda attempt: attempt.policy_version == model and attempt.kind != "revision"


def print_table(result: dict[str, Any]) -> None:
    header = ["method", "solved (95% CI)", "vs plain", "minus plain (95% CI)"]
    header += ["won/lost", "at equal cost", "vs plain", "pass@1 first", "tokens/task"]
    header += ["reviewer/task", "only guidance"]
    rows = []
    for method, f in result["methods"].items():
        rows.append([
            method,
            share(f["solved"], f["solved_interval"]),
            ratio(f.get("solved_vs_plain")),
            difference(f.get("solved_minus_plain")),
            f"{f.get('solved_not_plain', '-')}/{f.get('plain_not_solved', '-')}",
            share(f["solved_at_cost"], f["solved_at_cost_interval"]),
            ratio(f.get("solved_at_cost_vs_plain")),
            f"{f['first_attempt_pass_at_1']:.3f}",
            f"{f['tokens_per_task']:.0f}",
            f"{f['reviewer_tokens_per_task']:.0f}",
            str(f.get("tasks_only_guidance_solved", "-")),
        ])  # fmt: skip
    print(text_table(header, rows))
    s = result["settings"]
    cost = "1" if s["reviewer_cost"] == "None" else f"{float(s['reviewer_cost']):.2f}"
    print(
        f"\n{s['tasks']} {s['taskset']} tasks, {s['budget']} policy tokens per task, groups of "
        f"{s['group_size']}, reviewer {s['reviewer']} (one token costs {cost} policy tokens); "
        "solved = at least one verified success (goal: a method >= 1.3x plain at equal "
        "cost); won/lost = tasks it solved that plain did not, and the reverse; only guidance = "
        "tasks solved by guided attempts or retries and by none of its own bare attempts"
    )
    for method, f in result["methods"].items():
        if timed := f.get("equal_time"):
            who = "the reviewer" if method in BY_REVIEWER else "the policy itself"
            print(
                f"{method}: {who} solved {timed['policy_solved']:.3f} in "
                f"{timed['seconds']:.0f} s; plain sampling {timed['plain_solved']:.3f} after as "
                f"long ({ratio(timed['ratio'])}, {difference(timed['minus_plain'])} paired)"
                + (" (plain's whole run: it ended first)" if timed["plain_ran_out"] else "")
            )


def share(value: float, interval: tuple[float, float]) -> str:
    return f"{value:.3f} ({interval[0]:.2f}-{interval[1]:.2f})"


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def difference(value: tuple[float, float, float] | None) -> str:
    return "-" if value is None else f"{value[0]:+.3f} ({value[1]:+.2f} to {value[2]:+.2f})"


if __name__ == "__main__":
    main()
