"""Server-side compaction through the real service (the shared `service` fixture) and the unmodified openai client."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest

from compaction.history import parse_messages
from compaction.turn_policy import prompt_tokens
from jobs.data.traces import TOOLS, coding_trace
from serving.tenants import DEFAULT_TENANT
from tests.support import SERVED_MODEL, SERVICE_KEY

pytestmark = [pytest.mark.ray, pytest.mark.engine]

MODEL = SERVED_MODEL
SYSTEM = {"role": "system", "content": "You are a coding agent. Answer in one short sentence."}
ENTRY = {"type": "compaction", "compact_threshold": 1024, "chunk_tokens": 256, "max_chunk_summary_tokens": 24}


def coding_history(steps: int) -> list[dict[str, Any]]:
    """A coding agent's history: tasks, tool calls with null content, tool results."""
    out: list[dict[str, Any]] = [SYSTEM]
    for i in range(steps):
        out.append({"role": "user", "content": f"Step {i}: check module_{i}.py for the parser bug and report."})
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "read_file", "arguments": f'{{"i": {i}}}'}}
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        body = f"def parse_{i}(text):\n    return text.split(',')[{i}]  # line {10 + i}\n"
        out.append({"role": "tool", "tool_call_id": f"call_{i}", "content": body})
        out.append({"role": "assistant", "content": f"module_{i}.py splits on commas at index {i}."})
    return out


def openai_client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=SERVICE_KEY, max_retries=0, timeout=600)


def ask(client: Any, history: list[dict[str, Any]], session: str, stream: bool = False, **entry: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=history,
        max_tokens=12,
        temperature=0,
        stream=stream,
        extra_body={"context_management": [{**ENTRY, **entry}]},
        extra_headers={"x-session-id": session},
    )


def test_the_openai_client_gets_compaction_back_and_continues_from_it(service: Any) -> None:
    client, session = openai_client(service.url), f"chat-{uuid.uuid4().hex[:8]}"
    history = [*coding_history(12), {"role": "user", "content": "Which module has the bug?"}]
    history[7] = {**history[7], "keep": True}  # step 1's tool result, marked to keep: verbatim in the head
    reply = ask(client, history, session)
    compaction = reply.model_extra["compaction"]
    assert compaction["status"] == "applied", compaction
    marked = f"<keep>[tool result call_1] {history[7]['content'].strip()}</keep>"
    assert [marked in (m.get("content") or "") for m in compaction["messages"]].count(True) == 1
    assert compaction["prompt_tokens"] > 1024 > compaction["compacted_prompt_tokens"]
    assert reply.usage.prompt_tokens < compaction["prompt_tokens"]  # the model answered the compacted prompt
    assert compaction["stats"]["chunks"] >= 2 and compaction["source"] == "blocking"
    assert all(None not in m.values() for m in compaction["messages"])  # sendable as they are
    history = compaction["messages"] + history[compaction["replaces_through"] :]
    assert history[-1]["content"] == "Which module has the bug?"  # the current turn was never summarised
    history += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
    history += [{"role": "user", "content": "And what should the fix be?"}]
    follow = ask(client, history, session)
    assert follow.model_extra["compaction"]["status"] == "none" and follow.choices[0].message.content


def test_streaming_carries_compaction_on_the_final_chunk(service: Any) -> None:
    client, session = openai_client(service.url), f"chat-{uuid.uuid4().hex[:8]}"
    history = [*coding_history(12), {"role": "user", "content": "Summarise what you found."}]
    chunks = list(ask(client, history, session, stream=True))
    carrying = [c for c in chunks if (c.model_extra or {}).get("compaction")]
    assert len(carrying) == 1 and carrying[0] is chunks[-1]
    compaction = carrying[0].model_extra["compaction"]
    assert compaction["status"] == "applied" and compaction["messages"] and compaction["replaces_through"] > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()


def test_background_compaction_is_applied_later_with_less_stall_than_it_took(service: Any) -> None:
    client, session = openai_client(service.url), f"chat-{uuid.uuid4().hex[:8]}"
    entry = {"compact_threshold": 1700, "background_threshold": 1100, "apply_background": "threshold"}
    entry["reuse_chunks"] = False  # summarised afresh: other tests compact these histories too
    steps = coding_history(16)
    history = [*steps[:41], {"role": "user", "content": "Keep going."}]  # ~1,190 tokens: past the soft threshold
    first = ask(client, history, session, **entry).model_extra["compaction"]
    assert first["status"] == "running" and 1100 < first["prompt_tokens"] <= 1700
    history += [{"role": "assistant", "content": "Going on."}, *steps[41:49]]  # ~1,440: between the thresholds
    assert ask(client, history, session, **entry).model_extra["compaction"]["status"] == "running"
    history += [{"role": "assistant", "content": "Yes."}, *steps[49:], {"role": "user", "content": "Done?"}]
    later = ask(client, history, session, **entry).model_extra["compaction"]
    assert later["status"] == "applied" and later["source"] == "background", later
    assert later["replaces_through"] <= 42  # every message after the snapshot stays verbatim
    assert later["stall_s"] < later["stats"]["latency_s"]  # it waited less than the compaction took, if at all
    assert later["compacted_prompt_tokens"] < 1700


