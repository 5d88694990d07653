"""Prefix-cache affinity, measured by the engine: an agent session's turns, then its compaction.

    python -m jobs.bench.affinity [--port 8000] [--base-tokens 2400] [--turns 3] [--turn-tokens 300]
    python -m jobs.bench.affinity --trace coding [--base-tokens 2400] [--turns 3]

Starts the service, then plays the same agent session three times, each on empty prefix caches:
  - affinity on: the agent's /v1/chat/completions turns carry `x-session-id` (so they stay on the
    session's replica), the compaction names the session, and the coordinator places its chunk
    prompts (here: pinned to that replica);
  - affinity off for the compaction: the turns as above, the chunk prompts round robin;
  - affinity off everywhere: no session id at all; turns and chunk prompts round robin.
A session is a LoCoMo conversation cut to `--base-tokens`, then `--turns` agent turns, each
bringing the next ~`--turn-tokens` of the conversation as a new user message (as a tool result
would) and getting a short reply. For each run it prints the compaction's history prompt tokens
and how many vLLM served from its prefix cache (definitions in `serving.coordinator`), and the
prompt tokens the agent's turns and the compaction had to compute.

`--trace coding`: a generated coding-agent session (`jobs.data.traces`) with its tool list: the agent's turns
are its calls of the model before each of its last `--turns` assistant messages (the trace's own message then
follows, as a replayed agent's would), each sending the tool list; the compaction sends the same list
(`tools`), so its chunk prompts render as the agent's turns and read their prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from compaction.tokenizer import ChatTokenizer
from jobs.bench.common import MODEL, local_service, replicas
from jobs.data.conversations import LOCOMO_PATH, load_conversation, truncate_history
from serving.tenants import client_headers

COMPACTION = {"strategy": "parallel", "chunk_tokens": 512, "max_chunk_summary_tokens": 32, "reuse_chunks": False,
              "clearing": "off"}  # fmt: skip


@dataclass(frozen=True)
class Session:
    base: list[dict[str, Any]]  # the history before the agent's turns
    observations: list[str]  # the new user message of each turn
    tools: list[dict[str, Any]] | None = None  # the agent's tool list (a replayed trace)
    replay: list[dict[str, Any]] | None = None  # a replayed trace: the whole session, the turns are its calls
    calls: tuple[int, ...] = ()  # a replayed trace: the messages before each of the agent's model calls


def coding_session(tokenizer: ChatTokenizer, base_tokens: int, turns: int, turn_tokens: int) -> Session:
    """A coding-agent trace of about `base_tokens` + `turns` x `turn_tokens` tokens; its model calls: before each
    of its last `turns` assistant messages."""
    from jobs.data.traces import TOOLS, coding_trace

    messages = coding_trace(0, base_tokens + turns * turn_tokens, tokenizer).messages
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return Session([], [], TOOLS, messages, tuple(replies[-turns:]))


def make_session(
    conversation: list[dict[str, Any]], tokenizer: ChatTokenizer, base_tokens: int, turns: int, turn_tokens: int
) -> Session:
    """The conversation's first `base_tokens`, and the following messages grouped into turns."""
    base = truncate_history(conversation, tokenizer, base_tokens)
    rest = iter(conversation[len(base) :])
    observations = []
    for _ in range(turns):
        lines: list[str] = []
        while sum(len(tokenizer.encode(line)) for line in lines) < turn_tokens:
            message = next(rest, None)
            if message is None:
                break
            lines.append(str(message.get("content") or ""))
        if lines:
            observations.append("New messages in the conversation:\n" + "\n".join(lines))
    return Session(base, observations)


# label -> (the agent's turns carry x-session-id, the compaction names the session)
MODES = {
    "affinity on": (True, True),
    "affinity off for the compaction": (True, False),
    "affinity off everywhere": (False, False),
}


