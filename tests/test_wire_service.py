"""The Responses and Messages APIs through the real service (the shared `service` fixture) and the unmodified
official clients: turns, streams, compaction items and blocks sent back, /v1/responses/compact, count_tokens,
errors in each format's shape. Histories stay near 1.2k tokens and replies at a few tokens (CPU model)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import httpx
import pytest

from tests.support import SDK_ALIAS, SERVED_MODEL, SERVICE_KEY, samples, scrape
from tests.test_production import held_still
from tests.test_wire_messages import coding_messages
from tests.test_wire_responses import coding_items

pytestmark = [pytest.mark.ray, pytest.mark.engine]

MODEL = SERVED_MODEL
INSTRUCTIONS = "You are a coding agent. Answer in one short sentence."
ENTRY = {"type": "compaction", "compact_threshold": 1024, "chunk_tokens": 256, "max_chunk_summary_tokens": 24}
EDIT = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 1024}, "chunk_tokens": 256,
        "max_chunk_summary_tokens": 24}  # fmt: skip
BETA = "compact-2026-01-12"
QUESTION = {"role": "user", "content": "Which module has the bug?"}
TOO_HIGH = {"type": "input_tokens", "value": 99_999}  # past the CPU model's 8k window


def openai_client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=SERVICE_KEY, max_retries=0, timeout=600)


def anthropic_client(url: str) -> Any:
    from anthropic import Anthropic

    return Anthropic(base_url=url, api_key=SERVICE_KEY, max_retries=0, timeout=600)


def session() -> str:
    return f"wire-{uuid.uuid4().hex[:8]}"


def respond(client: Any, items: list[Any], key: str, entry: dict[str, Any] = ENTRY, **fields: Any) -> Any:
    return client.responses.create(
        model=MODEL, input=items, instructions=INSTRUCTIONS, max_output_tokens=12, temperature=0,
        context_management=[entry], prompt_cache_key=key, **fields,
    )  # fmt: skip


def test_a_responses_turn_compacts_and_the_next_turn_is_answered_from_its_item(service: Any) -> None:
    client, key = openai_client(service.url), session()
    reply = respond(client, [*coding_items(12), QUESTION], key)
    assert reply.output[0].type == "compaction", reply.output
    compaction = reply.model_extra["compaction"]
    assert compaction["status"] == "applied" and compaction["prompt_tokens"] > 1024
    assert reply.usage.input_tokens < compaction["prompt_tokens"]  # the model answered the compacted prompt
    assert reply.output[0].encrypted_content.startswith("pc1.") and reply.output[0].model_extra["messages"]
    follow = respond(client, [*reply.output, {"role": "user", "content": "And the fix?"}], key)
    assert follow.model_extra["compaction"]["status"] == "none" and follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens < 1024


def test_a_streamed_responses_turn_sends_the_item_first(service: Any) -> None:
    client, key = openai_client(service.url), session()
    events = list(respond(client, [*coding_items(12), QUESTION], key, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed", "response.incomplete"
    )  # fmt: skip
    assert events[2].type == "response.output_item.added" and events[2].item.type == "compaction"
    final = events[-1].response
    assert final.output[0].type == "compaction" and final.output_text.strip()
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text


def test_responses_compact_output_is_the_next_input(service: Any) -> None:
    client, key = openai_client(service.url), session()
    items = [*coding_items(12), QUESTION]
    compacted = client.responses.compact(
        model=MODEL, input=items, instructions=INSTRUCTIONS, prompt_cache_key=key,
        extra_body={"chunk_tokens": 256, "max_chunk_summary_tokens": 24},
    )  # fmt: skip
    assert compacted.object == "response.compaction" and compacted.output[-1].type == "compaction"
    assert compacted.usage.input_tokens > 0 and compacted.usage.output_tokens > 0
    follow = respond(client, [*compacted.output, {"role": "user", "content": "And the fix?"}], key)
    assert follow.output_text.strip() and follow.model_extra["compaction"]["status"] == "none"


def ask(client: Any, history: list[Any], user: str, stream: bool = False, **edit: Any) -> Any:
    create = client.beta.messages.stream if stream else client.beta.messages.create
    return create(
        model=MODEL, max_tokens=12, system=INSTRUCTIONS, messages=history, betas=[BETA],
        context_management={"edits": [{**EDIT, **edit}]}, metadata={"user_id": user},
        extra_body={"temperature": 0},  # the service takes it; anthropic 2.15's create() no longer does
    )  # fmt: skip


def test_a_messages_turn_compacts_the_block_comes_back_and_the_session_keeps_its_format(
    service: Any, client: httpx.Client
) -> None:
    anthropic, user = anthropic_client(service.url), session()
    history = [*coding_messages(10), QUESTION]
    result, go_on = history[2]["content"]
    history[2] = {**history[2], "content": [{**result, "keep": True}, go_on]}  # a tool result marked to keep
    reply = ask(anthropic, history, user)
    assert reply.content[0].type == "compaction", reply.content
    block = reply.content[0]
    assert block.content and block.encrypted_content.startswith("pc1.")
    assert block.content.count("<keep>[tool result toolu_0]") == 1, block.content  # verbatim, once
    assert [i.type for i in reply.usage.iterations] == ["compaction", "message"]
    assert reply.usage.iterations[0].input_tokens > 0 and reply.usage.input_tokens < 1024
    history += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "And the fix?"}]
    follow = ask(anthropic, history, user)
    assert [b.type for b in follow.content] == ["text"] and follow.usage.iterations is None
    # The session now speaks Messages: a Responses turn on it that reaches the coordinator is refused.
    mixed = client.post(
        "/v1/responses",
        json={"model": MODEL, "input": [*coding_items(12), QUESTION], "context_management": [ENTRY]},
        headers={"x-session-id": user},
    )
    assert mixed.status_code == 422, mixed.text
    assert mixed.json()["error"]["param"] == "x-session-id" and "messages turns" in mixed.json()["error"]["message"]


def test_a_streamed_messages_turn_pauses_after_compaction_and_the_resend_is_answered(service: Any) -> None:
    anthropic, user = anthropic_client(service.url), session()
    history = [*coding_messages(10), QUESTION]
    with ask(anthropic, history, user, stream=True, pause_after_compaction=True) as events:
        paused = events.get_final_message()
    assert paused.stop_reason == "compaction" and [b.type for b in paused.content] == ["compaction"]
    history.append({"role": "assistant", "content": paused.content})
    with ask(anthropic, history, user, stream=True, pause_after_compaction=True) as events:
        answered = events.get_final_message()
    assert answered.stop_reason in ("end_turn", "max_tokens") and answered.content[0].type == "text"
    assert answered.content[0].text.strip()


BACKGROUND = {"compact_threshold": 1400, "background_threshold": 900}


def applied_later(send: Any, outcome: Any) -> Any:
    """The agent's turns, 2 s of tool time apart, until one applies the background run (at most 5 minutes)."""
    deadline = time.monotonic() + 300
    while True:
        time.sleep(2)
        reply = send()
        if outcome(reply)["status"] == "applied" or time.monotonic() > deadline:
            return reply