def test_a_rolling_session_compacts_at_its_threshold_as_blocking_would_from_summaries_made_meanwhile(
    service: Any,
) -> None:
    """apply_background "rolling": the turn past the soft threshold starts summarising the history's whole chunks
    in the background; the turn past compact_threshold compacts that history exactly as a blocking compaction
    does (the same chunks, the same turns kept), taking those summaries instead of making them again."""
    client, session = openai_client(service.url), f"chat-{uuid.uuid4().hex[:8]}"
    entry = {"compact_threshold": 1400, "background_threshold": 900, "apply_background": "rolling"}
    entry["max_chunk_summary_tokens"] = 20  # its own chunk summaries: other tests compact these histories too
    steps = coding_history(16)
    history = [*steps[:41], {"role": "user", "content": "Keep going."}]  # ~1,010 tokens: past the soft threshold
    first = ask(client, history, session, **entry).model_extra["compaction"]
    assert first["status"] == "running" and 900 < first["prompt_tokens"] <= 1400
    history += [{"role": "assistant", "content": "Going on."}, *steps[41:], {"role": "user", "content": "Done?"}]
    rolled = ask(client, history, session, **entry).model_extra["compaction"]
    assert rolled["status"] == "applied" and rolled["source"] == "background", rolled
    assert rolled["stats"]["reused_chunks"] >= 1  # made in the background (finished, or joined in flight)
    blocking = ask(client, history, f"chat-{uuid.uuid4().hex[:8]}", **{**entry, "reuse_chunks": False})
    made = blocking.model_extra["compaction"]
    assert made["status"] == "applied" and made["source"] == "blocking" and made["stats"]["reused_chunks"] == 0
    borders = lambda c: [(k["start"], k["end"]) for k in c["stats"]["per_chunk"]]  # noqa: E731
    assert borders(rolled) == borders(made) and rolled["replaces_through"] == made["replaces_through"]


def settled(session: str) -> bool:
    """The session's background work has ended on the coordinator replica it hashes to (serving.app.settled)."""
    from ray import serve

    from serving.local import APP_NAME

    coordinator = serve.get_deployment_handle("Coordinator", app_name=APP_NAME)
    call = coordinator.options(method_name="settled", session_id=session)
    return bool(call.remote(DEFAULT_TENANT, session).result())


def test_a_rolling_sessions_last_turn_before_the_threshold_and_its_reply_roll_the_chunks_its_compaction_takes(
    service: Any, tokenizer: Any
) -> None:
    """The turn after which one more like it passes compact_threshold rolls its whole history, last chunk too, and
    once its reply is sent, that history with the reply; the turn past the threshold (the reply sent back as the
    model gave it, then a new turn longer than keep_recent_tokens, 425: a quarter of 1700) compacts as blocking
    does: the same chunks, the reply in the last one, the same turns kept (the fake-engine tests in test_sessions
    show nothing is sent)."""
    client, session = openai_client(service.url), f"chat-{uuid.uuid4().hex[:8]}"
    entry = {"compact_threshold": 1700, "background_threshold": 1100, "apply_background": "rolling"}
    entry |= {"max_chunk_summary_tokens": 16, "background_min_idle_s": 0}  # this test sends its turns back to back
    steps = coding_history(16)
    history = [*steps[:33], {"role": "user", "content": "Keep going."}]
    assert ask(client, history, session, **entry).model_extra["compaction"]["status"] == "none"  # below 1100
    grown = history
    for end in range(37, len(steps) + 1, 4):  # whole steps; one more turn like this one (~550 tokens) passes 1700
        grown = [
            *history,
            {"role": "assistant", "content": "Going on."},
            *steps[33:end],
            {"role": "user", "content": "Next."},
        ]
        if prompt_tokens(parse_messages(grown), tokenizer) >= 1500:
            break
    answer = ask(client, grown, session, **entry)
    last = answer.model_extra["compaction"]
    assert last["status"] == "running" and 1300 < last["prompt_tokens"] <= 1700, last
    assert "reply_for" not in last  # the service's own
    assert settled(session)  # the last run, then its follow-up with the reply (the ingress hands it on once sent)
    report = "Report: " + " ".join(f"module_{i}.py is fine at line {10 + i}." for i in range(40))  # 552 tokens
    reply = {"role": "assistant", "content": answer.choices[0].message.content}
    over = [*grown, reply, {"role": "user", "content": report}]
    rolled = ask(client, over, session, **entry).model_extra["compaction"]
    assert rolled["status"] == "applied" and rolled["source"] == "background", rolled
    blocking = ask(client, over, f"chat-{uuid.uuid4().hex[:8]}", **{**entry, "reuse_chunks": False})
    made = blocking.model_extra["compaction"]  # blocking summarises the reply too (the new turn alone is over 425)
    assert made["status"] == "applied" and rolled["replaces_through"] == made["replaces_through"] == len(grown) + 1
    borders = lambda c: [(k["start"], k["end"]) for k in c["stats"]["per_chunk"]]  # noqa: E731
    assert borders(rolled) == borders(made)
    # Summarised by the runs, or asked again where a run's summary fell back (never kept; how many varies with the
    # numerics): the last chunk, the reply's, was rolled only after the reply was sent.
    assert rolled["stats"]["reused_chunks"] >= 1


