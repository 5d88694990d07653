"""Stage 6: the chunk summaries merged, in chunk order, into the compacted head.

The head is the kept system messages, the carried summaries of earlier compactions, then one user
message: the summary header, each chunk's summary with its pinned lines, what was marked to keep
(`compaction.keep`), and the user's own words.

Pinned facts: beside the model's summary of each chunk, the most salient lines of the chunk, word for word.

A chunk's budget is split (`pinned_share`): the model writes its summary within the rest, and what
the summaries leave of their chunks' budgets is pooled for pinned lines, so a chunk dense in facts
(a failing run, the decision) may use room a quiet chunk left. The lines are the extractive
ranking's best (the user's constraints, errors and stack-trace heads, paths, commands, decisions,
numbers), chosen over the whole span, each written after its own chunk's summary. A line whose
facts a summary or the kept user words already state is not pinned, and a summary sentence whose
facts a pinned line states is dropped: no fact is stated twice. Pinned lines are copied from the
history (less a tool call's id tag), so they are grounded by construction; the summaries keep
their own grounding check. No model call: pinning is cheap, done at merge time over the span of
each compaction, so the chunk-summary cache holds the model summaries and the lines are chosen anew.

The user's words: what a compaction must never paraphrase away.

Of the compacted span's user messages (never tool results, never the summaries of earlier
compactions), the newest are kept while together they fit a token budget; a message that does
not fit is left to the summary and older ones are still tried. Repeats are kept once, and the
kept ones are written in their original order under a header, in the compacted head. Codex CLI
keeps the user's recent messages the same way (up to 20,000 tokens of a 272k window); the
default budget is the same share of the model's window.

A compaction never returns a history longer than it was sent: when the head it writes would not be
shorter than the span it replaces, the compaction answers "nothing to compact" (`NothingToCompact`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from compaction.archive import ArchivedChunk, archived_chunks, marker
from compaction.checks.grounding import Source, salient_tokens
from compaction.checks.omission import handles_in, missing, repaired
from compaction.checks.quality import drop_seen
from compaction.checks.validity import check_output
from compaction.errors import NothingToCompact
from compaction.extractive import CALL_TAG, Line, Segment, candidate_lines, render_lines, segments, weights, written
from compaction.history import Message
from compaction.keep import render_kept, wrapped
from compaction.ledger import derive, parse, render
from compaction.options import LEDGER_SHARE, CompactionOptions
from compaction.plan import SUMMARY_HEADER, CompactionPlan, is_summary
from compaction.render import rendered_tokens
from compaction.result import ChunkStats, CompactionResult, CompactionStats
from compaction.tokenizer import ChatTokenizer

_CLOSED = ("kept_verbatim", "extractive_fallback")  # fallback texts: no lines are pinned beside them


_SENTENCE = re.compile(r"(?<=[.!?])\s+")
MAX_CANDIDATES = 200  # the best lines are costed exactly (one tokenizer call each); the rest are never reached


@dataclass(frozen=True)
class ChunkText:
    """One chunk's part of the merge: its kept summary, its segments, and whether lines may be pinned to it."""

    summary: str
    parts: Sequence[Segment]
    tokens: int  # history tokens of the chunk
    open: bool  # False for a fallback text (the chunk verbatim or extractive): nothing is pinned to it


@dataclass(frozen=True)
class Pinned:
    """A chunk's text after pinning: its summary (less sentences a pinned line states) and its pinned lines."""

    text: str
    lines: int
    dropped_sentences: int


_WORD = re.compile(r"[a-z0-9_][\w./:-]*")
NEW_WORDS = 0.25  # a line adds a fact when over a quarter of its words are not stated yet


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def _words(text: str) -> set[str]:
    return {w.strip(".:-/") for w in _WORD.findall(text.lower()) if len(w) > 2}


def _repeats(line: Line, stated: Source, words: set[str]) -> bool:
    """Everything the line names is stated already (its salient tokens, and all but a quarter of its words)."""
    mine = _words(line.text)
    if any(not stated.contains(t) for t in salient_tokens(line.text)):
        return False
    return not mine or len(mine - words) <= NEW_WORDS * len(mine)