def test_a_background_compaction_through_responses_costs_a_turn_a_tenth_of_a_blocking_one(service: Any) -> None:
    client, key = openai_client(service.url), session()
    history = [*coding_items(16)[:40], {"role": "user", "content": "Keep going."}]  # ~1,010 tokens: past 900
    entry = {**ENTRY, **BACKGROUND}
    first = respond(client, history, key, entry).model_extra["compaction"]
    assert first["status"] == "running" and 900 < first["prompt_tokens"] <= 1400
    later = applied_later(lambda: respond(client, history, key, entry), lambda r: r.model_extra["compaction"])
    compaction = later.model_extra["compaction"]
    assert compaction["status"] == "applied" and compaction["source"] == "background", compaction
    assert later.output[0].type == "compaction" and compaction["stats"]["priority"] == "background"
    fresh = {**ENTRY, "compact_threshold": 900, "reuse_chunks": False}  # not from the background run's summaries
    blocking = respond(client, history, session(), fresh).model_extra["compaction"]
    assert blocking["status"] == "applied" and blocking["source"] == "blocking", blocking
    assert compaction["stall_s"] <= 0.1 * blocking["stall_s"], (compaction["stall_s"], blocking["stall_s"])
    print(f"responses: background stall {compaction['stall_s']:.3f} s, blocking {blocking['stall_s']:.2f} s")