def test_a_finished_background_run_is_applied_at_the_next_turn_from_the_prefix_cache(service: Any) -> None:
    """The run goes at background priority, its compacted prompt is prefilled on the session's replica, and the
    turn that applies it (below compact_threshold) waits for nothing and reads that prompt from the cache."""
    client, session = openai_client(service.url), f"chat-{uuid.uuid4().hex[:8]}"
    entry = {"compact_threshold": 1400, "background_threshold": 900}
    history = [*coding_history(16)[:41], {"role": "user", "content": "Keep going."}]
    assert ask(client, history, session, **entry).model_extra["compaction"]["status"] == "running"
    deadline = time.monotonic() + 300
    while True:  # the agent retries the same turn, as after a tool call, until the result is there
        time.sleep(2)
        reply = ask(client, history, session, **entry)
        compaction = reply.model_extra["compaction"]
        if compaction["status"] == "applied" or time.monotonic() > deadline:
            break
    assert compaction["status"] == "applied" and compaction["source"] == "background", compaction
    assert compaction["stall_s"] < 1.0 and compaction["stats"]["priority"] == "background"
    assert compaction["compacted_prompt_tokens"] < compaction["prompt_tokens"] <= 1400
    usage = reply.usage
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 256  # all but the last blocks


def test_a_tool_using_turn_is_counted_as_the_engine_counts_it(service: Any) -> None:
    """The thresholds are compared with the ingress's count of a turn: for a coding agent's turn (tool calls, tool
    results and its tool list) it is the engine's own prompt count."""
    client = openai_client(service.url)
    history = [*coding_history(6), {"role": "user", "content": "Which module has the bug?"}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=TOOLS,
        max_tokens=4,
        temperature=0,
        extra_body={"context_management": [{**ENTRY, "compact_threshold": 4000}]},
        extra_headers={"x-session-id": f"count-{uuid.uuid4().hex[:8]}"},
    )
    counted = reply.model_extra["compaction"]
    assert counted["status"] == "none" and counted["prompt_tokens"] == reply.usage.prompt_tokens, counted


def test_a_tool_using_agents_compaction_reads_what_its_turns_cached(client: httpx.Client) -> None:
    """A coding agent's turns send its tool list; its compaction sends the same list, so the chunk prompts start
    with the agent's prompt tokens (tools in the system turn, tool calls in the template's markup) and vLLM
    serves them from what the turns cached."""
    messages = coding_trace(1, 2500).messages
    session = f"tools-{uuid.uuid4().hex[:8]}"
    calls = [i for i, m in enumerate(messages) if m["role"] == "assistant"][-2:]
    for at in calls:  # the agent calls the model before each of its last two messages
        body = {"model": MODEL, "messages": messages[:at], "tools": TOOLS, "max_tokens": 4, "temperature": 0}
        client.post("/v1/chat/completions", json=body, headers={"x-session-id": session}).raise_for_status()
    compact = {"model": MODEL, "messages": messages[: calls[-1]], "tools": TOOLS, "session_id": session}
    response = client.post("/v1/compact", json={**compact, "chunk_tokens": 512, "max_chunk_summary_tokens": 16})
    assert response.status_code == 200, response.text
    stats = response.json()["stats"]
    first = stats["per_chunk"][0]
    assert stats["chunks"] >= 3 and stats["history_cached_fraction"] >= 0.8, stats
    assert first["cached_prompt_tokens"] >= 0.6 * first["prompt_tokens"], first  # from the turns, not other chunks


