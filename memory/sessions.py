"""Captured sessions as episodes: the turns of one conversation stitched into one token sequence,
and the episodes of one task grouped for training.

1. A session's turns (chat completions captured by the gateway with the same session tag,
   `serving.capture`) are stitched token-exactly, as `agents.episode` plays its own episodes:
   the episode's prompt is the first turn's prompt ids; each turn adds the completion ids the
   server sampled (trained, with its logprobs), and the tokens between one turn's end and the
   next turn's prompt (the next user message or tool result with the template's turn markers)
   are a forced span, never trained. This holds where each turn's prompt ids begin with
   everything before it, that is where the server renders the earlier turns as the very tokens
   it sampled. Where it renders the last answer otherwise (a forced tool call: vLLM samples
   `tool_choice` "required" or named as plain JSON, which the template renders back as its own
   tool-call markup), the rendering replaces that answer as forced context: it is not trained,
   and every trained token still has the context the server gave it. A session whose prompt
   changes anything before that is not stitched (its reason names the turn) and is never
   trained on.
2. An episode's reward is its last turn's score: session feedback (`record_session_feedback`)
   scores every turn; an episode whose last turn has no score is unrated.
3. Rated episodes tagged with the same task form one group, the unit group advantages are
   computed over; a task needs at least `min_episodes` of them. Held-out sessions (marked when
   they arrive) are never grouped or trained on: their turns judge new versions
   (`held_out_turns`).
4. A round adopts the groups (`adopt`): each is stored as a train group of that round (its plan
   names the sessions, so lineage reaches from a version to the traffic that trained it), and
   its sessions' turns are marked with the round, so no episode is trained twice.
5. A session whose task was met once never forms a group on its own: `lone_sessions` finds
   them, and `add_siblings` stores the siblings a round samples from its last turn's logged
   prefix (`flows.siblings`) as sessions of the same task, tied to it.
6. `forget` deletes a session: its captured turns, its siblings, and any train group that
   adopted it; `hold_out` keeps one that has not trained out of training, to judge with.
7. `session_page` lists sessions newest first, a page at a time, in two aggregate queries.
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict

from sqlalchemy import Select, case, delete, func, select
from sqlalchemy.orm import Session

from memory.errors import NotFound, StoreError
from memory.groups import captured_turns, load_groups
from memory.ingest import save_group
from memory.models import AttemptRow, RolloutGroupRow
from memory.records import (
    FIRST_KINDS,
    UNRATED,
    Attempt,
    CapturedSession,
    Group,
    GroupPlan,
    Sample,
)
from memory.rows import group_record, retag, row_plan

CAPTURED = "gateway"  # the task set of captured traffic and of the groups rounds adopt from it
REPLY_TOKENS = 256  # a logged turn without max_tokens is answered again with at most this many
MOST_REPLY_TOKENS = 1024


def stitch(turns: list[Attempt]) -> Attempt | str:
    """The turns as one episode attempt, or why they cannot be one."""
    if not turns or any(t.sample is None for t in turns):
        return "a turn has no sample"
    if len(turns) == 1 and turns[0].turns > 1:  # stored stitched already: a sibling
        return turns[0]
    first = turns[0].sample
    assert first is not None
    completion: list[int] = []
    logprobs: list[float] = []
    spans: list[tuple[int, int]] = []
    answered = 0  # where the last turn's sampled answer starts in `completion`
    for number, turn in enumerate(turns, 1):
        sample = turn.sample
        assert sample is not None
        if number > 1:
            prompt = sample.prompt_token_ids
            if not _begins(prompt, first.prompt_token_ids + completion):
                if not _begins(prompt, first.prompt_token_ids + completion[:answered]):
                    return f"turn {number}'s prompt does not begin with the turns before it"
                del completion[answered:], logprobs[answered:]  # rendered otherwise
            between = prompt[len(first.prompt_token_ids) + len(completion) :]
            _force(spans, len(completion), len(completion) + len(between))
            completion += between
            logprobs += [0.0] * len(between)
        answered = len(completion)
        completion += sample.completion_token_ids
        logprobs += sample.logprobs
    last = turns[-1]
    assert last.sample is not None
    text = "\n".join(f"[turn {i}] {t.sample.text}" for i, t in enumerate(turns, 1) if t.sample)
    return last.model_copy(
        update={
            # the first turn's version; each token keeps its own behaviour logprob, so an alias
            # that moved mid-session changes nothing the trainer needs
            "policy_version": turns[0].policy_version,
            "messages": [*last.messages, {"role": "assistant", "content": last.sample.text}],
            "sampling": turns[0].sampling,
            "sample": Sample(
                text=text,
                prompt_token_ids=first.prompt_token_ids,
                completion_token_ids=completion,
                logprobs=logprobs,
                finish_reason=last.sample.finish_reason,
            ),
            "forced_spans": spans,
            "turns": len(turns),
            "generated_tokens": sum(len(t.sample.completion_token_ids) for t in turns if t.sample),
        }
    )


def _begins(ids: list[int], prefix: list[int]) -> bool:
    return ids[: len(prefix)] == prefix


def _force(spans: list[tuple[int, int]], start: int, end: int) -> None:
    """Add a forced span, joined to the one before it where they touch."""
    if spans and spans[-1][1] == start:
        spans[-1] = (spans[-1][0], end)
    else:
        spans.append((start, end))


def stitch_turns(turns: list[Group]) -> Attempt | str:
    """A session's captured turns (groups of one attempt, oldest first) as one episode."""
    return stitch([g.attempts[0] for g in turns if g.attempts])