def _dedupe(summary: str, pinned: Source) -> tuple[str, int]:
    """The summary without the sentences whose salient tokens the pinned lines all state, its lines kept apart (a
    code block or a list joined into one line reads as something the model never wrote)."""
    lines, dropped = [], 0
    for line in summary.splitlines():
        kept = []
        for sentence in (s for s in _SENTENCE.split(line) if s.strip()):
            tokens = salient_tokens(sentence)
            if tokens and all(pinned.contains(t) for t in tokens):
                dropped += 1
            else:
                kept.append(sentence.strip())
        if kept:
            lines.append(" ".join(kept))
    return "\n".join(lines), dropped


def _candidates(chunks: Sequence[ChunkText], stated: Source, said: str) -> list[tuple[int, Line]]:
    """(chunk, line) for every distinct line of the open chunks not stated yet, call tags removed."""
    seen: set[str] = set()
    out: list[tuple[int, Line]] = []
    span = weights([part for chunk in chunks if chunk.open for part in chunk.parts])
    words = _words(said)
    for k, chunk in enumerate(chunks):
        if not chunk.open:
            continue
        for line in candidate_lines(chunk.parts, span):
            line = replace(line, text=CALL_TAG.sub("", line.text).strip())
            stated_already = _key(line.text) in said or _repeats(line, stated, words)
            if line.score > 0 and _key(line.text) not in seen and not stated_already:
                seen.add(_key(line.text))
                out.append((k, line))
    return out


def pin(chunks: Sequence[ChunkText], tokenizer: ChatTokenizer, budget: int, elsewhere: str = "") -> list[Pinned]:
    """Each chunk's summary with its pinned lines, within `budget` tokens per chunk, pooled over the chunks.

    `elsewhere`: text the compacted head states anyway (the kept user words).
    """
    sizes = [len(tokenizer.encode(c.summary)) + 1 if c.summary else 0 for c in chunks]
    room = sum(budget - size for c, size in zip(chunks, sizes, strict=True) if c.open)
    texts = [c.summary for c in chunks]
    said = _key(" ".join([*texts, elsewhere]))
    ranked = sorted(_candidates(chunks, Source(*texts, elsewhere), said), key=lambda kl: (-kl[1].score, kl[0]))
    kept: list[tuple[int, Line]] = []
    used = 0
    covered, words = Source(), set[str]()
    for k, line in ranked[:MAX_CANDIDATES]:
        if _repeats(line, covered, words):
            continue  # what it says, a line kept already says
        cost = len(tokenizer.encode(written(line))) + 1  # + its line break
        if used + cost <= room:
            kept.append((k, line))
            covered, words = Source(covered.text, line.text), words | _words(line.text)
            used += cost
    out = []
    for k, chunk in enumerate(chunks):
        mine = [line for at, line in kept if at == k]
        if not mine:
            out.append(Pinned(chunk.summary, 0, 0))
            continue
        lines = render_lines(mine)
        summary, dropped = _dedupe(chunk.summary, Source(lines))
        out.append(Pinned(f"{summary}\n{lines}" if summary else lines, len(mine), dropped))
    return out


USER_WORDS_HEADER = "The user's words, verbatim:"
NOTHING_SUMMARISED = "(Nothing summarised: the tool output of the turns below was cleared to save context.)"
WINDOW_SHARE = 0.075  # Codex: 20,000 tokens of a 272,000-token window


def user_words_budget(options: CompactionOptions, context_window: int) -> int:
    """The user-words budget: the option, or its share of the model window."""
    if options.user_words_tokens is not None:
        return options.user_words_tokens
    return int(context_window * WINDOW_SHARE)


@dataclass(frozen=True)
class UserWords:
    """The user messages kept verbatim, in their original order, and how many were not."""

    texts: tuple[str, ...]  # kept, oldest first
    total: int  # distinct user messages in the span
    tokens: int  # tokens of the kept texts (each tokenised alone)

    @property
    def dropped(self) -> int:
        return self.total - len(self.texts)

    def render(self) -> str:
        """The block written after the summary in the compacted head; empty when nothing is kept."""
        if not self.texts:
            return ""
        return "\n".join([USER_WORDS_HEADER, *(f"- {t}" for t in self.texts)])


def carried_words(summary: str) -> list[str]:
    """The user's words an earlier compaction's head kept (its USER_WORDS_HEADER block, as `UserWords.render`
    wrote it, the head's last block: one "- " item each, a message's later lines following its first)."""
    _, found, block = summary.partition(USER_WORDS_HEADER + "\n")
    items: list[str] = []
    for line in block.splitlines() if found else []:
        if line.startswith("- "):
            items.append(line[2:])
        elif items:
            items[-1] += "\n" + line
    return [item.strip() for item in items if item.strip()]


