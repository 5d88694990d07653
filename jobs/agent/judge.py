"""The LLM judge: one fixed rubric, temperature 0, and a parser that reads many shapes of verdict.

The judge should be a different model from the agent, to avoid self-preference (the paper
used Qwen3-30B). `pick_judge` takes the first preferred catalogue model that is not the agent;
when the only candidate is the agent itself (the CPU default), results carry
`judge_is_agent_model = true`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from compaction.backend import Backend, GenerationRequest

RUBRIC = """You are grading the answer of a question-answering assistant against the gold answer.

Question: {question}
Gold answer: {gold}
Assistant's answer: {prediction}

The assistant's answer is CORRECT if it states the same fact as the gold answer; it may be longer, \
worded differently, or give a date or number in another format. It is WRONG if it contradicts the \
gold answer, leaves it out, or says it does not know.

Reply with one word: CORRECT or WRONG."""

_POSITIVE = {"correct", "right", "true", "yes", "accurate", "pass"}
_NEGATIVE = {"wrong", "incorrect", "false", "no", "inaccurate", "fail", "not correct", "not right"}
_STRONG = re.compile(r"\b(not correct|not right|incorrect|inaccurate|correct|wrong|accurate)\b")
_LABELLED = re.compile(
    r"\b(?:label|verdict|grade|judg(?:e)?ment|result|rating|final answer)\b\s*(?:is|=|:)\s*"
    r"[\"'*`]*(not correct|not right|[a-z]+)"
)
# The rubric's own wording echoed back ("CORRECT or WRONG", "is CORRECT if it ...") is no verdict.
_ECHO = re.compile(r"\bcorrect\s*(?:or|/|,)\s*wrong\b|\bwrong\s*(?:or|/|,)\s*correct\b|\b(?:correct|wrong) if\b")


def _word_verdict(word: str) -> bool | None:
    word = word.strip().lower()
    if word in _POSITIVE:
        return True
    if word in _NEGATIVE:
        return False
    return None


def _json_verdict(text: str) -> bool | None:
    for blob in re.findall(r"\{[^{}]*\}", text):
        try:
            data = json.loads(blob)
        except json.JSONDecodeError:
            continue
        for key in ("label", "verdict", "grade", "judgement", "judgment", "result", "correct", "is_correct"):
            value = data.get(key) if isinstance(data, dict) else None
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and _word_verdict(value) is not None:
                return _word_verdict(value)
    return None


def parse_verdict(text: str) -> bool | None:
    """True for CORRECT, False for WRONG, None when the reply says neither (or both, echoing the rubric).

    Order: a JSON object with a label; a labelled line (`Verdict: WRONG`); the reply's first word;
    the first strong verdict word anywhere (`incorrect` and `not correct` before `correct`).
    """
    found = _json_verdict(text)
    if found is not None:
        return found
    plain = _ECHO.sub(" ", re.sub(r"[*_`#>]", "", text).lower())
    for match in _LABELLED.finditer(plain):
        if (word := _word_verdict(match.group(1))) is not None:
            return word
    first = re.match(r"\s*([a-z]+(?: correct| right)?)", plain)
    if first and (word := _word_verdict(first.group(1))) is not None:
        return word
    strong = _STRONG.search(plain)
    return _word_verdict(strong.group(1)) if strong else None


def pick_judge(agent_model: str, preferences: Sequence[str]) -> str:
    """The first preferred judge that is not the agent; the agent itself when nothing else is listed."""
    if not preferences:
        raise ValueError("no judge model configured")
    for name in preferences:
        if name != agent_model:
            return name
    return agent_model


class PromptTokenizer(Protocol):
    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Grade:
    correct: bool | None  # None: the judge's reply had no readable verdict
    raw: str  # the judge's reply, kept for auditing the parser


class Judge:
    """Grades free-form answers with the rubric on its own model (tokenizer + backend)."""

    def __init__(self, tokenizer: PromptTokenizer, backend: Backend, max_tokens: int = 16) -> None:
        self.tokenizer = tokenizer
        self.backend = backend
        self.max_tokens = max_tokens

    def prompt_ids(self, question: str, gold: str, prediction: str) -> tuple[int, ...]:
        content = RUBRIC.format(question=question, gold=gold, prediction=prediction.strip() or "(no answer)")
        text = self.tokenizer.render([{"role": "user", "content": content}], add_generation_prompt=True)
        return tuple(self.tokenizer.encode(text))

    async def grade(self, question: str, gold: str, prediction: str) -> Grade:
        request = GenerationRequest(
            prompt_token_ids=self.prompt_ids(question, gold, prediction),
            max_tokens=self.max_tokens,
            temperature=0.0,
            request_id="judge",
        )
        reply = await self.backend.generate(request)
        return Grade(parse_verdict(reply.text), reply.text)
