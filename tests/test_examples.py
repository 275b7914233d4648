"""Own examples: the policy's verified answers kept per batch, and the nearest one shown to a
group's guided slots as its worked example (scripted server)."""

import json

import anyio
import httpx

from agents.collector import GroupSpec, collect_group
from agents.examples import ExampleBook, shape
from agents.policy import Endpoint
from agents.settings import CollectSettings
from flows.settings import RunSettings
from flows.stages import _planner, own_examples
from memory import store
from memory.records import OWN_EXAMPLE, Group
from tests.helpers import client_for, make_group, scripted
from verifiers.reasoning import train_tasks
from verifiers.task import Task

TASKS = train_tasks("arithmetic", 40, seed=7, held_out=[])


def solved(task: Task, text: str, **update: object) -> Group:
    """A group of `task` whose first attempt answered `text`, with `update` applied to it."""
    first, *rest = make_group([1.0, 0.0], task_id=task.task_id).attempts
    sample = first.sample.model_copy(update={"text": text})
    attempts = [first.model_copy(update={"sample": sample, **update}), *rest]
    return make_group([1.0, 0.0], task_id=task.task_id).model_copy(
        update={"attempts": attempts, "question": task.question}
    )


def test_shape_reads_numbers_as_one_mark() -> None:
    assert shape("Calculate -9 -  7.") == shape("Calculate -12 - 4.5.") == "Calculate -# - #."


def test_the_book_keeps_the_policys_own_verified_answers_newest_last() -> None:
    book = ExampleBook(capacity=2)
    a, b, c = TASKS[:3]
    book.record(solved(a, "x", reward=0.0, correct=False))  # a failure is no example
    book.record(solved(a, "y", kind="retry"))  # nor is a retry after a reflection
    assert len(book) == 0
    for task in (a, b, c):
        book.record(solved(task, f"<answer>{task.answer}</answer>"))
    assert len(book) == 2, "over capacity, the oldest task is dropped"

    async def nearest() -> tuple[str, str] | None:
        return await book.nearest(a)

    assert anyio.run(nearest) in {(t.question, f"<answer>{t.answer}</answer>") for t in (b, c)}


def test_nearest_is_the_closest_shape_of_the_task_set_never_the_task_nor_its_answer() -> None:
    by_shape: dict[str, list[Task]] = {}
    for task in TASKS:
        by_shape.setdefault(shape(task.question), []).append(task)
    target, twin = next(group for group in by_shape.values() if len(group) >= 2)[:2]
    other = next(t for t in TASKS if shape(t.question) != shape(target.question))
    book = ExampleBook()
    book.record(solved(twin, "the twin's working"))
    book.record(solved(other, "another shape's working"))
    book.record(solved(target, "its own answer"))

    async def nearest(book: ExampleBook) -> tuple[str, str] | None:
        return await book.nearest(target)

    assert anyio.run(nearest, book) == (twin.question, "the twin's working")
    leaky = ExampleBook()  # an example whose answer the verifier accepts here shows what, not how
    leaky.record(solved(twin, f"<answer>{target.answer}</answer>"))
    assert anyio.run(nearest, leaky) is None
    elsewhere = ExampleBook()  # another task set's answer is never shown
    elsewhere.record(solved(twin, "working").model_copy(update={"taskset": "chain_sum"}))
    assert anyio.run(nearest, elsewhere) is None


def test_an_example_the_leak_check_cannot_verify_is_passed_by(monkeypatch) -> None:
    from agents import examples
    from verifiers.errors import TaskFault

    async def hung(task: Task, completion: str) -> None:
        raise TaskFault("task set 'arithmetic': verify ran past its deadline")

    monkeypatch.setattr(examples, "averify", hung)
    book = ExampleBook()
    book.record(solved(TASKS[1], "working"))

    async def nearest() -> tuple[str, str] | None:
        return await book.nearest(TASKS[0])

    assert anyio.run(nearest) is None


def test_a_batch_shows_later_groups_the_policys_own_answers() -> None:
    """One group after another: the first sees the task set's worked example, later ones the
    answer the policy verified on an earlier task, recorded as their own context."""
    prompts: list[list[dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [1, 2], "count": 2})
        prompts.append(body["messages"])
        task = next(t for t in TASKS if t.question == body["messages"][-1]["content"])
        return scripted(body, f"<answer>{task.answer}</answer>", [9] * 4)

    settings = CollectSettings(group_size=1, guided_fraction=1.0, own_examples=True)
    spec, book = GroupSpec(1, "train", settings), ExampleBook()
    groups: list[Group] = []

    async def main() -> None:
        policy, limiter = Endpoint(client_for(handler), "m"), anyio.CapacityLimiter(1)
        for task in TASKS[:3]:
            groups.append(await collect_group(policy, task, spec, limiter, examples=book))

    anyio.run(main)
    contexts = [g.attempts[0].context for g in groups]
    assert contexts[0] == "demo" and contexts[1:] == [OWN_EXAMPLE, OWN_EXAMPLE]
    shown = {p[1]["content"] for p in prompts[1:]}
    assert shown <= {t.question for t in TASKS[:3]} and len(prompts) == 3
    for group in groups[1:]:
        (attempt,) = group.attempts
        assert attempt.messages[1]["content"] != group.question
        assert attempt.bare_prompt_token_ids == [1, 2] and attempt.distillable


def test_a_round_plans_each_task_the_nearest_answer_stored_in_earlier_rounds(
    db_url: str,
) -> None:
    """`flywheel run --own-examples 1`: the planner reads earlier rounds' groups from the store;
    a task gets the nearest stored answer as its guided slots' example, and nothing is planned
    when the switch is off or no group has one."""
    earlier, later = TASKS[:6], TASKS[6:12]
    engine = store.open_store(db_url)
    with store.transaction(engine) as session:
        for task in earlier:
            store.save_group(session, solved(task, f"<answer>{task.answer}</answer>"))
    on = CollectSettings(guided_fraction=0.5, own_examples=True)

    async def planned(sampling: CollectSettings) -> dict[str, tuple[str, str]]:
        return await own_examples(engine, later, sampling)

    examples = anyio.run(planned, on)
    assert examples and set(examples) <= {t.task_id for t in later}
    assert {q for q, _ in examples.values()} <= {t.question for t in earlier}
    plan = _planner(RunSettings(), engine, "train", on, None, examples)
    task = next(t for t in later if t.task_id in examples)
    assert plan(task).sampling.example == examples[task.task_id]
    assert plan(task).conditioning().sampling["example"] == list(examples[task.task_id])
    assert anyio.run(planned, on.model_copy(update={"own_examples": False})) == {}


def test_the_store_hands_over_only_the_newest_solved_groups(db_url: str) -> None:
    """The planner's examples come from the newest groups a first attempt solved, so its reads
    stay bounded however many rounds the store holds."""
    a, b, c, d = TASKS[:4]
    engine = store.open_store(db_url)
    with store.transaction(engine) as session:
        store.save_group(session, solved(a, "<answer>1</answer>"))
        store.save_group(session, solved(b, "x", reward=0.0, correct=False))
        store.save_group(session, solved(c, "y", kind="retry"))  # solved, but not at first
        store.save_group(session, solved(d, "<answer>2</answer>"))
    with store.transaction(engine) as session:
        assert [g.task_id for g in store.solved_groups(session, "train", 8)] == [
            a.task_id,
            d.task_id,
        ]
        assert [g.task_id for g in store.solved_groups(session, "train", 1)] == [d.task_id]
        assert store.solved_groups(session, "eval", 8) == []