def keep_user_words(
    messages: Sequence[Message], tokenizer: ChatTokenizer, limit: int, skip: Callable[[Message], bool]
) -> UserWords:
    """The newest distinct user messages of `messages` within `limit` tokens. `skip`: earlier summaries, whose own
    block of the user's words is read instead (anchored: a chain of compactions keeps them, never summarised)."""
    seen: set[str] = set()
    distinct: list[str] = []
    for message in messages:
        if message.role != "user":
            continue
        for text in carried_words(message.text()) if skip(message) else [message.text().strip()]:
            key = " ".join(text.lower().split())
            if key and key not in seen:
                seen.add(key)
                distinct.append(text)
    kept: list[str] = []
    used = 0
    for text in reversed(distinct):
        if limit <= used:
            break
        cost = len(tokenizer.encode(text)) + 2  # the "- " and the line break
        if used + cost <= limit:
            kept.append(text)
            used += cost
    return UserWords(tuple(reversed(kept)), len(distinct), used)


def user_words(plan: CompactionPlan, tokenizer: ChatTokenizer, context_window: int) -> UserWords:
    """The user's messages of the compacted span kept verbatim in the compacted head (`user_words_tokens`)."""
    span = plan.history.messages[plan.kept_head : plan.kept_tail_from]
    return keep_user_words(span, tokenizer, user_words_budget(plan.options, context_window), is_summary)


def _pinned(
    plan: CompactionPlan, per_chunk: list[tuple[ChunkStats, str]], words: str, tokenizer: ChatTokenizer
) -> list[tuple[ChunkStats, str]]:
    """Each chunk's summary with its pinned lines (`pinned_share`; `words`: the kept user words)."""
    opts = plan.options
    if opts.pinned_share == 0 or opts.strategy == "extractive":
        return per_chunk
    texts = [
        ChunkText(text, segments(plan.history, tokenizer, c.start, c.end), c.size, s.status not in _CLOSED)
        for c, (s, text) in zip(plan.chunks, per_chunk, strict=True)
    ]
    pinned = pin(texts, tokenizer, opts.max_chunk_summary_tokens, words)
    return [
        (s.model_copy(update={
            "pinned_lines": p.lines,
            "summary_tokens": len(tokenizer.encode(p.text)),
            "dropped_sentences": s.dropped_sentences + p.dropped_sentences,
        }), p.text)
        for (s, _), p in zip(per_chunk, pinned, strict=True)
    ]  # fmt: skip


