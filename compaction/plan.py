"""Stage 3: the plan of one compaction, everything decided before any model call.

Validate the messages, render them once (stage 1), choose the ends kept verbatim (system messages
and carried summaries at the head, the recent turns at the tail), cut the span between them into
chunks (stage 2) and lay out one prompt per chunk (`compaction.layouts`), each checked against the
model window. The coordinator routes from the plan; `Compactor.run` sends its prompts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compaction.checks.sources import ChunkSources
from compaction.checks.validity import check_history, turn_start
from compaction.chunk_cache import ChunkCache, scope_of
from compaction.clearing import Clearing, tiers
from compaction.errors import ContextOverflow, InvalidInput, NothingToCompact
from compaction.history import Message, parse_messages, template_view
from compaction.keep import check_kept, marked_to_keep
from compaction.layouts import ChunkPrompt, lay_out
from compaction.options import CompactionOptions
from compaction.partition import Chunk, PlanLimits, partition
from compaction.render import RenderedHistory, render_history, token_floor
from compaction.tokenizer import ChatTokenizer

SUMMARY_HEADER = "Summary of the earlier conversation (compacted):"
PREFER_SLACK_SHARE = 0.25  # a preferred kept tail may keep this share of keep_recent_tokens more than the options


def is_summary(message: Message) -> bool:
    """True for the summary message a compaction wrote (the client carries it in its history)."""
    return message.role == "user" and message.text().startswith(SUMMARY_HEADER)


@dataclass(frozen=True)
class CompactionPlan:
    """Everything decided before any model call; the coordinator routes from it."""

    options: CompactionOptions
    history: RenderedHistory
    kept_head: int  # leading messages kept verbatim: system messages, then carried earlier summaries
    kept_tail_from: int  # index of the first recent message kept verbatim
    carried_tokens: int  # tokens of the earlier summaries carried verbatim in the head
    scope: str  # the options that shape a chunk summary, as the chunk cache's key
    span: tuple[int, int]  # token range compacted
    chunks: tuple[Chunk, ...]  # the span cut in chunk order (one chunk when sequential)
    prompts: tuple[ChunkPrompt, ...]  # one per chunk, in chunk order; none when extractive
    strict_prompts: tuple[ChunkPrompt, ...]  # same bodies, stricter tails (retries)
    prefill_floor_tokens: int
    windows: int = 1  # groups of chunk prompts sharing a window start (windowed layout), else 1
    sources: ChunkSources | None = None  # what each chunk's summary may state, built in one pass over the history
    marked: tuple[str, ...] = ()  # the span's <keep>…</keep> texts (compaction.keep), written in the head
    tools: tuple[Mapping[str, Any], ...] | None = None  # the agent's tool list, rendered with the history
    clearing: Clearing | None = None  # the turns after the summarised span, their tool output cleared (`clearing`)

    @property
    def replaces_through(self) -> int:
        """The first message kept as it was sent (after the summary and the cleared turns)."""
        return self.clearing.end if self.clearing is not None else self.kept_tail_from


@dataclass(frozen=True)
class Planner:
    """What planning needs of a model: its tokenizer, window and cache block, the chunk cache and the caps."""

    tokenizer: ChatTokenizer
    context_window: int
    block_size: int = 16
    cache: ChunkCache | None = None  # chunk borders cached before stay borders (incremental reuse)
    limits: PlanLimits | None = None  # caps on chunks and history tokens; None: none

    def plan(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        options: CompactionOptions | Mapping[str, Any] | None,
        namespace: str = "",
        prefer_tail_from: int | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> CompactionPlan:
        """Validate, render once, partition and lay out. Raises InvalidInput naming the problem. `namespace`
        (a tenant): chunk summaries are reused only within it; `prefer_tail_from`: see `kept_ends`; `tools`: the
        agent's tool list, rendered as its turns render it (`compaction.render.render_history`)."""
        opts = CompactionOptions.parse(options)
        parsed = parse_messages(messages)
        check_history(parsed)
        if self.limits is not None:  # refused before rendering when it cannot fit (rendering one takes seconds)
            self.limits.check_history(token_floor([template_view(m) for m in parsed], self.tokenizer), at_least=True)
        listed = tuple(tools) if tools else None
        history = render_history(parsed, self.tokenizer, listed)
        if self.limits is not None:
            self.limits.check_history(len(history.token_ids))
        system, head, summaries, tail_from = kept_ends(history, opts, prefer_tail_from)
        clearing = tiers(history, head, tail_from, opts, self.tokenizer)
        tail_from = clearing.start if clearing is not None else tail_from  # the summarised span ends there
        marked = marked_to_keep(history.messages[head:tail_from])
        check_kept(marked, self.tokenizer, self.context_window)
        starts = (*history.message_starts, len(history.token_ids))
        span = (starts[head], starts[tail_from])
        scope = scope_of(opts, namespace)
        if span[0] == span[1]:
            chunks: tuple[Chunk, ...] = ()  # all of it cleared: nothing to summarise
        elif opts.strategy == "sequential":
            chunks = (Chunk(0, *span),)
        else:
            # Summaries summarised again (not carried) form chunks of their own: a second level.
            chunks = self._partition(history, opts, span, [starts[summaries]] if head < summaries else [], scope)
        if opts.chunk_instructions and max(opts.chunk_instructions) >= len(chunks):
            raise InvalidInput(
                "chunk_instructions",
                f"names chunk {max(opts.chunk_instructions)} but there are {len(chunks)}",
            )
        carried = starts[head] - starts[system]
        sources = ChunkSources(history, self.tokenizer, [c.end for c in chunks])
        if opts.strategy == "extractive" or not chunks:
            return CompactionPlan(
                opts, history, head, tail_from, carried, scope, span, chunks, (), (), 0, 1, sources, marked, listed,
                clearing,
            )  # fmt: skip
        laid = lay_out(history, self.tokenizer, opts, chunks, span[1], self.context_window, self.block_size)
        check_window((*laid.prompts, *laid.strict_prompts), laid.options, self.context_window)
        return CompactionPlan(
            laid.options,
            history,
            head,
            tail_from,
            carried,
            scope,
            span,
            chunks,
            laid.prompts,
            laid.strict_prompts,
            laid.floor,
            len(laid.windows),
            sources,
            marked,
            listed,
            clearing,
        )

    def _partition(
        self, history: RenderedHistory, opts: CompactionOptions, span: tuple[int, int], fixed: list[int], scope: str
    ) -> tuple[Chunk, ...]:
        """Cut the span; borders of chunks cached before stay borders unless that passes max_chunks."""
        cached = []
        if self.cache is not None and opts.strategy == "parallel" and opts.reuse_chunks:
            cached = self.cache.borders(history.token_ids, *span, scope)
        chunks = partition(*span, opts.chunk_tokens, self.block_size, fixed + cached)
        if self.limits is None or len(chunks) <= self.limits.max_chunks:
            return chunks
        chunks = partition(*span, opts.chunk_tokens, self.block_size, fixed)
        cut = lambda size: partition(*span, size, self.block_size, fixed)  # noqa: E731
        self.limits.check_chunks(chunks, opts.chunk_tokens, cut, span[1] - span[0])
        return chunks


