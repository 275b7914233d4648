"""Every rule of the experience library, on SQLite and PostgreSQL, and retrieval by scope,
BM25 and real sentence embeddings."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from memory import library
from memory.errors import StoreError
from memory.library import LibrarySettings
from memory.records import Attempt, Lesson, LessonDraft
from memory.retrieval import Index
from memory.store import open_store, save_group, transaction
from tests.helpers import make_group


def tip(
    text: str, zone: str = "do", scope: str = "task_type", key: str = "arithmetic"
) -> LessonDraft:
    source = f"test: {text}"  # each text its own piece of evidence
    return LessonDraft(
        kind="insight", scope=scope, scope_key=key, zone=zone, text=text, source=source
    )


def show_and_credit(
    engine: Engine, lesson_id: int, gains: list[float], settings: LibrarySettings
) -> None:
    for group_id, gain in zip(groups_for(engine, len(gains)), gains, strict=True):
        with transaction(engine) as session:
            library.record_use(session, group_id, [lesson_id], [0.9])
            library.credit(session, group_id, gain, settings)


_made = 0


def groups_for(engine: Engine, count: int) -> list[int]:
    global _made
    with transaction(engine) as session:
        ids = [
            save_group(session, make_group([1.0, 0.0], task_id=f"use{_made + i}"))
            for i in range(count)
        ]
    _made += count
    return ids


def test_a_duplicate_merges_its_evidence_and_keeps_the_utility(db_url: str) -> None:
    engine, settings = open_store(db_url), LibrarySettings()
    with transaction(engine) as session:
        (lesson_id,) = library.admit(session, [tip("Check the sign.")], settings).added
    show_and_credit(engine, lesson_id, [1.0], settings)
    with transaction(engine) as session:
        report = library.admit(
            session, [tip("  check   THE sign "), tip("Check the sign of the result.")], settings
        )
        entries = {e.id: e for e in library.lessons(session)}
        actions = [e.action for e in library.events(session, lesson_id)]
    assert report.merged == [lesson_id] and len(report.added) == 1
    assert entries[lesson_id].text == "Check the sign."
    assert entries[lesson_id].evidence == 2
    assert entries[lesson_id].utility == pytest.approx(0.1)
    assert actions == ["add", "credit", "merge"]


def test_the_same_evidence_counts_once_however_often_it_is_curated(db_url: str) -> None:
    engine, settings = open_store(db_url), LibrarySettings()
    seen = LessonDraft(kind="principle", scope="global", text="Reread the question.", source="a 1")
    again = seen.model_copy(update={"text": "reread the QUESTION"})
    other = seen.model_copy(update={"source": "a 2"})
    with transaction(engine) as session:
        first = library.admit(session, [seen, again], settings)
    with transaction(engine) as session:
        rerun = library.admit(session, [seen], settings)
        later = library.admit(session, [other], settings)
        (entry,) = library.lessons(session)
    assert len(first.added) == 1 and first.refused == [(again.text, "evidence already counted")]
    assert rerun.refused == [(seen.text, "evidence already counted")] and not rerun.merged
    assert later.merged == [entry.id] and entry.evidence == 2


def test_crediting_a_group_twice_changes_nothing(db_url: str) -> None:
    engine, settings = open_store(db_url), LibrarySettings()
    with transaction(engine) as session:
        (lesson_id,) = library.admit(session, [tip("Estimate first.")], settings).added
    (group_id,) = groups_for(engine, 1)
    with transaction(engine) as session:
        library.record_use(session, group_id, [lesson_id], [0.8])
        library.credit(session, group_id, 1.0, settings)
        library.credit(session, group_id, 1.0, settings)
        utility = library.lesson(session, lesson_id).utility
    assert utility == pytest.approx(0.1)


def test_a_longer_rewording_with_the_same_words_replaces_the_text(db_url: str) -> None:
    engine, settings = open_store(db_url), LibrarySettings()
    with transaction(engine) as session:
        (lesson_id,) = library.admit(session, [tip("check the sign")], settings).added
        library.admit(session, [tip("Check the sign!!")], settings)
        (entry,) = library.lessons(session)
    assert entry.text == "Check the sign!!" and entry.evidence == 2


def test_admission_is_rate_limited_per_zone(db_url: str) -> None:
    engine = open_store(db_url)
    settings = LibrarySettings(rate_limit={"do": 3, "avoid": 1})
    candidates = [tip(f"do thing {i}") for i in range(5)] + [
        tip(f"avoid thing {i}", "avoid") for i in range(2)
    ]
    with transaction(engine) as session:
        report = library.admit(session, candidates, settings)
    assert len(report.added) == 4
    assert [reason for _, reason in report.refused] == ["rate limit"] * 3
    with transaction(engine) as session:  # the next update has its own allowance
        assert len(library.admit(session, [tip("do thing 9")], settings).added) == 1


def test_capacity_trims_the_lowest_ranked_unprotected_entry(db_url: str) -> None:
    engine = open_store(db_url)
    settings = LibrarySettings(capacity={"do": 3, "avoid": 3}, protect_exposures=1, exploration=0.0)
    with transaction(engine) as session:
        ids = library.admit(session, [tip(f"tip {i}") for i in range(3)], settings).added
    with transaction(engine) as session:  # every entry is still protected: no room
        report = library.admit(session, [tip("tip 3")], settings)
    assert report.added == [] and report.refused[0][1] == "level full of protected lessons"
    for lesson_id, gain in zip(ids, [0.5, -0.5, 0.2], strict=True):
        show_and_credit(engine, lesson_id, [gain], settings)
    with transaction(engine) as session:
        report = library.admit(session, [tip("tip 3")], settings)
        active = {e.id for e in library.lessons(session)}
        trim_events = [e.action for e in library.events(session, ids[1])]
    assert report.trimmed == [ids[1]] and len(report.added) == 1
    assert active == {ids[0], ids[2], report.added[0]}
    assert trim_events[-1] == "trim"


def test_utility_follows_the_gain_and_persistent_losers_are_pruned(db_url: str) -> None:
    engine = open_store(db_url)
    settings = LibrarySettings(min_exposures=3, negative_windows=2)
    with transaction(engine) as session:
        good, bad = library.admit(session, [tip("good tip"), tip("bad tip")], settings).added
    show_and_credit(engine, good, [1.0, 1.0, -0.5], settings)
    show_and_credit(engine, bad, [-1.0, 0.5, -1.0], settings)  # the positive gain resets the run
    with transaction(engine) as session:
        entries = {e.id: e for e in library.lessons(session)}
        assert entries[good].utility == pytest.approx(0.9 * (0.9 * 0.1 + 0.1) - 0.05)
        assert entries[bad].status == "active" and entries[bad].negative_windows == 1
        assert [gain for _, gain in library.uses(session, good)] == [1.0, 1.0, -0.5]
    show_and_credit(engine, bad, [-1.0], settings)
    with transaction(engine) as session:
        assert bad not in {e.id for e in library.lessons(session)}
        assert library.events(session, bad)[-1].action == "prune"
        assert library.events(session, bad)[-1].before["status"] == "active"


def test_a_record_that_does_not_fit_is_refused_and_nothing_is_written(db_url: str) -> None:
    engine = open_store(db_url)
    bad = {"kind": "rumour", "scope": "global", "text": "trust me"}
    with (
        pytest.raises(StoreError, match="lesson refused: kind: Input should be"),
        transaction(engine) as session,
    ):
        library.admit(session, [tip("a fine tip"), bad], LibrarySettings())
    with (
        pytest.raises(StoreError, match="text: String should have at most 2000"),
        transaction(engine) as session,
    ):
        library.admit(
            session, [{"kind": "hint", "scope": "global", "text": "x" * 2001}], LibrarySettings()
        )
    with transaction(engine) as session:
        assert library.lessons(session) == []


def entry(i: int, text: str, scope: str = "global", key: str = "", utility: float = 0.0) -> Lesson:
    return Lesson(
        id=i, kind="insight", scope=scope, scope_key=key, zone="do", text=text, source="",
        fingerprint=str(i), evidence=1, utility=utility, exposures=0, negative_windows=0,
        status="active", created_at="2026-01-01T00:00:00Z",
    )  # fmt: skip


def test_retrieval_keeps_to_the_scope_ranks_by_words_and_fits_the_budget() -> None:
    index = Index([
        entry(1, "Carry the one when adding two digit numbers.", "task_type", "arithmetic"),
        entry(2, "Subtracting a negative number adds it.", "task", "arith:1"),
        entry(3, "Subtracting a negative number adds it, always.", "task", "arith:2"),
        entry(4, "Write the function in one code block.", "task_type", "code"),
        entry(5, "Read the question twice.", "global", utility=0.5),
        entry(6, "Answer inside the tags. " * 30, "global"),
    ])  # fmt: skip
    hits = index.search("what is 3 minus negative 4, subtracting", "arith:1", "arithmetic", k=3)
    assert [h.lesson.id for h in hits] == [2, 5, 1]  # words first, then utility; no 3, 4 or 6
    assert [
        h.lesson.id for h in index.search("x", "arith:1", "arithmetic", k=6, char_budget=60)
    ] == [5]


@pytest.fixture(scope="module")
def embedder():
    from memory.embedding import Embedder

    return Embedder()


def test_embeddings_find_a_paraphrase_that_shares_no_words(embedder) -> None:
    texts = [
        "Be careful with minus signs.",
        "Write the function in one code block.",
        "Carry the one.",
    ]
    entries = [entry(i, text) for i, text in enumerate(texts)]
    vectors = dict(zip(range(3), embedder.embed_bytes(texts), strict=True))
    hits = Index(entries, vectors, embedder).search(
        "check sign when subtracting", "t", "arithmetic", k=1
    )
    assert hits[0].lesson.id == 0 and hits[0].score > 0.5
    lexical = Index(entries).search("check sign when subtracting", "t", "arithmetic", k=1)
    assert lexical[0].score == 0.0  # no shared word: BM25 has nothing to go on


def test_admission_stores_embeddings_for_retrieval(db_url: str, embedder) -> None:
    engine = open_store(db_url)
    with transaction(engine) as session:
        (lesson_id,) = library.admit(
            session, [tip("Be careful with minus signs.")], LibrarySettings(), embedder.embed_bytes
        ).added
        vectors = library.embeddings(session, [lesson_id])
        entries = library.lessons(session)
    hits = Index(entries, vectors, embedder).search("check the sign", "t", "arithmetic")
    assert [h.lesson.id for h in hits] == [lesson_id] and hits[0].score > 0.4


def test_only_lessons_the_verifier_confirmed_are_drafted() -> None:
    from flows.stages import confirmed_lessons

    group = make_group([0.0, 1.0, 0.0, 0.0])
    base, guided, retry, *_ = group.attempts
    kept, unused, malformed = "Add the tens first.", "Guess big.", "Mind the sign."

    def insight(text: str, format_ok: bool = True) -> Attempt:
        return base.model_copy(update={"kind": "insight", "guidance": text, "format_ok": format_ok})

    attempts = [
        base,
        guided.model_copy(update={"context": "insights", "guidance": f"{kept}\n{malformed}"}),
        retry.model_copy(update={"kind": "retry", "guidance": "Carry the one.", "improved": True}),
        retry.model_copy(update={"kind": "retry", "guidance": "Count twice.", "improved": False}),
        insight(kept), insight(unused), insight(malformed, format_ok=False),
    ]  # fmt: skip
    drafts = confirmed_lessons([group.model_copy(update={"attempts": attempts})])
    assert [(d.kind, d.text) for d in drafts] == [
        ("principle", "Carry the one."), ("insight", kept)
    ]  # fmt: skip