async def play(
    client: httpx.AsyncClient,
    session: Session,
    *,
    sticky_turns: bool,
    session_compaction: bool,
    model: str = MODEL,
    decode_cap: int | None = None,
) -> dict[str, Any]:
    """Run the agent's turns, then compact its history: the compaction's stats plus the turns' prompt tokens.
    `decode_cap`: replies and chunk summaries of at most this many tokens instead of 24 and 32 (a shorter run; the
    modes still compare like with like)."""
    session_id = f"agent-{uuid.uuid4().hex[:8]}"
    headers = {"x-session-id": session_id} if sticky_turns else {}
    messages = list(session.base)
    turns = {"prompt_tokens": 0, "cached_tokens": 0}
    listed = {"tools": session.tools} if session.tools else {}
    compaction = COMPACTION | ({"max_chunk_summary_tokens": decode_cap} if decode_cap else {})

    async def call(messages: list[dict[str, Any]]) -> str:
        body = {"model": model, "messages": messages, "max_tokens": decode_cap or 24, "temperature": 0.0, **listed}
        response = await client.post("/v1/chat/completions", json=body, headers=headers)
        response.raise_for_status()
        turn = response.json()
        turns["prompt_tokens"] += turn["usage"]["prompt_tokens"]
        turns["cached_tokens"] += (turn["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return str(turn["choices"][0]["message"]["content"] or "ok")

    for text in session.observations:
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": await call(messages)})
    for at in session.calls:  # a replayed trace: the model is called, the trace's own reply follows
        messages = (session.replay or [])[:at]
        await call(messages)
    request: dict[str, Any] = {"model": model, "messages": messages, **compaction, **listed}
    if session_compaction:
        request["session_id"] = session_id
    else:
        request["placement"] = "round_robin"
    response = await client.post("/v1/compact", json=request)
    response.raise_for_status()
    return {**response.json()["stats"], "agent_turns": turns}


def figure(label: str, stats: dict[str, Any]) -> str:
    turns = stats["agent_turns"]
    computed_turns = turns["prompt_tokens"] - turns["cached_tokens"]
    return (
        f"{label}: compaction history prompt tokens served from cache "
        f"{stats['history_cached_tokens']}/{stats['history_prompt_tokens']} = "
        f"{100 * stats['history_cached_fraction']:.1f}%; prompt tokens computed: agent turns {computed_turns} "
        f"(of {turns['prompt_tokens']}) + compaction {stats['computed_prefill_tokens']} "
        f"(of {stats['prompt_tokens']}); chunks on replicas {','.join(map(str, stats['replicas']))}; "
        f"placement {stats['placement']['kind']}: {stats['placement']['reason']}"
    )


async def measure(url: str, session: Session, reset: Any, decode_cap: int | None = None) -> dict[str, dict[str, Any]]:
    """Every mode, each after `reset()` empties the replicas' prefix caches (`decode_cap`: see `play`)."""
    out = {}
    async with httpx.AsyncClient(base_url=url, headers=client_headers(), timeout=900) as client:
        for label, (sticky, named) in MODES.items():
            await reset()
            out[label] = await play(
                client, session, sticky_turns=sticky, session_compaction=named, decode_cap=decode_cap
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--conversation", type=Path, default=LOCOMO_PATH)
    parser.add_argument("--base-tokens", type=int, default=2400)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=300)
    parser.add_argument("--trace", choices=["locomo", "coding"], default="locomo")
    args = parser.parse_args(argv)

    from compaction.tokenizer import HFChatTokenizer
    from serving.weights import fetch

    tokenizer = HFChatTokenizer.from_path(fetch())
    if args.trace == "coding":
        session = coding_session(tokenizer, args.base_tokens, args.turns, args.turn_tokens)
    else:
        conversation = load_conversation(args.conversation)
        session = make_session(conversation, tokenizer, args.base_tokens, args.turns, args.turn_tokens)
    with local_service(args.port, replicas(2)) as (service, reset):  # placement across replicas needs two
        results = asyncio.run(measure(service.url, session, reset.cold))
    for label, stats in results.items():
        print(figure(label, stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