def session_turns(db: Session) -> dict[str, list[Group]]:
    """Captured turns by session (each session's turns oldest first)."""
    query = (
        select(RolloutGroupRow)
        .where(RolloutGroupRow.purpose == "capture")
        .where(RolloutGroupRow.plan["session"].as_string().is_not(None))
        .order_by(RolloutGroupRow.id)
    )
    found: dict[str, list[Group]] = defaultdict(list)
    for row in db.scalars(query):
        group = group_record(row)
        found[str(group.plan.session)].append(group)
    return dict(found)


def episodes(db: Session) -> dict[str, Attempt | str]:
    """Every captured session, stitched (or the reason it could not be)."""
    return {sid: stitch_turns(turns) for sid, turns in session_turns(db).items()}


def episode_groups(db: Session, min_episodes: int = 2, rated: bool = True) -> list[Group]:
    """Groups of stitched episodes not yet adopted by a round, one per task tag with at least
    `min_episodes`: the rated episodes, or (`rated` off) the unrated ones, for a judge."""
    by_task: dict[str, list[tuple[str, Attempt, str]]] = defaultdict(list)
    for sid, turns in session_turns(db).items():
        if _taken(turns):
            continue
        task = turns[0].plan.task
        episode = stitch_turns(turns)
        if task and isinstance(episode, Attempt) and (episode.reason != UNRATED) == rated:
            by_task[task].append((sid, episode, turns[0].question))
    return [
        _group(task, found) for task, found in sorted(by_task.items()) if len(found) >= min_episodes
    ]


def _taken(turns: list[Group]) -> bool:
    """Whether a session is out of reach of a new round: trained on already, or held out."""
    return any(g.plan.trained_in is not None for g in turns) or turns[0].plan.held_out


def replay_tokens(turn: Attempt) -> int:
    """How many tokens a logged turn may take when it is answered again (by a sibling, or by a
    version under judgement): its own max_tokens, within bounds."""
    return min(turn.sampling.max_tokens or REPLY_TOKENS, MOST_REPLY_TOKENS)


def held_out_turns(db: Session, limit: int) -> dict[str, list[Attempt]]:
    """The assistant turns of held-out sessions (never trained on), by session, newest sessions
    first, at most `limit` turns in all: each turn's logged prompt ids are the prefix a
    candidate and the serving version answer when the gate compares them."""
    return _answered_turns(session_turns(db), limit)


def held_out_split(
    db: Session, limit: int
) -> tuple[dict[str, tuple[Attempt, str, str]], dict[str, list[Attempt]]]:
    """The held-out sessions the gate scores, from one scan, newest first. Those whose feedback
    sent a reference, at most `limit`: each one's last answered turn (the one the reference
    scores), its question and its reference, for the session's own verifier. The others:
    their assistant turns, at most `limit` in all (`held_out_turns`), for the judge."""
    by_session = session_turns(db)
    verified: dict[str, tuple[Attempt, str, str]] = {}
    for sid, turns in reversed(by_session.items()):
        last = turns[-1]
        if len(verified) >= limit or not last.plan.held_out or last.plan.reference is None:
            continue
        if last.attempts and last.attempts[0].sample is not None:
            verified[sid] = (last.attempts[0], turns[0].question, last.plan.reference)
    judged = {sid: turns for sid, turns in by_session.items() if sid not in verified}
    return verified, _answered_turns(judged, limit)


