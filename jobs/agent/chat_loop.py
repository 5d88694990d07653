"""The agent loop through the service's `/v1/chat/completions`, with compaction done server-side.

Every step is one chat call with the official `openai` client, as a real agent would make it: a
document (a HotpotQA paragraph, a LoCoMo session) arrives as a user message and gets a short
acknowledgement; a question gets an answer. The client keeps its own history: when a response
carries `compaction.status == "applied"`, it continues from `compaction.messages +
history[replaces_through:]`, exactly as the protocol says. Between turns the agent runs its tools
(`tool_s`, from `jobs.agent.tools.ToolTime`: the same seconds after the same turn in every mode),
which is when a background compaction can run without slowing it. Nothing else changes between modes:
  none                 no context_management (only where the whole stream fits the window)
  blocking_sequential  compact_threshold, strategy sequential
  blocking_parallel    compact_threshold, strategy parallel
  background_parallel  compact_threshold and background_threshold, strategy parallel: the snapshot's
                       compaction applied at the next turn (apply_background "ready")
  rolling_parallel     the same thresholds, apply_background "rolling": chunks summarised in the background
                       as they become final, the compaction at τ made as blocking_parallel's from them
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from jobs.agent.metrics import percentile, score_answer
from jobs.agent.pipeline import SYSTEM_PROMPT, question_prompt
from jobs.data.episodes import Document, Question, Step

ChatMode = Literal["none", "blocking_sequential", "blocking_parallel", "background_parallel", "rolling_parallel"]
MODES: tuple[ChatMode, ...] = get_args(ChatMode)
ACK = "Noted."


@dataclass(frozen=True)
class LoopSettings:
    """One benchmark's thresholds and budgets, shared by every mode so they compare."""

    compact_threshold: int  # τ: the hard threshold of every compacting mode
    background_threshold: int  # the soft threshold of background_parallel and rolling_parallel
    chunk_tokens: int = 512  # B of the parallel modes
    summary_tokens: int = 32  # per chunk (parallel) or whole (sequential is given chunks x this)
    answer_tokens: int = 24  # reply budget of a question
    ack_tokens: int = 4  # reply budget of a document turn

    def entry(self, mode: str, chunks_hint: int) -> dict[str, Any] | None:
        """The context_management entry of a mode (None: no compaction)."""
        if mode == "none":
            return None
        base: dict[str, Any] = {"type": "compaction", "compact_threshold": self.compact_threshold}
        if mode == "blocking_sequential":  # matched decode volume: the parallel budget of a typical compaction
            return {**base, "strategy": "sequential", "max_chunk_summary_tokens": self.summary_tokens * chunks_hint}
        base |= {
            "strategy": "parallel",
            "chunk_tokens": self.chunk_tokens,
            "max_chunk_summary_tokens": self.summary_tokens,
        }
        if mode in ("background_parallel", "rolling_parallel"):
            base["background_threshold"] = self.background_threshold
            base["apply_background"] = "rolling" if mode == "rolling_parallel" else "ready"
        return base


@dataclass(frozen=True)
class TurnRecord:
    index: int
    kind: str  # document | question
    label: str
    sent_tokens: int  # prompt tokens of the request as the client sent it (the service's count)
    answered_tokens: int  # prompt tokens the model answered (after any compaction)
    cached_tokens: int  # of those, served from vLLM's prefix cache
    output_tokens: int
    latency_s: float  # the whole call, compaction included
    tool_s: float  # tool time after this turn (idle engine time for the agent)
    status: str  # compaction status: applied, running, none
    stall_s: float  # how long the turn waited for compaction
    source: str | None  # applied: background or blocking
    compaction: dict[str, Any] | None  # applied: the compaction's stats
    reply: str
    score: dict[str, Any] = field(default_factory=dict)  # questions: the dataset's metrics