def test_a_background_compaction_through_messages_costs_a_turn_a_tenth_of_a_blocking_one(service: Any) -> None:
    anthropic, user = anthropic_client(service.url), session()
    history = [*coding_messages(14)[:36], {"role": "user", "content": "Keep going."}]  # ~1,040 tokens
    trigger = {"type": "input_tokens", "value": BACKGROUND["compact_threshold"]}
    edit = {"trigger": trigger, "background_threshold": BACKGROUND["background_threshold"]}
    first = ask(anthropic, history, user, **edit)
    assert first.model_extra["compaction"]["status"] == "running" and first.stop_reason != "compaction"
    later = applied_later(lambda: ask(anthropic, history, user, **edit), lambda r: r.model_extra["compaction"])
    compaction = later.model_extra["compaction"]
    assert compaction["status"] == "applied" and compaction["source"] == "background", compaction
    assert later.content[0].type == "compaction" and later.usage.iterations[0].type == "compaction"
    now = {"type": "input_tokens", "value": BACKGROUND["background_threshold"]}
    blocking = ask(anthropic, history, session(), trigger=now, reuse_chunks=False).model_extra["compaction"]
    assert blocking["status"] == "applied" and blocking["source"] == "blocking", blocking
    assert compaction["stall_s"] <= 0.1 * blocking["stall_s"], (compaction["stall_s"], blocking["stall_s"])
    print(f"messages: background stall {compaction['stall_s']:.3f} s, blocking {blocking['stall_s']:.2f} s")


def test_count_tokens_is_the_prompt_the_model_reads(service: Any) -> None:
    anthropic = anthropic_client(service.url)
    history = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."},
               {"role": "user", "content": "Again."}]  # fmt: skip
    counted = anthropic.messages.count_tokens(model=MODEL, system=INSTRUCTIONS, messages=history)
    reply = anthropic.messages.create(model=MODEL, max_tokens=4, system=INSTRUCTIONS, messages=history)
    assert counted.input_tokens == reply.usage.input_tokens > 0


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ("/v1/responses", {"input": [{"type": "compaction", "encrypted_content": "gAAAAB"}]},
         "input[0].encrypted_content"),
        ("/v1/responses", {"input": "hi", "context_management": [{"type": "compaction", "compact_threshold": "big"}]},
         "context_management[0].compact_threshold"),
        ("/v1/responses", {"input": "hi", "model": "gpt-9"}, "model"),
        ("/v1/responses/compact", {"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
         "messages[0].content[0].type"),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "assistant", "content": [
            {"type": "compaction", "content": "x", "encrypted_content": "pc1.AAAA"}]}]},
         "messages[0].content[0].encrypted_content"),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                          "context_management": {"edits": [{**EDIT, "trigger": TOO_HIGH}]}},
         "context_management.edits[0].trigger.value"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ("/v1/messages/count_tokens", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ],
)  # fmt: skip
def test_bad_input_gets_a_4xx_in_the_formats_shape_naming_the_field(
    client: httpx.Client, path: str, body: dict[str, Any], field: str
) -> None:
    response = client.post(path, json={"model": MODEL, **body})
    assert 400 <= response.status_code < 500, response.text
    error = response.json()
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and error["error"]["type"] in ("invalid_request_error", "not_found_error")
        assert field in error["error"]["message"]
    else:
        assert error["error"]["param"] == field and field in error["error"]["message"]


def test_the_sdks_raise_their_own_errors(service: Any) -> None:
    import anthropic
    import openai

    with pytest.raises(openai.APIStatusError) as raised:
        openai_client(service.url).responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert raised.value.status_code == 422 and "not stored" in raised.value.message
    with pytest.raises(anthropic.APIStatusError) as caught:
        anthropic_client(service.url).messages.create(model="gpt-9", max_tokens=4, messages=[QUESTION])
    assert caught.value.status_code == 404 and caught.value.body["error"]["type"] == "not_found_error"


