"""A benchmark as an agent's stream of steps: one document per turn, each question right after its evidence.

- HotpotQA: every paragraph of an example is a document turn; the question follows the last
  supporting paragraph; the example's remaining paragraphs (distractors) follow the question.
- LoCoMo: every session is a document turn (its chat messages); after session n come the
  questions whose latest evidence is in session n.
- LoCoMo-MC10: each row's sessions are appended once (shared sessions are not repeated), then
  its question with the ten choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jobs.data.conversations import locomo_session_messages, locomo_session_numbers
from jobs.data.datasets import HotpotExample, LocomoMCRow, LocomoSample


@dataclass(frozen=True)
class Document:
    """One turn of reading: messages appended to the agent's history as they are."""

    label: str  # where it comes from, for the per-turn record
    messages: tuple[dict[str, str], ...]


@dataclass(frozen=True)
class Question:
    """One task: asked as a user turn, answered free-form by the agent, then scored."""

    task_id: str
    question: str
    gold: str  # reference answer (for MC: the correct choice's text)
    category: str  # HotpotQA type, LoCoMo category number, or the MC question type
    choices: tuple[str, ...] = ()  # MC only
    correct_index: int | None = None  # MC only


Step = Document | Question


def hotpotqa_steps(examples: Sequence[HotpotExample]) -> list[Step]:
    steps: list[Step] = []
    for example in examples:
        last_evidence = max(i for i, (title, _) in enumerate(example.context) if title in example.evidence_titles)
        for i, (title, sentences) in enumerate(example.context):
            text = f"Document: {title}\n{''.join(sentences).strip()}"
            steps.append(Document(f"{example.id}/{title}", ({"role": "user", "content": text},)))
            if i == last_evidence:
                category = example.type or "unknown"
                steps.append(Question(example.id, example.question, example.answer, category))
    return steps


def locomo_steps(
    samples: Sequence[LocomoSample],
    sessions: int | None = None,
    questions_per_session: int | None = None,
    categories: Sequence[int] = (1, 2, 3, 4),
) -> list[Step]:
    """Conversations one after another, `sessions` sessions in all, each followed by its questions.

    A question comes right after the latest session its evidence points at; at most
    `questions_per_session` are asked there (all when None). Questions whose evidence cannot be
    located, or lies beyond the sessions read, are not asked.
    """
    steps: list[Step] = []
    budget = sessions
    for sample in samples:
        numbers = locomo_session_numbers(sample.conversation)[:budget]
        steps += _sample_steps(sample, numbers, questions_per_session, categories)
        if budget is not None:
            budget -= len(numbers)
            if budget <= 0:
                break
    return steps


def _sample_steps(
    sample: LocomoSample, numbers: Sequence[int], per_session: int | None, categories: Sequence[int]
) -> list[Step]:
    included = set(numbers)
    due: dict[int, list[Question]] = {n: [] for n in numbers}
    for k, qa in enumerate(sample.qa):
        where = qa.evidence_sessions
        if qa.category in categories and where and set(where) <= included:
            due[max(where)].append(Question(f"{sample.sample_id}/q{k}", qa.question, qa.gold, str(qa.category)))
    steps: list[Step] = []
    for n in numbers:
        messages = tuple(locomo_session_messages(sample.conversation, n))
        steps.append(Document(f"{sample.sample_id}/session_{n}", messages))
        steps += due[n][:per_session]
    return steps


def mc_session_messages(row: LocomoMCRow, index: int) -> tuple[dict[str, str], ...]:
    dates = row.haystack_session_datetimes
    header = f"[Session {row.haystack_session_ids[index]}, {dates[index] if dates else 'date unknown'}]\n"
    turns = row.haystack_sessions[index]
    roles = [t.role if t.role in ("user", "assistant") else "user" for t in turns]
    return tuple(
        {"role": r, "content": (header if i == 0 else "") + t.content}
        for i, (r, t) in enumerate(zip(roles, turns, strict=True))
    )


def locomo_mc_steps(rows: Sequence[LocomoMCRow]) -> list[Step]:
    seen: set[str] = set()
    steps: list[Step] = []
    for row in rows:
        for i, session_id in enumerate(row.haystack_session_ids):
            if session_id not in seen:
                seen.add(session_id)
                steps.append(Document(session_id, mc_session_messages(row, i)))
        gold = row.choices[row.correct_choice_index]
        steps.append(
            Question(
                row.question_id,
                row.question,
                gold,
                row.question_type or "unknown",
                tuple(row.choices),
                row.correct_choice_index,
            )
        )
    return steps