@dataclass(frozen=True)
class ChatEpisode:
    mode: str
    turns: list[TurnRecord]
    e2e_s: float

    @property
    def stall_s(self) -> float:
        return sum(t.stall_s for t in self.turns)

    @property
    def compactions(self) -> list[dict[str, Any]]:
        return [t.compaction for t in self.turns if t.compaction is not None]

    def totals(self) -> dict[str, Any]:
        """The figures of the benchmark table. `turn_p50_s` / `turn_p95_s`: latency of the turns that applied no
        compaction (what work beside them costs the agent); `mean_prompt_tokens`: the prompt each turn was
        answered from, on average."""
        applied = [t for t in self.turns if t.status == "applied"]
        plain = [t.latency_s for t in self.turns if t.status != "applied"]
        stats = self.compactions
        questions = [t for t in self.turns if t.kind == "question"]
        f1 = [float(t.score["f1"]) for t in questions if "f1" in t.score]
        return {
            "mode": self.mode,
            "e2e_s": round(self.e2e_s, 2),
            "tool_s": round(sum(t.tool_s for t in self.turns), 2),
            "stall_s": round(self.stall_s, 2),
            "max_stall_s": round(max((t.stall_s for t in applied), default=0.0), 2),
            "turn_p50_s": round(percentile(plain, 0.5), 2),
            "turn_p95_s": round(percentile(plain, 0.95), 2),
            "mean_prompt_tokens": round(sum(t.answered_tokens for t in self.turns) / max(1, len(self.turns))),
            "compactions": len(applied),
            "background": sum(t.source == "background" for t in applied),
            "turn_prefill": sum(t.answered_tokens - t.cached_tokens for t in self.turns),
            "turn_cached": sum(t.cached_tokens for t in self.turns),
            "compaction_prefill": sum(int(s["computed_prefill_tokens"]) for s in stats),
            "compaction_cached": sum(int(s["cached_prompt_tokens"]) for s in stats),
            "reused_chunks": sum(int(s.get("reused_chunks", 0)) for s in stats),
            "given_up_chunks": sum(len(s.get("given_up_chunks", ())) for s in stats),
            "questions": len(questions),
            "f1": round(sum(f1) / len(f1), 3) if f1 else None,
        }


def document_text(document: Document) -> str:
    """A document as one user message (a LoCoMo session's lines, or a paragraph)."""
    return "\n".join(str(m.get("content") or "") for m in document.messages)


def run_episode(
    client: Any,
    model: str,
    dataset: str,
    steps: Sequence[Step],
    mode: str,
    settings: LoopSettings,
    chunks_hint: int,
    tool_s: Sequence[float] = (),
) -> ChatEpisode:
    """Play the steps as one agent session through the chat endpoint (see the module docstring); after turn i
    the agent spends tool_s[i] seconds in its tools (none after the last turn, or past the list)."""
    entry = settings.entry(mode, chunks_hint)
    session = f"bench-{mode}-{uuid.uuid4().hex[:8]}"
    # The session id in the system message: no chunk summary of an earlier episode (another mode, on the
    # same service) matches this one's prompts, so each episode compacts from scratch and reuses only its own.
    history: list[dict[str, Any]] = [{"role": "system", "content": f"{SYSTEM_PROMPT} (Session {session}.)"}]
    turns: list[TurnRecord] = []
    began = time.perf_counter()
    for index, step in enumerate(steps):
        question = isinstance(step, Question)
        text = question_prompt(step) if isinstance(step, Question) else document_text(step)
        history.append({"role": "user", "content": text})
        extra = {"extra_body": {"context_management": [entry]}} if entry else {}
        started = time.perf_counter()
        reply = client.chat.completions.create(
            model=model,
            messages=history,
            max_tokens=settings.answer_tokens if question else settings.ack_tokens,
            temperature=0,
            extra_headers={"x-session-id": session},
            **extra,
        )
        latency = time.perf_counter() - started
        compaction = (reply.model_extra or {}).get("compaction") or {}
        if compaction.get("status") == "applied":
            history = list(compaction["messages"]) + history[int(compaction["replaces_through"]) :]
        answer = reply.choices[0].message.content or ""
        history.append({"role": "assistant", "content": answer if question else (answer.strip() or ACK)})
        tool = tool_s[index] if index < len(tool_s) and index + 1 < len(steps) else 0.0
        turns.append(_record(index, step, reply, compaction, answer, latency, tool, dataset))
        time.sleep(tool)
    return ChatEpisode(mode, turns, time.perf_counter() - began)


def _record(
    index: int,
    step: Step,
    reply: Any,
    compaction: dict[str, Any],
    answer: str,
    latency: float,
    tool: float,
    dataset: str,
) -> TurnRecord:
    usage = reply.usage
    details = getattr(usage, "prompt_tokens_details", None)
    question = isinstance(step, Question)
    return TurnRecord(
        index=index,
        kind="question" if question else "document",
        label=step.task_id if isinstance(step, Question) else step.label,
        sent_tokens=int(compaction.get("prompt_tokens") or usage.prompt_tokens),
        answered_tokens=int(usage.prompt_tokens),
        cached_tokens=int(getattr(details, "cached_tokens", 0) or 0),
        output_tokens=int(usage.completion_tokens),
        latency_s=latency,
        tool_s=tool,
        status=str(compaction.get("status") or "none"),
        stall_s=float(compaction.get("stall_s") or 0.0),
        source=compaction.get("source"),
        compaction=compaction.get("stats") if compaction.get("status") == "applied" else None,
        reply=answer,
        score=score_answer(dataset, step, answer) if isinstance(step, Question) else {},
    )