def _answered_turns(by_session: dict[str, list[Group]], limit: int) -> dict[str, list[Attempt]]:
    found: dict[str, list[Attempt]] = {}
    taken = 0
    for sid, turns in reversed(by_session.items()):
        if not turns[0].plan.held_out or taken >= limit:
            continue
        answered = [g.attempts[0] for g in turns if g.attempts and g.attempts[0].sample]
        found[sid] = answered[: limit - taken]
        taken += len(found[sid])
    return {sid: turns for sid, turns in found.items() if turns}


def lone_sessions(db: Session, min_episodes: int = 2) -> dict[str, list[Group]]:
    """Sessions that would never form a group: their task was met by fewer than `min_episodes`
    sessions (a session with no task tag is a task of its own). Only those a round may still
    train on: not held out, not adopted, stitched, with no siblings yet and none of their own."""
    by_session = session_turns(db)
    met = Counter(
        t[0].plan.task for t in by_session.values() if t[0].plan.task and not t[0].plan.held_out
    )
    lone = {}
    for sid, turns in by_session.items():
        plan = turns[0].plan
        if _taken(turns) or plan.siblings is not None or plan.sibling_of is not None:
            continue
        if plan.task and met[plan.task] >= min_episodes:
            continue
        if isinstance(stitch_turns(turns), Attempt):
            lone[sid] = turns
    return lone


def add_siblings(db: Session, sid: str, siblings: list[Attempt]) -> list[str]:
    """Store `siblings` (episodes: the session's turns with its last answer sampled again) as
    sessions of their own, tied to `sid` (`sibling_of`, so lineage reaches the session) and
    filed under its task (the session's own name when it had none); `sid` is marked, so it gets
    siblings once. Returns the siblings' session names."""
    rows = list(db.scalars(captured_turns(sid)))
    plan = row_plan(rows[0])
    task = plan.task or sid
    for row in rows:
        retag(row, task=task, siblings=len(siblings))
    names = []
    for number, episode in enumerate(siblings, 1):
        name = f"{sid}~{number}"[:200]
        group = Group(
            round_index=0, purpose="capture", task_id=f"capture:{uuid.uuid4().hex}",
            taskset=CAPTURED, question=rows[0].question, policy_version=episode.policy_version,
            size=1, attempts=[episode.model_copy(update={"sample_index": 0})],
            plan=GroupPlan(session=name, task=task, owner=plan.owner, sibling_of=sid),
        )  # fmt: skip
        save_group(db, group)
        names.append(name)
    db.flush()
    return names


def _group(task: str, found: list[tuple[str, Attempt, str]]) -> Group:
    """A task's episodes as a group: the policy's own in its slots, then any reviewer's answer
    (a `revision` sibling) as an extra member revising the first slot, as HeRL's are."""
    found = sorted(found, key=lambda f: f[1].kind not in FIRST_KINDS)  # stable: own first
    own = [e for _, e, _ in found if e.kind in FIRST_KINDS]
    attempts = [
        e.model_copy(update={"sample_index": i} | ({} if i < len(own) else {"parent_index": 0}))
        for i, (_, e, _) in enumerate(found)
    ]
    return Group(
        round_index=0,
        purpose="capture",
        task_id=f"task:{task}",
        taskset=CAPTURED,
        question=found[0][2],
        policy_version=attempts[0].policy_version,
        size=len(own),
        attempts=attempts,
        plan=GroupPlan(task=task, sessions=[sid for sid, _, _ in found]),
    )


def adopt(db: Session, round_index: int, policy_version: str, min_episodes: int = 2) -> list[Group]:
    """Store the new episode groups as train groups of `round_index` (under the version that
    samples that round, where the round looks for them) and mark their turns as taken; a task
    that already has a group in the round waits for the next one. Returns the groups stored."""
    taken = {g.task_id for g in load_groups(db, "train", round_index, policy_version)}
    adopted = []
    for group in episode_groups(db, min_episodes):
        if group.task_id in taken:
            continue
        train = group.model_copy(
            update={
                "purpose": "train",
                "round_index": round_index,
                "policy_version": policy_version,
            }
        )
        group_id = save_group(db, train)
        for sid in group.plan.sessions:
            for row in db.scalars(captured_turns(sid)):
                retag(row, trained_in=round_index)
        adopted.append(train.model_copy(update={"id": group_id}))
    db.flush()
    return adopted


