"""The agent pipeline of the paper (§3.1): a history that grows across tasks and is compacted past τ.

Per turn one document (a HotpotQA paragraph, a LoCoMo session) is appended; a question is asked
right after its evidence and answered free-form from the whole history. When the rendered
history exceeds τ tokens it is compacted with the configured strategy, and the agent continues
from the compacted history. Plain code over the `Backend` protocol (no Ray): it runs on an
in-process vLLM engine, an OpenAI-compatible service, an engine actor, or a fake.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from compaction.backend import Backend, GenerationRequest
from compaction.compactor import Compactor
from compaction.errors import NothingToCompact
from compaction.history import Message, parse_messages, template_view
from compaction.merge import user_words, user_words_budget
from compaction.options import CompactionOptions
from compaction.result import CompactionStats
from compaction.tokenizer import ChatTokenizer
from jobs.data.episodes import Document, Question, Step

SYSTEM_PROMPT = (
    "You are a research assistant. Documents and conversations arrive one turn at a time; "
    "when asked a question, answer it from what you have read, in a few words."
)
MIN_CHUNK_SUMMARY_TOKENS = 16
_LETTERS = "ABCDEFGHIJ"


class AgentSettings(BaseModel):
    """One agent run's knobs. `summary_tokens` is the whole compaction's output budget."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tau: int = Field(ge=64, le=1_048_576, description="Compact when the rendered history exceeds this many tokens.")
    compaction: CompactionOptions = Field(description="Strategy, chunk size, layout, variant of each compaction.")
    summary_tokens: int = Field(
        256,
        ge=MIN_CHUNK_SUMMARY_TOKENS,
        le=65_536,
        description="Output budget of one compaction; parallel splits it evenly over its chunks (matched volume).",
    )
    answer_tokens: int = Field(32, ge=1, le=4096, description="Output budget of one answer.")
    system_prompt: str = Field(SYSTEM_PROMPT, description="The agent's system message (kept through compactions).")


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_tokens: int  # tokens in context when the question was answered
    cached_prompt_tokens: int
    output_tokens: int
    latency_s: float


@dataclass(frozen=True)
class Turn:
    """What happened at one step: the document or question, the answer, and any compaction after it."""

    index: int
    step: Step
    context_tokens: int  # rendered history after the turn, before any compaction
    answer: Answer | None  # questions only
    compaction: CompactionStats | None  # when this turn pushed the history past tau
    compaction_stall_s: float  # wall time the agent waited for that compaction (0 without one)
    tokens_after: int  # rendered history once the turn (and its compaction) is done


@dataclass(frozen=True)
class Episode:
    turns: list[Turn]
    e2e_s: float  # wall time of the whole run: answers, compactions, rendering

    @property
    def compaction_s(self) -> float:
        return sum(t.compaction_stall_s for t in self.turns)

    @property
    def compactions(self) -> int:
        return sum(t.compaction is not None for t in self.turns)


def question_prompt(question: Question) -> str:
    """The user turn that asks a task's question (with lettered choices for multiple choice)."""
    if not question.choices:
        return f"Question: {question.question}\nAnswer in a few words, using what you have read above."
    options = "\n".join(f"({_LETTERS[i]}) {choice}" for i, choice in enumerate(question.choices))
    return f"Question: {question.question}\n{options}\nAnswer with the letter of the correct choice."


def matched_options(
    compactor: Compactor, history: Sequence[Message], options: CompactionOptions, summary_tokens: int
) -> CompactionOptions:
    """The options with a whole-compaction budget split evenly over this history's chunks.

    The user's words kept verbatim count against the budget (at most a quarter of it): the rest is split,
    sequential getting all of it in its one prompt, parallel (and extractive) with N chunks getting
    rest // N per chunk (at least 16), so every strategy writes about the same volume.
    """
    words_budget = min(user_words_budget(options, compactor.context_window), summary_tokens // 4)
    options = options.model_copy(update={"user_words_tokens": words_budget})
    plan = compactor.plan(history, options)
    words = user_words(plan, compactor.tokenizer, compactor.context_window)
    rest = summary_tokens - (len(compactor.tokenizer.encode(words.render())) if words.texts else 0)
    chunks = 1 if options.strategy == "sequential" else max(1, len(plan.chunks))
    per_chunk = max(MIN_CHUNK_SUMMARY_TOKENS, rest // chunks)
    return options.model_copy(update={"max_chunk_summary_tokens": per_chunk})


class AgentPipeline:
    """Runs one stream of steps against a backend, compacting the history whenever it exceeds tau."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        backend: Backend,
        settings: AgentSettings,
        *,
        context_window: int,
        block_size: int = 16,
    ) -> None:
        self.tokenizer = tokenizer
        self.backend = backend
        self.settings = settings
        self.compactor = Compactor(tokenizer, backend, context_window=context_window, block_size=block_size)

    def count(self, history: Sequence[Message]) -> int:
        return len(self.tokenizer.encode(self.tokenizer.render([template_view(m) for m in history])))

    async def answer(self, history: Sequence[Message], index: int) -> Answer:
        text = self.tokenizer.render([template_view(m) for m in history], add_generation_prompt=True)
        ids = tuple(self.tokenizer.encode(text))
        request = GenerationRequest(
            prompt_token_ids=ids, max_tokens=self.settings.answer_tokens, temperature=0.0, request_id=f"answer-{index}"
        )
        reply = await self.backend.generate(request)
        return Answer(reply.text.strip(), len(ids), reply.cached_prompt_tokens, reply.output_tokens, reply.latency_s)

    async def run(self, steps: Sequence[Step]) -> Episode:
        began = time.perf_counter()
        history = parse_messages([{"role": "system", "content": self.settings.system_prompt}])
        turns: list[Turn] = []
        for index, step in enumerate(steps):
            answer = None
            if isinstance(step, Document):
                history += parse_messages(step.messages)
            else:
                history += parse_messages([{"role": "user", "content": question_prompt(step)}])
                answer = await self.answer(history, index)
                history.append(Message(role="assistant", content=answer.text))
            tokens = self.count(history)
            stats, stall = None, 0.0
            if tokens > self.settings.tau:
                started = time.perf_counter()
                settings = self.settings
                options = matched_options(self.compactor, history, settings.compaction, settings.summary_tokens)
                try:
                    result = await self.compactor.compact(history, options)
                    history, stats = list(result.messages), result.stats
                except NothingToCompact:  # compacting would not shorten it: the agent goes on with it as it is
                    pass
                stall = time.perf_counter() - started
            after = stats.compacted_tokens if stats else tokens
            turns.append(Turn(index, step, tokens, answer, stats, stall, after))
        return Episode(turns, time.perf_counter() - began)
