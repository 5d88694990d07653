"""The ingress's wire-format handlers (pure): the real handler code, with ray.serve.llm's chat and the coordinator
replaced by fakes (the chat path's turn logic runs for real on fake replicas)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.types.beta import BetaMessage
from openai.types.responses import Response as OpenAIResponse
from ray.serve.llm.ingress import OpenAiIngress
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from compaction.errors import InvalidInput
from compaction.history import Message
from compaction.partition import PlanLimits
from compaction.tokenizer import ChatTokenizer
from serving.api import CompactionIngress
from serving.coordinator import CompactJob, ServiceResult
from serving.ray_adapter import ChatRequest
from serving.replies import HandOn
from serving.tenants import DEFAULT_TENANT, Tenant
from serving.turns import ChatTurn, TurnCompaction
from serving.wire.messages import CountTokensRequest, MessagesRequest
from serving.wire.responses import CompactResponsesRequest, ResponsesRequest
from tests.fakes import ChatMLTokenizer
from tests.test_coordinator import MODEL, FakeReplicas, coordinator
from tests.test_wire_messages import SYSTEM, coding_messages, edit
from tests.test_wire_responses import ENTRY, INSTRUCTIONS, coding_items
from tests.wire_fakes import WINDOW, ChatPath, chat_stream, completion

ALIAS = "gpt-fake"  # an OpenAI-style name for MODEL (model_aliases)


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


class Ingress(CompactionIngress):
    """The ingress's own handlers over fakes: no Ray, no engine."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:  # the parent's needs deployment handles
        self.path = ChatPath(tokenizer)
        self.tokenizer = tokenizer
        self._windows = {MODEL: WINDOW}
        self._aliases = {ALIAS: MODEL}
        self._defaults: dict[str, dict[str, Any]] = {}
        self._reply_budgets: dict[str, int] = {}
        self._limits = {MODEL: PlanLimits.for_window(WINDOW, 256)}
        self._tokenizers = {MODEL: tokenizer}
        self._counters = {(DEFAULT_TENANT, MODEL): self.path.counter}
        self.turns: list[ChatTurn] = []
        self._replies = HandOn(self._reply_to)
        self.replies: list[tuple[str, str, str, int, dict[str, Any]]] = []  # what went to the coordinator

    async def _reply_to(self, session: str, model: str, tenant: str, messages: int, reply: dict[str, Any]) -> None:
        self.replies.append((model, tenant, session, messages, reply))
        self.path.sessions.replied(model, tenant, session, messages, Message.model_validate(reply))

    async def _turn(self, turn: ChatTurn) -> TurnCompaction:
        self.turns.append(turn)
        return await self.path.ask(turn)

    async def _compact(self, job: CompactJob) -> ServiceResult:
        return await coordinator(self.tokenizer, FakeReplicas()).compact(job)


