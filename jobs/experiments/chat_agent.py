"""The chat_agent sweep family: the agent through the service's `/v1/chat/completions`, compacted server-side.

One cell plays one stream (`jobs.agent.chat_loop`) in one mode at one τ against a running service
(the sweep's `backend: service`, this project's Serve app). Rows: one per turn (compaction status,
the agent-visible stall, the compaction's stats when one was applied, the answer's scores) and one
with the episode's totals, in the results schema.
"""

from __future__ import annotations

import asyncio
from typing import Any

from compaction.result import CompactionStats
from jobs.agent.chat_loop import ChatEpisode, LoopSettings, TurnRecord, run_episode
from jobs.agent.tools import ToolTime
from jobs.data.episodes import Step
from jobs.experiments.grid import Cell
from jobs.experiments.results import compaction_columns
from serving.tenants import client_key


def settings(cell: Cell) -> tuple[LoopSettings, int]:
    """The loop's settings and the chunk count of a typical compaction (the matched-volume hint).

    `summary_tokens` is one whole compaction's budget, as in the agent experiments: parallel modes
    split it over the chunks of a typical compaction (the τ less the verbatim quarter), sequential
    gets all of it.
    """
    tau = cell.tau or 0
    chunk = cell.chunk_tokens or 2048
    hint = max(1, -(-int(0.75 * tau) // chunk))
    loop = LoopSettings(
        compact_threshold=tau,
        background_threshold=cell.background_threshold or tau // 2,  # only background_parallel cells use it
        chunk_tokens=chunk,
        summary_tokens=max(16, cell.summary_tokens // hint),
        answer_tokens=cell.answer_tokens,
    )
    return loop, hint


async def chat_agent_rows(cell: Cell, steps: list[Step], base_url: str) -> list[dict[str, Any]]:
    """Every row of one chat_agent cell, without the cell's identity columns."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key=client_key() or "unused", max_retries=0, timeout=900)
    loop, hint = settings(cell)
    tools = ToolTime.parse(cell.tool_time or "0", seed=cell.repeat).seconds(len(steps))
    episode = await asyncio.to_thread(
        run_episode, client, cell.model, cell.dataset, steps, cell.mode or "none", loop, hint, tools
    )
    rows = [turn_row(t) for t in episode.turns]
    return [*rows, episode_row(episode)]


def turn_row(turn: TurnRecord) -> dict[str, Any]:
    row: dict[str, Any] = {
        "event": "turn",
        "turn_index": turn.index,
        "step": turn.kind,
        "label": turn.label,
        "context_tokens": turn.sent_tokens,
        "tokens_after": turn.answered_tokens,
        "answer_prompt_tokens": turn.answered_tokens,
        "answer_cached_tokens": turn.cached_tokens,
        "answer_output_tokens": turn.output_tokens,
        "answer_latency_s": turn.latency_s,
        "compaction_stall_s": turn.stall_s,
        "tool_s": turn.tool_s,
        "compaction_status": turn.status,
        "compaction_source": turn.source,
        "compacted": turn.status == "applied",
    }
    if turn.compaction is not None:
        stats = CompactionStats.model_validate(turn.compaction)
        row |= compaction_columns(stats) | {"reused_chunks": stats.reused_chunks}
    if turn.kind == "question":
        row |= {"prediction": turn.reply, **turn.score}
    return row


def episode_row(episode: ChatEpisode) -> dict[str, Any]:
    totals = episode.totals()
    stats = [CompactionStats.model_validate(s) for s in episode.compactions]
    return {
        "event": "episode",
        "e2e_s": episode.e2e_s,
        "compaction_time_s": episode.stall_s,
        "compaction_count": totals["compactions"],
        "tool_s": totals["tool_s"],
        "turn_p50_s": totals["turn_p50_s"],
        "turn_p95_s": totals["turn_p95_s"],
        "mean_prompt_tokens": float(totals["mean_prompt_tokens"]),
        "answer_time_s": sum(t.latency_s for t in episode.turns if t.kind == "question"),
        "questions": totals["questions"],
        "compacted_input_tokens": sum(s.input_tokens for s in stats),
        "summary_tokens_total": sum(s.summary_tokens for s in stats),
        "reused_chunks": totals["reused_chunks"],
    }
