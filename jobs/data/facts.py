"""Histories with known content, for the retention benchmark: what was said, where, and how to ask for it.

- Coding-agent traces (`jobs.data.traces`): five planted facts per trace (the failing test, the
  root cause, the user's constraint, the chosen fix, the reproduction command).
- Data-analysis agent traces (`jobs.data.analysis_traces`): six (the user's requirement and
  follow-up, the answering query, a metric, an explained anomaly, the conclusion).
- LoCoMo conversations: questions of categories 1-4 whose gold answer is spelled out in one of
  their evidence turns (`D3:12` names session 3, turn 12), within the snapshot. Answers that
  only follow from the evidence (dates computed from "yesterday", yes/no) cannot be checked by
  string and are left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from compaction.tokenizer import ChatTokenizer
from jobs.data.analysis_traces import analysis_trace
from jobs.data.conversations import locomo_messages, locomo_session_numbers, truncate_history
from jobs.data.datasets import LocomoSample
from jobs.data.traces import coding_trace

MIN_ANSWER_CHARS = 4  # shorter answers ("Yes", "5") turn up anywhere by chance


@dataclass(frozen=True)
class Fact:
    """One known piece of a history."""

    kind: str  # a planted fact's kind (failing_test, root_cause, ...) or "locomo_qa"
    text: str  # the exact string; recalled (exact) when it occurs in the compacted history
    question: str  # asks for `text` (judged recall)
    message_index: int  # the message that holds it


@dataclass(frozen=True)
class KnownHistory:
    messages: list[dict[str, Any]]  # OpenAI chat messages
    facts: list[Fact]  # in message order
    label: str  # where it comes from: "coding seed 3", "locomo conv-26"


def normalise(text: str) -> str:
    """Lower case, white space collapsed: how recall compares strings."""
    return " ".join(text.lower().split())


def coding_history(seed: int, tokens: int, tokenizer: ChatTokenizer) -> KnownHistory:
    trace = coding_trace(seed, tokens, tokenizer)
    facts = [Fact(f.kind, f.text, f.question, f.message_index) for f in trace.facts]
    return KnownHistory(trace.messages, facts, f"coding seed {seed}")


def analysis_history(seed: int, tokens: int, tokenizer: ChatTokenizer) -> KnownHistory:
    trace = analysis_trace(seed, tokens, tokenizer)
    facts = [Fact(f.kind, f.text, f.question, f.message_index) for f in trace.facts]
    return KnownHistory(trace.messages, facts, f"analysis seed {seed}")


def _turn_indices(conversation: dict[str, Any]) -> dict[str, int]:
    """Dialogue id (D3:12) -> index of its message in `locomo_messages` (same order)."""
    out: dict[str, int] = {}
    for number in locomo_session_numbers(conversation):
        for turn in conversation[f"session_{number}"]:
            out[str(turn.get("dia_id", ""))] = len(out)
    return out


def locomo_history(sample: LocomoSample, tokens: int, tokenizer: ChatTokenizer) -> KnownHistory:
    """The conversation's first `tokens` tokens (whole messages) and the QA answers spelled out inside them."""
    messages = truncate_history(locomo_messages(sample.model_dump()), tokenizer, tokens)
    where = _turn_indices(sample.conversation)
    facts: list[Fact] = []
    for qa in sample.qa:
        answer = str(qa.answer).strip().strip("\"'“”.").strip()
        if qa.category == 5 or len(answer) < MIN_ANSWER_CHARS:
            continue
        turns = [where[e] for e in qa.evidence if e in where]
        if not turns or max(turns) >= len(messages) or len(turns) != len(qa.evidence):
            continue
        pattern = re.compile(rf"(?<!\w){re.escape(normalise(answer))}(?!\w)")
        holder = next((i for i in turns if pattern.search(normalise(messages[i]["content"]))), None)
        if holder is not None:
            facts.append(Fact("locomo_qa", answer, qa.question, holder))
    facts.sort(key=lambda f: f.message_index)
    return KnownHistory(messages, facts, f"locomo {sample.sample_id}")