class Model:
    """ray.serve.llm's chat, answering every request; records what it was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[ChatRequest, str | None]] = []

    async def chat(self, body: ChatRequest, request: Request) -> Response:
        self.sent.append((body, request.headers.get("x-session-id")))
        if body.stream:
            return StreamingResponse(chat_stream(["Do", "ne."]), media_type="text/event-stream")
        return JSONResponse(completion())


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> Model:
    fake = Model()

    async def chat(ingress: OpenAiIngress, body: ChatRequest, request: Request) -> Response:
        return await fake.chat(body, request)

    monkeypatch.setattr(OpenAiIngress, "chat", chat)
    return fake


def http(path: str, session: str | None = None) -> Request:
    headers = [(b"x-session-id", session.encode())] if session else []
    return Request({"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""})


def payload(response: Response) -> dict[str, Any]:
    return dict(json.loads(bytes(response.body)))


async def test_a_responses_turn_compacts_on_the_session_from_prompt_cache_key(
    tokenizer: ChatTokenizer, model: Model
) -> None:
    ingress = Ingress(tokenizer)
    items = [*coding_items(10), {"role": "user", "content": "Which module has the bug?"}]
    body = ResponsesRequest.model_validate(
        {"model": MODEL, "input": items, "instructions": INSTRUCTIONS, "context_management": [ENTRY],
         "prompt_cache_key": "k1", "max_output_tokens": 12}
    )  # fmt: skip
    out = OpenAIResponse.model_validate(payload(await ingress.responses(body, http("/v1/responses"))))
    assert [i.type for i in out.output] == ["compaction", "message"] and out.output_text == "Done."
    sent, session = model.sent[0]
    assert session == "k1" and ingress.turns[0].session_id == "k1" and ingress.turns[0].wire == "responses"
    assert sent.messages[0]["content"] == INSTRUCTIONS and len(sent.messages) < len(items)  # the compacted prompt
    streamed = await ingress.responses(body.model_copy(update={"stream": True}), http("/v1/responses"))
    assert isinstance(streamed, StreamingResponse)
    text = "".join([str(e) async for e in streamed.body_iterator])
    assert text.startswith("event: response.created") and "event: response.completed" in text


async def test_a_messages_turn_pauses_after_its_compaction_without_asking_the_model(
    tokenizer: ChatTokenizer, model: Model
) -> None:
    ingress = Ingress(tokenizer)
    history = [*coding_messages(8), {"role": "user", "content": "Which module has the bug?"}]
    management = {"edits": [edit(pause_after_compaction=True)]}
    body = MessagesRequest.model_validate(
        {"model": MODEL, "max_tokens": 12, "system": SYSTEM, "messages": history, "context_management": management,
         "metadata": {"user_id": "u1"}}
    )  # fmt: skip
    out = BetaMessage.model_validate(payload(await ingress.messages(body, http("/v1/messages"))))
    assert out.stop_reason == "compaction" and not model.sent and ingress.turns[0].session_id == "u1"
    history.append({"role": "assistant", "content": [b.model_dump() for b in out.content]})
    again = BetaMessage.model_validate(
        payload(await ingress.messages(body.model_copy(update={"messages": history}), http("/v1/messages")))
    )
    assert [b.type for b in again.content] == ["text"] and model.sent[0][1] == "u1"
    streamed = await ingress.messages(body.model_copy(update={"stream": True}), http("/v1/messages"))
    assert isinstance(streamed, StreamingResponse)
    text = "".join([str(e) async for e in streamed.body_iterator])
    assert text.startswith("event: message_start") and text.rstrip().endswith('{"type":"message_stop"}')


async def test_a_session_cannot_mix_formats(tokenizer: ChatTokenizer, model: Model) -> None:
    ingress = Ingress(tokenizer)
    items = [*coding_items(10), {"role": "user", "content": "Which module has the bug?"}]
    body = ResponsesRequest.model_validate({"model": MODEL, "input": items, "context_management": [ENTRY]})
    await ingress.responses(body, http("/v1/responses", "s1"))
    history = [*coding_messages(8), {"role": "user", "content": "Which module has the bug?"}]
    messages = MessagesRequest.model_validate(
        {"model": MODEL, "max_tokens": 12, "messages": history, "context_management": {"edits": [edit()]},
         "metadata": {"user_id": "s1"}}
    )  # fmt: skip
    with pytest.raises(InvalidInput) as caught:
        await ingress.messages(messages, http("/v1/messages"))
    assert caught.value.field == "metadata.user_id" and "has responses turns" in caught.value.message
    with pytest.raises(InvalidInput) as caught:
        await ingress.messages(messages, http("/v1/messages", "s1"))
    assert caught.value.field == "x-session-id"


async def test_a_threshold_over_the_window_is_named_as_the_format_names_it(
    tokenizer: ChatTokenizer, model: Model
) -> None:
    ingress = Ingress(tokenizer)
    messages = MessagesRequest.model_validate(
        {"model": MODEL, "max_tokens": 12, "messages": coding_messages(1),
         "context_management": {"edits": [edit(100_000)]}}
    )  # fmt: skip
    with pytest.raises(InvalidInput) as caught:
        await ingress.messages(messages, http("/v1/messages"))
    assert caught.value.field == "context_management.edits[0].trigger.value"
    unknown = messages.model_copy(update={"model": "gpt-9"})
    with pytest.raises(InvalidInput) as caught:
        await ingress.messages(unknown, http("/v1/messages"))
    assert caught.value.field == "model"


async def test_compact_and_count_tokens(tokenizer: ChatTokenizer, model: Model) -> None:
    ingress = Ingress(tokenizer)
    items = [*coding_items(10), {"role": "user", "content": "Which module has the bug?"}]
    body = CompactResponsesRequest.model_validate(
        {
            "model": ALIAS,  # the Responses routes take an alias for a hosted model
            "input": items,
            "instructions": INSTRUCTIONS,
            "chunk_tokens": 256,
            "max_chunk_summary_tokens": 16,
        }
    )
    out = await ingress.responses_compact(body, http("/v1/responses/compact"))
    assert out["object"] == "response.compaction" and out["output"][-1]["type"] == "compaction"
    count = CountTokensRequest.model_validate({"model": MODEL, "system": SYSTEM, "messages": coding_messages(2)})
    counted = await ingress.count_tokens(count, http("/v1/messages/count_tokens"))
    assert 100 < counted["input_tokens"] < 1000 and not model.sent


async def test_a_responses_compact_that_sends_no_options_takes_its_models_default_entry(
    tokenizer: ChatTokenizer, model: Model
) -> None:
    ingress, jobs = Ingress(tokenizer), []
    ingress._defaults = {
        ALIAS: {"type": "compaction", "compact_threshold": 4000, "keep_recent_tokens": 64, "variant": "concise"}
    }
    compact = ingress._compact

    async def recorded(job: CompactJob) -> ServiceResult:
        jobs.append(job)
        return await compact(job)

    ingress._compact = recorded  # type: ignore[method-assign]
    items = [*coding_items(10), {"role": "user", "content": "Which module has the bug?"}]
    for sent in ({}, {"keep_recent_tokens": 128}):  # the Agents SDK's request; one with an option of its own
        body = CompactResponsesRequest.model_validate({"model": ALIAS, "input": items, **sent})
        await ingress.responses_compact(body, http("/v1/responses/compact"))
    default, own = (job.options for job in jobs)
    assert (default.keep_recent_tokens, default.variant) == (64, "concise")
    assert (own.keep_recent_tokens, own.variant) == (128, "default")  # its own options, the rest at their defaults


async def test_a_tenants_turn_carries_its_namespace_and_cache_salt(tokenizer: ChatTokenizer, model: Model) -> None:
    ingress = Ingress(tokenizer)
    ingress._tokenizers = {MODEL: tokenizer}
    items = [*coding_items(10), {"role": "user", "content": "Which module has the bug?"}]
    body = ResponsesRequest.model_validate(
        {"model": MODEL, "input": items, "context_management": [ENTRY], "prompt_cache_key": "k1"}
    )
    request = http("/v1/responses")
    request.scope["state"] = {"tenant": Tenant("team-a", "salt-a")}
    await ingress.responses(body, request)
    turn, (sent, _) = ingress.turns[0], model.sent[0]
    assert (turn.tenant, turn.cache_salt, turn.session_id) == ("team-a", "salt-a", "k1")
    assert sent.cache_salt == "salt-a"  # the model call reads and fills only the tenant's prefix-cache blocks
    assert ("team-a", MODEL) in ingress._counters and ingress._counters[("team-a", MODEL)] is not ingress.path.counter
    with pytest.raises(InvalidInput) as refused:
        await ingress.responses(body, http("/v1/responses", "s" * 257))
    assert refused.value.field == "x-session-id"  # the header gets the body's 256-character check