def merge(
    plan: CompactionPlan,
    per_chunk: list[tuple[ChunkStats, str]],
    latency: float,
    tokenizer: ChatTokenizer,
    context_window: int,
) -> CompactionResult:
    """The compacted history and its stats: kept head, one summary message, the recent turns verbatim."""
    words = user_words(plan, tokenizer, context_window)
    per_chunk = _pinned(plan, per_chunk, "\n".join(words.texts), tokenizer)
    stats = [s for s, _ in per_chunk]
    seen: list[tuple[str, ...]] = []  # no sentence of the summary repeats another, across chunks too
    texts = [drop_seen(text, seen) for _, text in per_chunk]
    archived = _archived(plan, tokenizer) if plan.options.archive else []
    if archived:  # each chunk's handle after its summary
        texts = [(text + marker(chunk.handle)).strip() for text, chunk in zip(texts, archived, strict=True)]
    cleared = plan.clearing.messages if plan.clearing is not None else ()
    if plan.clearing is not None and plan.options.archive:
        archived = [*archived, *plan.clearing.archived]
    summary = "\n\n".join(text for text in texts if text) or (NOTHING_SUMMARISED if cleared else "")
    # Kept once: not again when the user's words hold it marked (a later compaction finds it there).
    marked = [t for t in plan.marked if not any(wrapped(t) in said for said in words.texts)]
    state = ledger_block(plan, tokenizer, context_window)
    blocks = [f"{SUMMARY_HEADER}\n{summary}", render_kept(marked), state.text]

    def composed(*more: str) -> list[Message]:
        head = "\n\n".join(part for part in (*blocks, *more, words.render()) if part)  # the user's words last
        return [
            *plan.history.messages[: plan.kept_head],
            Message(role="user", content=head),
            *cleared,
            *plan.history.messages[plan.replaces_through :],
        ]

    required = [*handles_in(plan.history.messages[plan.kept_head : plan.kept_tail_from]), *state.constraints]
    lost = missing(required, composed())
    messages = composed(repaired(lost))
    check_output(messages)
    compacted = rendered_tokens(messages, tokenizer, plan.tools)
    if compacted >= len(plan.history.token_ids):  # never a longer history than was sent
        raise NothingToCompact(
            "messages",
            f"nothing to compact: the compacted history would hold {compacted} tokens, not fewer than the "
            f"{len(plan.history.token_ids)} sent (the span to summarise is shorter than its summary, marked spans "
            "and the user's words); send the history as it is",
        )
    opts = plan.options
    return CompactionResult(
        messages=messages,
        summary=summary,
        kept_head=plan.kept_head,
        replaces_through=plan.replaces_through,
        head_messages=plan.kept_head + 1 + len(cleared),
        stats=CompactionStats(
            strategy=opts.strategy,
            layout=opts.layout if opts.strategy == "parallel" else opts.strategy,
            variant=opts.variant,
            history_tokens=len(plan.history.token_ids),
            input_tokens=plan.span[1] - plan.span[0],
            chunks=len(stats),
            prompt_tokens=sum(s.prompt_tokens for s in stats),
            cached_prompt_tokens=sum(s.cached_prompt_tokens for s in stats),
            computed_prefill_tokens=sum(s.computed_prefill_tokens for s in stats),
            prefill_floor_tokens=plan.prefill_floor_tokens,
            windows=plan.windows,
            output_tokens=sum(s.output_tokens for s in stats),
            summary_tokens=len(tokenizer.encode(summary)),
            compacted_tokens=compacted,
            latency_s=latency,
            retries=sum(s.retries for s in stats),
            failovers=sum(s.failovers for s in stats),
            reused_chunks=sum(s.reused for s in stats),
            carried_summary_tokens=plan.carried_tokens,
            user_words_kept=len(words.texts),
            user_words_dropped=words.dropped,
            user_words_tokens=len(tokenizer.encode(words.render())) if words.texts else 0,
            empty_or_runaway_chunks=[s.index for s in stats if s.first_verdict not in (None, "ok")],
            grounding_threshold=opts.grounding_threshold if opts.strategy != "extractive" else 0.0,
            ungrounded_chunks=[
                s.index for s in stats if s.first_grounding is not None and s.first_grounding < opts.grounding_threshold
            ],
            extractive_fallback_chunks=[s.index for s in stats if s.status == "extractive_fallback"],
            given_up_chunks=[s.index for s in stats if s.given_up],
            replicas=[s.replica for s in stats],
            archived_handles=[chunk.handle for chunk in archived],
            cleared_tool_outputs=plan.clearing.cleared if plan.clearing is not None else 0,
            ledger_entries=state.entries,
            ledger_tokens=len(tokenizer.encode(state.text)) if state.text else 0,
            omissions_repaired=len(lost),
            cleared_tokens=plan.clearing.saved_tokens if plan.clearing is not None else 0,
            per_chunk=stats,
        ),
        archived=archived,
    )


@dataclass(frozen=True)
class LedgerBlock:
    """The state ledger as the head writes it, its entries, and the user's constraints it holds (all of them)."""

    text: str = ""
    entries: int = 0
    constraints: tuple[str, ...] = ()


def ledger_block(plan: CompactionPlan, tokenizer: ChatTokenizer, context_window: int) -> LedgerBlock:
    """The ledger of the history: the latest earlier compaction's ledger (carried or summarised again), updated by
    every message after the kept head (`ledger_tokens`; none when 0, or when no message holds a tool call)."""
    budget = plan.options.ledger_tokens
    budget = int(context_window * LEDGER_SHARE) if budget is None else budget
    if not budget or not any(m.tool_calls for m in plan.history.messages):
        return LedgerBlock()  # no agent at work (a conversation): the summaries and the user's words hold it
    earlier = (parse(m.text()) for m in reversed(plan.history.messages[: plan.kept_tail_from]) if is_summary(m))
    prior = next((found for found in earlier if found is not None), None)
    ledger = derive(plan.history.messages[plan.kept_head :], prior)  # the verbatim tail too: the state is current
    text = render(ledger, budget, lambda t: len(tokenizer.encode(t)))
    return LedgerBlock(text, sum(line.startswith("- ") for line in text.splitlines()), ledger.constraints)


def _archived(plan: CompactionPlan, tokenizer: ChatTokenizer) -> list[ArchivedChunk]:
    return archived_chunks(plan.history.token_ids, [(c.start, c.end) for c in plan.chunks], tokenizer)
