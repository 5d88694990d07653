"""The judge's verdict parser on many shapes of reply, its judge choice, and its request."""

from __future__ import annotations

import pytest

from compaction.backend import GenerationRequest
from jobs.agent.judge import RUBRIC, Judge, parse_verdict, pick_judge
from tests.fakes import ChatMLTokenizer, FakeBackend


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [
        ("CORRECT", True),
        ("WRONG", False),
        ("correct.", True),
        (" **CORRECT**\n", True),
        ("Wrong!", False),
        ("INCORRECT", False),
        ("Incorrect. The gold answer is 2019.", False),
        ("Not correct", False),
        ("Verdict: WRONG", False),
        ("Grade: correct", True),
        ("Final answer: **WRONG**", False),
        ('{"label": "CORRECT"}', True),
        ('```json\n{"verdict": "wrong", "reason": "date differs"}\n```', False),
        ('{"is_correct": true}', True),
        ("The assistant's answer is correct because it names the same city.", True),
        ("The answer is incorrect; it gives the wrong year.", False),
        ("I think it is WRONG. The gold answer is correct about 2019.", False),
        ("Label: correct\nExplanation: a wrong date would not match.", True),
        ("Yes", True),
        ("No.", False),
        ("## Verdict\nCORRECT", True),
        ("CORRECT or WRONG", None),  # the rubric echoed back is no verdict
        ("Reply with one word: CORRECT or WRONG.", None),
        ("The gold answer is CORRECT if it is a fact about the band", None),
        ("It is WRONG if it contradicts the gold answer. Verdict: correct", True),
        ("The capital of France is Paris.", None),
        ("", None),
    ],
)
def test_parse_verdict(reply: str, verdict: bool | None) -> None:
    assert parse_verdict(reply) is verdict


def test_pick_judge_prefers_another_model() -> None:
    assert pick_judge("llama-3.3-70b-instruct", ["llama-3.3-70b-instruct", "gpt-oss-120b"]) == "gpt-oss-120b"
    assert pick_judge("gpt-oss-20b", ["llama-3.3-70b-instruct", "gpt-oss-120b"]) == "llama-3.3-70b-instruct"
    assert pick_judge("smollm2-135m-instruct", ["smollm2-135m-instruct"]) == "smollm2-135m-instruct"
    with pytest.raises(ValueError):
        pick_judge("x", [])


async def test_judge_sends_the_fixed_rubric_greedily(tokenizer) -> None:
    def reply(request: GenerationRequest) -> tuple[str, str]:
        return "WRONG", "stop"

    backend = FakeBackend(script=reply)
    grade = await Judge(tokenizer, backend).grade("Which city?", "Lisbon", "Porto")
    assert grade.correct is False and grade.raw == "WRONG"
    (request,) = backend.requests
    assert request.temperature == 0.0 and request.max_tokens == 16
    prompt = tokenizer.decode(request.prompt_token_ids)
    expected = RUBRIC.format(question="Which city?", gold="Lisbon", prediction="Porto")
    assert expected in prompt and prompt.rstrip().endswith("assistant")