def kept_ends(
    history: RenderedHistory, opts: CompactionOptions, prefer_tail_from: int | None = None
) -> tuple[int, int, int, int]:
    """(system messages, messages kept at the head, end of the earlier summaries, first recent message kept).

    Whole messages only. The head is the leading system messages, then the summaries of earlier
    compactions while together they fit `carry_summary_tokens` (else they are summarised again).
    `prefer_tail_from`: the kept tail starts at this message instead when that keeps at most
    PREFER_SLACK_SHARE of keep_recent_tokens more (a rolling session's compaction at its threshold: its
    last run summarised the span up to there ahead, `serving.background`); never less than the options keep.
    """
    count = len(history.messages)
    starts = (*history.message_starts, len(history.token_ids))
    system = 0
    while system < count and history.messages[system].role == "system":
        system += 1
    if system == count:
        raise NothingToCompact("messages", "the history holds only system messages; nothing to compact")
    summaries = system
    while summaries < count and is_summary(history.messages[summaries]):
        summaries += 1
    head = summaries if starts[summaries] - starts[system] <= opts.carry_summary_tokens else system
    if head == count:
        raise NothingToCompact("messages", "the history holds only system messages and earlier summaries")
    tail_from = count
    keep = opts.keep_recent_tokens
    while tail_from > head and starts[count] - starts[tail_from - 1] <= keep:
        tail_from -= 1
    if opts.keep_current_turn:
        users = [i for i in range(head, count) if history.messages[i].role == "user"]
        tail_from = min(tail_from, users[-1]) if users else tail_from
    tail_from = turn_start(history.messages, tail_from, head)
    slack = opts.keep_recent_tokens * PREFER_SLACK_SHARE
    prefer = tail_from if prefer_tail_from is None else prefer_tail_from
    if head < prefer < tail_from and starts[tail_from] - starts[prefer] <= slack:
        tail_from = turn_start(history.messages, prefer, head)
    if tail_from == head:
        field = "keep_current_turn" if opts.keep_current_turn else "keep_recent_tokens"
        message = f"keeps the whole history verbatim ({keep} recent tokens); nothing to compact"
        raise NothingToCompact(field, message)
    return system, head, summaries, tail_from


def check_window(prompts: Sequence[ChunkPrompt], opts: CompactionOptions, context_window: int) -> None:
    """Every prompt plus its summary budget fits the model window, or ContextOverflow says what to change."""
    for p in prompts:
        need = len(p) + opts.max_chunk_summary_tokens
        if need <= context_window:
            continue
        if opts.strategy == "sequential":
            raise ContextOverflow(
                "messages",
                f"the history ({len(p.body)} tokens) plus instructions and the summary budget needs {need} "
                f"tokens, over the model window of {context_window}; use strategy=parallel (its default "
                "layout=auto fits any history), or keep fewer tokens",
            )
        raise ContextOverflow(
            "messages",
            f"the prompt of chunk {p.chunk.index} needs {need} tokens, over the model window of "
            f"{context_window} ({opts.layout} puts the history before the chunk in the prompt); "
            "use layout=auto (windowed when the history is too long) or compact a shorter history",
        )
