"""Loaders on the real shared files, the shipped LoCoMo-MC10 fixture, and malformed files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compaction.errors import InvalidInput
from jobs.data.conversations import SHARED_DATA, locomo_session_numbers
from jobs.data.datasets import ADVERSARIAL_GOLD, load_hotpotqa, load_locomo, load_locomo_mc
from jobs.data.episodes import Document, Question, hotpotqa_steps, locomo_mc_steps, locomo_steps

HOTPOT = SHARED_DATA / "hotpotqa_dev_distractor_sample100.json"
LOCOMO = SHARED_DATA / "locomo10.json"
FIXTURE = Path(__file__).resolve().parents[1] / "jobs" / "data" / "fixtures" / "locomo_mc10_tiny.jsonl"
needs_shared = pytest.mark.skipif(
    not (HOTPOT.exists() and LOCOMO.exists()), reason=f"shared benchmark data not found in {SHARED_DATA}"
)


@needs_shared
def test_real_hotpotqa_loads_and_asks_each_question_after_its_evidence() -> None:
    examples = load_hotpotqa(HOTPOT)
    assert len(examples) == 100 and {e.level for e in examples} == {"hard"}
    assert sum(e.type == "bridge" for e in examples) == 85
    steps = hotpotqa_steps(examples[:3])
    questions = [i for i, s in enumerate(steps) if isinstance(s, Question)]
    assert len(questions) == 3 and len(steps) == 3 + sum(len(e.context) for e in examples[:3])
    for i in questions:
        question = steps[i]
        assert isinstance(question, Question)
        example = next(e for e in examples if e.id == question.task_id)
        mine = [s for s in steps[:i] if isinstance(s, Document) and s.label.startswith(example.id)]
        seen = {s.label.split("/", 1)[1] for s in mine}
        assert example.evidence_titles <= seen  # every supporting paragraph came before the question
        before = steps[i - 1]
        assert isinstance(before, Document) and before.label.split("/", 1)[1] in example.evidence_titles


@needs_shared
def test_real_locomo_loads_with_categories_and_session_order() -> None:
    samples = load_locomo(LOCOMO)
    assert len(samples) == 10 and sum(len(s.qa) for s in samples) == 1986
    adversarial = [q for s in samples for q in s.qa if q.category == 5]
    assert len(adversarial) == 446 and all(q.gold == ADVERSARIAL_GOLD for q in adversarial)
    steps = locomo_steps(samples, sessions=3, questions_per_session=2)
    docs = [s for s in steps if isinstance(s, Document)]
    assert [d.label for d in docs] == ["conv-26/session_1", "conv-26/session_2", "conv-26/session_3"]
    assert docs[0].messages[0]["content"].startswith("[Session 1, ")
    session = 0
    for step in steps:
        if isinstance(step, Document):
            session += 1
        else:
            number = int(step.task_id.split("q")[-1])
            assert max(samples[0].qa[number].evidence_sessions) == session and step.category != "5"


def test_fixture_mc_rows_share_sessions_once() -> None:
    rows = load_locomo_mc(FIXTURE)
    assert len(rows) == 3 and all(len(r.choices) == 10 for r in rows)
    steps = locomo_mc_steps(rows)
    assert [type(s).__name__ for s in steps] == ["Document", "Question", "Document", "Question", "Question"]
    last = steps[-1]
    assert isinstance(last, Question) and last.gold == "Ines, her sister" and last.correct_index == 8


def write(tmp_path: Path, name: str, data: object) -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


HOTPOT_OK = {
    "_id": "x1",
    "question": "Q?",
    "answer": "A",
    "supporting_facts": [["T1", 0]],
    "context": [["T1", ["One."]], ["T2", ["Two."]]],
}


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ("{not json", "not valid UTF-8 JSON"),
        ({"_id": "x"}, "non-empty JSON list"),
        ([], "non-empty JSON list"),
        ([{**HOTPOT_OK, "question": 3}], "record 0: question"),
        ([HOTPOT_OK, {k: v for k, v in HOTPOT_OK.items() if k != "context"}], "record 1: context"),
        ([{**HOTPOT_OK, "supporting_facts": [["Nowhere", 0]]}], "not in context: ['Nowhere']"),
    ],
)
def test_malformed_hotpotqa_names_file_record_and_field(tmp_path: Path, data: object, problem: str) -> None:
    path = write(tmp_path, "hotpot.json", data)
    with pytest.raises(InvalidInput) as err:
        load_hotpotqa(path)
    assert str(path) in str(err.value) and problem in str(err.value) and err.value.field == "hotpotqa"


def test_missing_file_says_which(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match=r"nope\.json does not exist"):
        load_locomo(tmp_path / "nope.json")


LOCOMO_OK = {
    "sample_id": "c1",
    "conversation": {"speaker_a": "A", "speaker_b": "B", "session_1": [{"speaker": "A", "text": "hi"}]},
    "qa": [{"question": "Q?", "answer": "hi", "evidence": ["D1:1"], "category": 4}],
}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"conversation": {"speaker_a": "A", "speaker_b": "B"}}, "no session_N"),
        ({"conversation": {"speaker_a": "A", "session_1": []}}, "speaker_b is missing"),
        ({"conversation": {"speaker_a": "A", "speaker_b": "B", "session_1": [{"text": "x"}]}}, "session_1 must be"),
        ({"qa": [{"question": "Q?", "evidence": [], "category": 2}]}, "category 2 question has no answer"),
        ({"qa": [{"question": "Q?", "answer": "x", "category": 9}]}, "qa.0.category"),
    ],
)
def test_malformed_locomo(tmp_path: Path, change: dict, problem: str) -> None:
    path = write(tmp_path, "locomo.json", [{**LOCOMO_OK, **change}])
    with pytest.raises(InvalidInput, match="record 0") as err:
        load_locomo(path)
    assert problem in str(err.value)


def test_malformed_locomo_mc_names_the_line(tmp_path: Path) -> None:
    good = FIXTURE.read_text().splitlines()[0]
    row = json.loads(good)
    cases = {
        "{broken": "line 2",
        json.dumps({**row, "choices": row["choices"][:4]}): "choices has 4 options; LoCoMo-MC10 needs 10",
        json.dumps({**row, "correct_choice_index": 10}): "correct_choice_index",
        json.dumps({**row, "haystack_session_ids": ["only-one", "two", "three"]}): "3 haystack_session_ids for 1",
        json.dumps({k: v for k, v in row.items() if k != "question"}): "question: Field required",
    }
    for line, problem in cases.items():
        path = write(tmp_path, "mc.jsonl", f"{good}\n{line}\n")
        with pytest.raises(InvalidInput) as err:
            load_locomo_mc(path)
        assert f"{path}, line 2" in str(err.value) and problem in str(err.value)
    with pytest.raises(InvalidInput, match="holds no rows"):
        load_locomo_mc(write(tmp_path, "empty.jsonl", "\n\n"))


@needs_shared
def test_locomo_stream_runs_across_conversations() -> None:
    samples = load_locomo(LOCOMO)
    first = len(locomo_session_numbers(samples[0].conversation))
    steps = locomo_steps(samples, sessions=first + 2, questions_per_session=1)
    labels = [s.label for s in steps if isinstance(s, Document)]
    second = samples[1].sample_id
    assert len(labels) == first + 2 and labels[-2:] == [f"{second}/session_1", f"{second}/session_2"]
    assert 0 < sum(isinstance(s, Question) for s in steps) <= first + 2
