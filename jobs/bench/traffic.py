"""Concurrent agent sessions against a running service, and the figures of one load level.

A session is an agent with its own history (a LoCoMo conversation slice behind a system message
naming the agent, so no two sessions share a prefix): `turns` chat turns on /v1/chat/completions
(x-session-id, each adding the next slice of the conversation as a user message, with the agent's
tool time after each, `jobs.agent.tools`), then one compaction of its history (`session_id`).
`compactions_only` skips the turns: every session sends its compaction at the same moment (a fleet
compacting at once).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from compaction.tokenizer import ChatTokenizer
from jobs.agent.metrics import percentile
from jobs.agent.tools import ToolTime
from jobs.data.conversations import locomo_messages, truncate_history
from serving.tenants import client_headers


@dataclass(frozen=True)
class Session:
    id: str
    history: list[dict[str, Any]]  # the history the agent starts with
    observations: list[str]  # the new user message of each turn


@dataclass
class Calls:
    """What came back, per kind of call."""

    turns: list[tuple[int, float, dict[str, Any]]] = field(default_factory=list)  # (status, seconds, usage)
    compactions: list[tuple[int, float, dict[str, Any]]] = field(default_factory=list)  # (status, seconds, stats)
    retry_after: list[float] = field(default_factory=list)  # Retry-After of every 429
    compaction_span: tuple[float, float] = (float("inf"), 0.0)  # first start, last end (monotonic)


def make_sessions(
    samples: list[dict[str, Any]], tokenizer: ChatTokenizer, count: int, history_tokens: int, turns: int
) -> list[Session]:
    """`count` sessions over the LoCoMo conversations; session i starts at a different place in one."""
    conversations = [locomo_messages(s) for s in samples]
    out = []
    for i in range(count):
        conversation = conversations[i % len(conversations)]
        start = (i // len(conversations)) * 24 % max(1, len(conversation) - 80)
        body = truncate_history(conversation[start:], tokenizer, history_tokens)
        rest = conversation[start + len(body) :]
        observations = [
            "New messages:\n" + "\n".join(str(m["content"]) for m in rest[t * 4 : t * 4 + 4]) for t in range(turns)
        ]
        system = {"role": "system", "content": f"You are agent {i}; you keep notes of this conversation."}
        out.append(Session(f"load-{i}", [system, *body], observations))
    return out


async def play(
    http: httpx.AsyncClient,
    session: Session,
    model: str,
    compaction: dict[str, Any],
    calls: Calls,
    tool_s: list[float] | None = None,
) -> None:
    """The session's turns (tool_s[i] seconds of tool time after turn i), then its compaction."""
    messages = list(session.history)
    for i, text in enumerate(session.observations):
        messages.append({"role": "user", "content": text})
        body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0.0}
        began = time.monotonic()
        reply = await http.post("/v1/chat/completions", json=body, headers={"x-session-id": session.id})
        usage = reply.json().get("usage") or {} if reply.status_code == 200 else {}
        calls.turns.append((reply.status_code, time.monotonic() - began, usage))
        content = reply.json()["choices"][0]["message"]["content"] if reply.status_code == 200 else None
        messages.append({"role": "assistant", "content": content or "Noted."})
        await asyncio.sleep(tool_s[i] if tool_s and i < len(tool_s) else 0.0)
    request = {"model": model, "messages": messages, "session_id": session.id, **compaction}
    began = time.monotonic()
    response = await http.post("/v1/compact", json=request)
    ended = time.monotonic()
    calls.compaction_span = (min(calls.compaction_span[0], began), max(calls.compaction_span[1], ended))
    stats = response.json().get("stats", {}) if response.status_code == 200 else {}
    calls.compactions.append((response.status_code, ended - began, stats))
    if response.status_code == 429:
        calls.retry_after.append(float(response.headers.get("retry-after", "0")))


async def run_level(
    url: str,
    sessions: list[Session],
    model: str,
    compaction: dict[str, Any],
    timeout_s: float = 1800,
    tool_time: ToolTime | None = None,
) -> dict[str, Any]:
    """Every session at once (session i's tool times drawn with seed i); the level's figures."""
    calls = Calls()
    limits = httpx.Limits(max_connections=len(sessions) * 2 + 4)
    began = time.monotonic()
    tools = [
        replace(tool_time, seed=i).seconds(len(s.observations)) if tool_time else None for i, s in enumerate(sessions)
    ]
    async with httpx.AsyncClient(base_url=url, headers=client_headers(), timeout=timeout_s, limits=limits) as http:
        await asyncio.gather(
            *(play(http, s, model, compaction, calls, t) for s, t in zip(sessions, tools, strict=True))
        )
    return figures(calls, len(sessions), time.monotonic() - began)


def figures(calls: Calls, sessions: int, wall_s: float) -> dict[str, Any]:
    ok = [(seconds, stats) for status, seconds, stats in calls.compactions if status == 200]
    turns_ok = [(seconds, usage) for status, seconds, usage in calls.turns if status == 200]
    statuses: dict[str, int] = {}
    for status, _, _ in calls.compactions:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    prompt = sum(s["prompt_tokens"] for _, s in ok) + sum(u.get("prompt_tokens", 0) for _, u in turns_ok)
    cached = sum(s["cached_prompt_tokens"] for _, s in ok) + sum(
        (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for _, u in turns_ok
    )
    span = max(1e-9, calls.compaction_span[1] - calls.compaction_span[0])
    chunks_per_replica: dict[str, int] = {}
    for _, stats in ok:
        for replica in stats.get("replicas") or []:
            chunks_per_replica[str(replica)] = chunks_per_replica.get(str(replica), 0) + 1
    latencies = [seconds for seconds, _ in ok]
    waits = [s["queue_wait_s"] for _, s in ok]
    return {
        "sessions": sessions,
        "wall_s": round(wall_s, 2),
        "compactions": statuses,
        "rejected_429": statuses.get("429", 0),
        "turns_ok": len(turns_ok),
        "turns_failed": len(calls.turns) - len(turns_ok),
        "goodput_per_s": round((len(ok) + len(turns_ok)) / wall_s, 3),
        "compaction_p50_s": round(percentile(latencies, 0.5), 2),
        "compaction_p95_s": round(percentile(latencies, 0.95), 2),
        "queue_wait_p50_s": round(percentile(waits, 0.5), 2),
        "queue_wait_p95_s": round(percentile(waits, 0.95), 2),
        "compute_p50_s": round(percentile([s["latency_s"] for _, s in ok], 0.5), 2),
        "turn_p50_s": round(percentile([seconds for seconds, _ in turns_ok], 0.5), 2),
        "turn_p95_s": round(percentile([seconds for seconds, _ in turns_ok], 0.95), 2),
        "cache_hit_share": round(cached / prompt, 3) if prompt else 0.0,
        "input_tokens_compacted": sum(s["input_tokens"] for _, s in ok),
        "compaction_throughput_tok_s": round(sum(s["input_tokens"] for _, s in ok) / span, 1),
        "retry_after_s": sorted(set(calls.retry_after)),
        "mean_chunks": round(statistics.fmean(s["chunks"] for _, s in ok), 2) if ok else 0.0,
        "chunks_per_replica": sorted(chunks_per_replica.values(), reverse=True),
    }