def single_chunk_and_all_compactions(metrics_url: str) -> tuple[float, float]:
    """Compactions of one chunk, and all compactions, the service has answered (its histogram of chunks)."""
    text = scrape(metrics_url)
    single = sum(samples(text, "ray_compaction_chunks_bucket", le="1.0"))
    return single, sum(samples(text, "ray_compaction_chunks_count"))


def test_the_openai_agents_sdks_compaction_session_compacts_through_the_service(service: Any, metrics_url: str) -> None:
    """The Agents SDK, unmodified: agents on /v1/responses whose session calls /v1/responses/compact itself once four
    model items have piled up (no options in it: its name's default_compaction entry gives them), and goes on from the
    compaction item. A recorder agent's turns are each a tool call it is made to send (a named tool_choice, a strict
    schema: the engine's grammar writes it, so the turn ends the same way on any machine) and the tool's answer ends its
    run; the SDK compacts only after a model's answer, never right after a local tool's output, so a reviewer agent (no
    tools, a typed answer the grammar writes) ends every second step. Tool calls and their results round-trip through
    the service, and through its compaction."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        SQLiteSession,
        function_tool,
        set_tracing_disabled,
    )
    from agents.memory import OpenAIResponsesCompactionSession
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    class Verdict(BaseModel):
        verdict: Literal["ok", "fail"]

    set_tracing_disabled(True)  # no trace export to api.openai.com
    steps = [f"Step {i}: " + " ".join(f"module_{i}.py line {n} splits on commas." for n in range(30)) for i in range(3)]
    calls: list[str] = []

    @function_tool
    def record(verdict: Literal["ok", "fail"]) -> str:
        """Record the step's verdict."""
        calls.append(verdict)
        return f"recorded {verdict}"

    async def run() -> tuple[list[Any], list[Any]]:
        client = AsyncOpenAI(base_url=f"{service.url}/v1", api_key=SERVICE_KEY, max_retries=0)
        model = OpenAIResponsesModel(model=SDK_ALIAS, openai_client=client)
        settings = ModelSettings(max_tokens=64, temperature=0, store=False)
        forced = settings.resolve(ModelSettings(tool_choice="record"))
        recorder = Agent(
            name="coder", instructions="Record the verdict of each step.", model=model, tools=[record],
            model_settings=forced, tool_use_behavior="stop_on_first_tool",
        )  # fmt: skip
        reviewer = Agent(name="reviewer", instructions="Give the step's verdict.", model=model,
                         model_settings=settings, output_type=Verdict)  # fmt: skip
        key = session()
        compacting = OpenAIResponsesCompactionSession(
            key,
            SQLiteSession(key),
            client=client,
            model=SDK_ALIAS,
            compaction_mode="input",
            should_trigger_compaction=lambda context: len(context["compaction_candidate_items"]) >= 4,
        )
        answers = []
        for step in steps:
            answers.append((await Runner.run(recorder, step, session=compacting)).final_output)
            answers.append((await Runner.run(reviewer, "And your verdict?", session=compacting)).final_output)
        return await compacting.get_items(), answers

    before = single_chunk_and_all_compactions(metrics_url)
    items, answers = asyncio.run(run())
    held_still(lambda: single_chunk_and_all_compactions(metrics_url)[1], 1.5, 30)  # Ray exports each second
    after = single_chunk_and_all_compactions(metrics_url)
    single, compactions = after[0] - before[0], after[1] - before[1]
    # The entry's 256-token chunks, not one chunk of 2,048 (another test's late compactions may count too).
    assert compactions >= 1 and single < compactions, (single, compactions)
    assert len(calls) == len(steps) and all(str(a).startswith("recorded ") for a in answers[::2]), (calls, answers)
    assert all(isinstance(a, Verdict) for a in answers[1::2]), answers
    kinds = [item.get("type") for item in items if isinstance(item, dict)]
    assert "compaction" in kinds, kinds  # the session's history now starts from our compaction item
    assert len(items) < 6 * len(steps)  # shorter than the 18 items the three steps left (task, call, output, x2)