def test_a_back_to_back_agent_compacts_blocking_not_in_the_background(service: Any) -> None:
    """An agent that sends its next turn as soon as it has the reply leaves no idle time for a background run."""
    client, session = openai_client(service.url), f"chat-{uuid.uuid4().hex[:8]}"
    entry = {"compact_threshold": 1400, "background_threshold": 900}
    steps = coding_history(16)
    history = [*steps[:21], {"role": "user", "content": "Keep going."}]
    assert ask(client, history, session, **entry).model_extra["compaction"]["status"] == "none"
    history += [{"role": "assistant", "content": "Going on."}, *steps[21:41]]  # past 900, right after the reply
    busy = ask(client, history, session, **entry).model_extra["compaction"]
    assert busy["status"] == "none" and busy["prompt_tokens"] > 900, busy
    history += [{"role": "assistant", "content": "Yes."}, *steps[41:], {"role": "user", "content": "Done?"}]
    later = ask(client, history, session, **entry).model_extra["compaction"]
    assert later["status"] == "applied" and later["source"] == "blocking", later


def test_a_turn_longer_than_the_thresholds_gap_still_compacts_in_the_background(service: Any) -> None:
    client, session = openai_client(service.url), f"chat-{uuid.uuid4().hex[:8]}"
    entry = {"compact_threshold": 1700, "background_threshold": 1600}
    steps = coding_history(16)
    history = [*steps[:21], {"role": "user", "content": "Keep going."}]
    first = ask(client, history, session, **entry).model_extra["compaction"]
    assert first["status"] == "none"
    history += [{"role": "assistant", "content": "Going on."}, *steps[21:45]]  # six steps: longer than the gap
    time.sleep(1.0)  # the agent's tools ran: background work has time to run in
    early = ask(client, history, session, **entry).model_extra["compaction"]
    growth = early["prompt_tokens"] - first["prompt_tokens"]
    assert early["prompt_tokens"] < 1600 and early["prompt_tokens"] + growth > 1700
    assert early["status"] == "running", early  # one more turn like this one passes 1700: start now
    history += [{"role": "assistant", "content": "Yes."}, *steps[45:], {"role": "user", "content": "Done?"}]
    later = ask(client, history, session, **entry).model_extra["compaction"]
    assert later["status"] == "applied" and later["source"] == "background", later
    assert later["replaces_through"] <= len(steps[:45]) + 2


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"type": "shrink", "compact_threshold": 2000}, "context_management[0].type"),
        ({"type": "compaction", "compact_threshold": "big"}, "context_management[0].compact_threshold"),
        (
            {"type": "compaction", "compact_threshold": 2000, "background_threshold": 3000},
            "context_management[0].background_threshold",
        ),
        (
            {"type": "compaction", "compact_threshold": 2000, "keep_recent_tokens": 2500},
            "context_management[0].compact_threshold",
        ),
        ({"type": "compaction", "compact_threshold": 2000, "layout": "diagonal"}, "context_management[0].layout"),
        ({"type": "compaction", "compact_threshold": 100_000}, "context_management[0].compact_threshold"),
    ],
)
def test_malformed_context_management_gets_422_naming_the_field(client: httpx.Client, entry: Any, field: str) -> None:
    body = {"model": MODEL, "messages": coding_history(1), "context_management": [entry]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


@pytest.mark.destructive
def test_killing_the_stateful_parts_between_turns_loses_nothing(service: Any, client: httpx.Client) -> None:
    """The client carries the compacted history: with every process that held session state killed (coordinator
    and ingress replicas, restarted by Serve), the next turn is answered from it."""
    import ray

    openai, session = openai_client(service.url), f"chat-{uuid.uuid4().hex[:8]}"
    history = [*coding_history(12), {"role": "user", "content": "Which module has the bug?"}]
    reply = ask(openai, history, session)
    compaction = reply.model_extra["compaction"]
    assert compaction["status"] == "applied"
    history = compaction["messages"] + history[compaction["replaces_through"] :]
    history += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
    history += [{"role": "user", "content": "And the fix?"}]
    stateful = ("#Coordinator#", "#CompactionIngress#")
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if any(s in a["name"] for s in stateful)]
    assert len(actors) >= 2
    for actor in actors:
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=False)
    deadline = time.monotonic() + 300
    while True:
        try:
            if client.get("/healthz", timeout=10).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the service did not come back within 300 s"
        time.sleep(2)
    follow = ask(openai_client(service.url), history, session)
    assert follow.choices[0].message.content is not None
    assert follow.model_extra["compaction"]["status"] == "none"
