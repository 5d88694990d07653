"""Benchmark loaders: HotpotQA (dev, distractor), LoCoMo (locomo10.json) and LoCoMo-MC10 (JSONL).

Every loader takes a path, validates each record with pydantic, and raises `InvalidInput`
naming the file, the record and the field when something is wrong. Records keep only what the
agent pipeline needs; unknown keys in a record are ignored (the public files carry extra ones).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from compaction.errors import InvalidInput

MC_CHOICES = 10
ADVERSARIAL_GOLD = "Not mentioned in the conversation"
_EVIDENCE = re.compile(r"D:?(\d+):\d+")


class HotpotExample(BaseModel):
    """One HotpotQA question with its ten paragraphs (original JSON keys)."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)
    id: str = Field(alias="_id", min_length=1, description="HotpotQA question id.")
    question: str = Field(min_length=1)
    answer: str = Field(description="Gold short answer (EM/F1 reference).")
    type: str | None = Field(None, description="bridge or comparison.")
    level: str | None = Field(None, description="easy, medium or hard.")
    supporting_facts: list[tuple[str, int]] = Field(description="(paragraph title, sentence index) pairs.")
    context: list[tuple[str, list[str]]] = Field(min_length=1, description="(title, sentences) paragraphs.")

    @model_validator(mode="after")
    def _evidence_in_context(self) -> HotpotExample:
        titles = {title for title, _ in self.context}
        missing = sorted({t for t, _ in self.supporting_facts} - titles)
        if missing:
            raise ValueError(f"supporting_facts name paragraphs not in context: {missing}")
        return self

    @property
    def evidence_titles(self) -> set[str]:
        return {title for title, _ in self.supporting_facts}


class LocomoQA(BaseModel):
    """One LoCoMo question. Category 5 is adversarial: the answer is not in the conversation."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    question: str = Field(min_length=1)
    answer: str | int | float | None = Field(None, description="Gold answer; absent for most category 5.")
    adversarial_answer: str | None = Field(None, description="The tempting wrong answer (category 5).")
    evidence: list[str] = Field(default_factory=list, description="Dialogue ids such as D3:12.")
    category: int = Field(
        ge=1, le=5, description="1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial."
    )

    @model_validator(mode="after")
    def _has_gold(self) -> LocomoQA:
        if self.category != 5 and self.answer is None:
            raise ValueError(f"category {self.category} question has no answer")
        return self

    @property
    def gold(self) -> str:
        return ADVERSARIAL_GOLD if self.category == 5 else str(self.answer)

    @property
    def evidence_sessions(self) -> list[int]:
        """Session numbers the evidence points at (malformed ids such as `D` are skipped)."""
        return sorted({int(m.group(1)) for e in self.evidence for m in _EVIDENCE.finditer(e)})


class LocomoSample(BaseModel):
    """One LoCoMo conversation: sessions (session_N, session_N_date_time) and its questions."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    sample_id: str = Field(min_length=1)
    conversation: dict[str, Any] = Field(description="speaker_a, speaker_b, session_N lists, their dates.")
    qa: list[LocomoQA]

    @field_validator("conversation")
    @classmethod
    def _sessions(cls, conversation: dict[str, Any]) -> dict[str, Any]:
        for key in ("speaker_a", "speaker_b"):
            if not isinstance(conversation.get(key), str):
                raise ValueError(f"conversation.{key} is missing or not a string")
        sessions = [k for k in conversation if re.fullmatch(r"session_\d+", k)]
        if not sessions:
            raise ValueError("conversation has no session_N entries")
        for key in sessions:
            turns = conversation[key]
            if not isinstance(turns, list) or not all(
                isinstance(t, dict) and isinstance(t.get("speaker"), str) and isinstance(t.get("text"), str)
                for t in turns
            ):
                raise ValueError(f"conversation.{key} must be a list of {{speaker, text}} turns")
        return conversation


class ChatTurn(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    role: str = Field(min_length=1)
    content: str


class LocomoMCRow(BaseModel):
    """One LoCoMo-MC10 row: a question, ten choices, and the sessions it is asked over."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    question_id: str = Field(min_length=1)
    question: str = Field(min_length=1)
    question_type: str | None = Field(None, description="LoCoMo category name of the question.")
    answer: str | None = Field(None, description="The correct choice's text.")
    choices: list[str] = Field(description="Exactly ten answer options.")
    correct_choice_index: int = Field(ge=0, lt=MC_CHOICES)
    haystack_session_ids: list[str] = Field(description="One id per session, in order.")
    haystack_sessions: list[list[ChatTurn]] = Field(min_length=1, description="Sessions as role/content turns.")
    haystack_session_datetimes: list[str] | None = Field(None, description="When each session took place.")

    @model_validator(mode="after")
    def _consistent(self) -> LocomoMCRow:
        if len(self.choices) != MC_CHOICES:
            raise ValueError(f"choices has {len(self.choices)} options; LoCoMo-MC10 needs {MC_CHOICES}")
        if len(self.haystack_session_ids) != len(self.haystack_sessions):
            raise ValueError(
                f"{len(self.haystack_session_ids)} haystack_session_ids for {len(self.haystack_sessions)} sessions"
            )
        dates = self.haystack_session_datetimes
        if dates is not None and len(dates) != len(self.haystack_sessions):
            raise ValueError(f"{len(dates)} haystack_session_datetimes for {len(self.haystack_sessions)} sessions")
        return self


def _read_json(path: Path, what: str) -> Any:
    if not path.exists():
        raise InvalidInput(what, f"{path} does not exist; pass the path of the {what} file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInput(what, f"{path} is not valid UTF-8 JSON: {exc}") from exc


def _problem(exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    return f"{loc}: {first['msg']}" if loc else str(first["msg"])


def _validate_list(path: Path, what: str, data: Any, model: type[BaseModel]) -> list[Any]:
    if not isinstance(data, list) or not data:
        raise InvalidInput(what, f"{path} must hold a non-empty JSON list of records")
    out = []
    for i, record in enumerate(data):
        try:
            out.append(model.model_validate(record))
        except ValidationError as exc:
            raise InvalidInput(what, f"{path}, record {i}: {_problem(exc)}") from exc
    return out


def load_hotpotqa(path: str | Path) -> list[HotpotExample]:
    """HotpotQA in its original JSON format (a list of examples), e.g. the dev distractor set."""
    file = Path(path)
    return _validate_list(file, "hotpotqa", _read_json(file, "hotpotqa"), HotpotExample)


def load_locomo(path: str | Path) -> list[LocomoSample]:
    """LoCoMo's locomo10.json: a list of conversations with their QA."""
    file = Path(path)
    return _validate_list(file, "locomo", _read_json(file, "locomo"), LocomoSample)


def load_locomo_mc(path: str | Path) -> list[LocomoMCRow]:
    """LoCoMo-MC10: JSON Lines, one question per line (blank lines allowed)."""
    file = Path(path)
    if not file.exists():
        raise InvalidInput("locomo_mc", f"{file} does not exist; pass the path of the LoCoMo-MC10 JSONL file")
    rows: list[LocomoMCRow] = []
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InvalidInput("locomo_mc", f"{file} is not UTF-8: {exc}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(LocomoMCRow.model_validate_json(line))
        except ValidationError as exc:
            raise InvalidInput("locomo_mc", f"{file}, line {number}: {_problem(exc)}") from exc
    if not rows:
        raise InvalidInput("locomo_mc", f"{file} holds no rows")
    return rows