def session_page(
    db: Session, limit: int = 50, offset: int = 0
) -> tuple[list[CapturedSession], int]:
    """Captured sessions (siblings aside), the last active first: one page, and how many
    there are in all (counted over the same scan; a second query only past the last page)."""
    plan = RolloutGroupRow.plan
    name = plan["session"].as_string()
    own = (
        (RolloutGroupRow.purpose == "capture") & name.is_not(None)
        & plan["sibling_of"].as_string().is_(None)
    )  # fmt: skip
    held = func.max(case((plan["held_out"].as_boolean().is_(True), 1), else_=0))
    last_turn = func.max(RolloutGroupRow.id)
    query = (
        select(name, func.count(), func.min(RolloutGroupRow.created_at),
               func.max(RolloutGroupRow.created_at), func.max(plan["task"].as_string()), held,
               func.max(plan["round"].as_integer()), last_turn, func.count().over())
        .where(own)
        .group_by(name)
        .order_by(last_turn.desc())
        .limit(limit)
        .offset(offset)
    )  # fmt: skip
    rows = db.execute(query).all()
    if rows:
        total = int(rows[0][-1])
    else:
        total = db.scalar(select(func.count(func.distinct(name))).where(own)) or 0
    last = _verdicts(db, [row[-2] for row in rows])
    page = [
        CapturedSession(
            name=sid,
            task=task,
            turns=turns,
            first_at=first,
            last_at=latest,
            held_out=bool(h),
            round_index=r,
            reward=last.get(turn, (None, ""))[0],
            reason=last.get(turn, (None, ""))[1],
        )  # fmt: skip
        for sid, turns, first, latest, task, h, r, turn, _ in rows
    ]
    return page, total


def _verdicts(db: Session, turns: list[int]) -> dict[int, tuple[float, str]]:
    """Each captured turn's reward and the reason it was given, by the turn's group id."""
    query = select(AttemptRow.group_id, AttemptRow.reward, AttemptRow.reason).where(
        AttemptRow.group_id.in_(turns)
    )
    return {turn: (reward, reason) for turn, reward, reason in db.execute(query)}


def hold_out(db: Session, session_id: str) -> int:
    """Keep a session out of training, to judge new versions with; the turns marked. A session
    a round already trained on cannot judge (`StoreError`); an unknown one is `NotFound`."""
    turns = list(db.scalars(captured_turns(session_id)))
    if not turns:
        raise NotFound(f"unknown session {session_id!r}")
    trained = next((r for row in turns if (r := row_plan(row).trained_in) is not None), None)
    if trained is not None:
        raise StoreError(f"session {session_id!r} trained round {trained}: it cannot judge")
    for row in turns:
        retag(row, held_out=True)
    db.flush()
    return len(turns)


def forget(db: Session, session_id: str) -> tuple[int, int]:
    """Delete a session's captured turns, its siblings, and the train groups that adopted it or
    them; how many turns and groups. `NotFound` when there is neither."""
    turns = [row.id for row in db.scalars(captured_turns(session_id))]
    turns += [row.id for row in db.scalars(siblings_of(session_id))]
    adopted_by = select(RolloutGroupRow).where(
        RolloutGroupRow.purpose == "train", RolloutGroupRow.taskset == CAPTURED
    )
    adopted = [
        row.id
        for row in db.scalars(adopted_by)
        if any(_of(name, session_id) for name in row_plan(row).sessions)
    ]
    if not turns and not adopted:
        raise NotFound(f"unknown session {session_id!r}")
    db.execute(delete(RolloutGroupRow).where(RolloutGroupRow.id.in_(turns + adopted)))
    return len(turns), len(adopted)


def siblings_of(session_id: str) -> Select[RolloutGroupRow]:
    """The query of the siblings sampled for a session (`add_siblings`)."""
    return select(RolloutGroupRow).where(
        RolloutGroupRow.purpose == "capture",
        RolloutGroupRow.plan["sibling_of"].as_string() == session_id,
    )


def _of(name: str, session_id: str) -> bool:
    """Whether a session name is `session_id` or one of its siblings."""
    return name == session_id or name.startswith(f"{session_id}~")
