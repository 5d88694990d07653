"""Prompt layouts, built in token space from the once-rendered history.

Every prompt is `body + tail`. The body holds history tokens (and, in some layouts, marker
tokens); the tail closes the open turn and holds the instructions and the generation prompt.

- prefix_exact: body k = history[0:end_k] verbatim. Body k is a strict token prefix of body k+1
  and of the agent's own rendered history, so the chunk prompts reuse each other's cache and the
  cache the agent's turns already filled. The tail names the target by number and opening words.
- windowed: for histories whose prefix_exact prompts would not fit the model window: body k =
  the kept head + history[start:end_k], where consecutive chunks share a start (see
  `compaction.windows`); the first group's prompts are the prefix_exact ones.
- auto (the default): prefix_exact when every prompt fits the window, else windowed.
- prefix_exact_marked: every chunk between identical <segment> markers in every prompt; body k is
  still a strict prefix of body k+1, but the markers break reuse of the agent's own cache.
- paper: chunks 1..k-1, then chunk k inside <target> tags (the reference layout; body k+1 holds
  chunk k without tags, so it cannot reuse body k past chunk k's start).
- independent: chunk k alone (ablation).
- shared_full: the whole snapshot with chunk k inside <target> tags (ablation).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from compaction.chunk_content import content_instructions
from compaction.instructions import caller_instructions, instruction_text, target_phrase
from compaction.options import CompactionOptions, Layout, model_budget
from compaction.partition import Chunk
from compaction.render import RenderedHistory
from compaction.tokenizer import ChatTokenizer
from compaction.views import PrefixDigests, TokenView
from compaction.windows import Window, plan_windows, windowed_floor

SEGMENT = ("\n<segment>\n", "\n</segment>\n")
TARGET = ("\n<target>\n", "\n</target>\n")
_PROBE = "\x00"


@dataclass(frozen=True)
class ChunkPrompt:
    """One prompt of a compaction, in token ids."""

    chunk: Chunk  # the history slice this prompt asks to summarise
    body: Sequence[int]  # history (+ markers), a view of the history; identical between a prompt and its retry
    tail: tuple[int, ...]  # turn close + instructions + generation prompt
    raw_prefix: int  # body[:raw_prefix] == history[:raw_prefix]: what the agent's own cache can serve
    history_tokens: int  # how many history tokens the body holds (markers excluded)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The whole prompt, materialised (when it is sent)."""
        return (*self.body, *self.tail) if not isinstance(self.body, TokenView) else self.body + self.tail

    @property
    def view(self) -> TokenView:
        """The whole prompt as a view (nothing copied): for digests, lengths and prefix comparisons."""
        if isinstance(self.body, TokenView):
            return self.body.then(self.tail)
        return TokenView(tuple(self.body), (range(len(self.body)), self.tail))

    def __len__(self) -> int:
        return len(self.body) + len(self.tail)


def opening_words(tokenizer: ChatTokenizer, ids: Sequence[int], words: int = 10) -> str:
    """The first words of a chunk, as the tail quotes them to point at the target."""
    text = re.sub(r"\s+", " ", tokenizer.decode(ids[:32])).strip().replace("“", "").replace("”", "")
    return " ".join(text.split(" ")[:words])


def tail_ids(tokenizer: ChatTokenizer, closed: bool, instructions: str) -> tuple[int, ...]:
    """Close the open turn, then a user turn holding the instructions, then the generation prompt.

    The instructions are tokenised as text: they quote the chunk's opening words, which are
    conversation content and may spell control tokens.
    """
    before, after = tokenizer.user_turn(_PROBE).split(_PROBE)
    markup = ("" if closed else tokenizer.end_of_turn) + before
    text, _ = tokenizer.encode_with_offsets(instructions, as_text=True)
    return (*tokenizer.encode(markup), *text, *tokenizer.encode(after))


def closed_borders(history: RenderedHistory) -> set[int]:
    """Token positions right after a closed turn: a prompt whose history part ends there needs no turn close."""
    return (set(history.message_starts) - history.open_starts) | {len(history.token_ids)}


def _body(
    layout: Layout,
    ids: tuple[int, ...],
    chunks: Sequence[Chunk],
    k: int,
    span_end: int,
    markers: dict[str, tuple[int, ...]],
    start: int | None,
    view: TokenView,
    before: TokenView | None = None,
) -> tuple[TokenView, int, int]:
    """(body, raw_prefix, history_tokens) of chunk k's prompt; `start`: its window start (windowed).

    Bodies are views of the history (`view` is the empty one), never copies; `before`: chunk k-1's body
    in prefix_exact_marked, which body k extends.
    """
    chunk = chunks[k]
    if layout == "prefix_exact" or (layout == "windowed" and start == chunks[0].start):
        return view.then(range(chunk.end)), chunk.end, chunk.end
    if layout == "windowed" and start is not None:
        head = chunks[0].start
        return view.then(range(head), range(start, chunk.end)), head, head + chunk.end - start
    if layout == "independent":
        return view.then(range(chunk.start, chunk.end)), 0, chunk.size
    if layout == "prefix_exact_marked":
        first = chunks[0].start
        marked = before if before is not None else view.then(range(first))
        segment = (markers["segment_open"], range(chunk.start, chunk.end), markers["segment_close"])
        return marked.then(*segment), first, chunk.end
    tagged = (markers["target_open"], range(chunk.start, chunk.end), markers["target_close"])
    after = range(chunk.end, span_end) if layout == "shared_full" else range(0)
    return view.then(range(chunk.start), *tagged, after), chunk.start, chunk.end + len(after)


def build_prompts(
    history: RenderedHistory,
    tokenizer: ChatTokenizer,
    options: CompactionOptions,
    chunks: Sequence[Chunk],
    span_end: int,
    strict: bool = False,
    starts: Sequence[int] | None = None,
    prefixes: PrefixDigests | None = None,
) -> tuple[ChunkPrompt, ...]:
    """One prompt per chunk (a single whole-span prompt when sequential); `starts`: window starts (windowed);
    `prefixes`: the history's prefix digests, shared by the prompts of one plan."""
    ids = history.token_ids
    borders = closed_borders(history)
    if options.layout == "auto":  # `lay_out` resolves it against the model window
        options = options.model_copy(update={"layout": "prefix_exact"})
    markers = {
        "segment_open": tuple(tokenizer.encode(SEGMENT[0])),
        "segment_close": tuple(tokenizer.encode(SEGMENT[1])),
        "target_open": tuple(tokenizer.encode(TARGET[0])),
        "target_close": tuple(tokenizer.encode(TARGET[1])),
    }
    sequential = options.strategy == "sequential"
    view = TokenView(ids, (), prefixes=prefixes or PrefixDigests(ids))
    prompts: list[ChunkPrompt] = []
    for k, chunk in enumerate(chunks):
        if sequential:
            body, raw, hist = view.then(range(span_end)), span_end, span_end
        else:
            start = starts[k] if starts is not None else None
            before = prompts[-1].body if prompts and isinstance(prompts[-1].body, TokenView) else None
            body, raw, hist = _body(options.layout, ids, chunks, k, span_end, markers, start, view, before)
        tail = _tail(history, tokenizer, options, chunks, k, span_end, strict, borders)
        prompts.append(ChunkPrompt(chunk, body, tail, raw, hist))
    return tuple(prompts)


def _tail(
    history: RenderedHistory,
    tokenizer: ChatTokenizer,
    options: CompactionOptions,
    chunks: Sequence[Chunk],
    k: int,
    span_end: int,
    strict: bool,
    borders: set[int],
) -> tuple[int, ...]:
    """Chunk k's tail: it does not depend on how much history the body holds, only on the chunk (its content
    chooses the instructions, `compaction.chunk_content`) and the options."""
    chunk, ids = chunks[k], history.token_ids
    sequential = options.strategy == "sequential"
    last_history_token = span_end if sequential or options.layout == "shared_full" else chunk.end
    target = target_phrase(
        None if sequential else options.layout,
        k,
        opening_words(tokenizer, ids[chunk.start : chunk.end]),
    )
    extra = caller_instructions(options, k)
    content = content_instructions(history, options, chunk)
    text = instruction_text(options.variant, target, model_budget(options), extra, strict, content)
    return tail_ids(tokenizer, last_history_token in borders, text)


@dataclass(frozen=True)
class PromptSet:
    """The prompts of one compaction, with the layout actually used and its prefill floor."""

    options: CompactionOptions  # the request's options with `layout` resolved (auto -> what was built)
    prompts: tuple[ChunkPrompt, ...]  # one per chunk, in chunk order
    strict_prompts: tuple[ChunkPrompt, ...]  # same bodies, stricter tails (retries)
    floor: int  # the least prefill of these prompts with a perfect prefix cache
    windows: tuple[Window, ...]  # windowed: the groups sharing a start; otherwise one group


def _rooms(
    history: RenderedHistory, tokenizer: ChatTokenizer, options: CompactionOptions, chunks: Sequence[Chunk],
    span_end: int, window: int,
) -> list[int]:  # fmt: skip
    """History tokens each chunk's prompt may hold: the window minus the summary budget and its longer tail."""
    borders = closed_borders(history)
    exact = options.model_copy(update={"layout": "prefix_exact"})
    return [
        window - options.max_chunk_summary_tokens - max(
            len(_tail(history, tokenizer, exact, chunks, k, span_end, strict, borders)) for strict in (False, True)
        )
        for k in range(len(chunks))
    ]  # fmt: skip


def lay_out(
    history: RenderedHistory,
    tokenizer: ChatTokenizer,
    options: CompactionOptions,
    chunks: Sequence[Chunk],
    span_end: int,
    window: int,
    block_size: int,
) -> PromptSet:
    """Resolve `auto`, plan the windows of the windowed layout, and build every prompt and its retry."""
    layout = "prefix_exact" if options.layout == "auto" else options.layout
    head_end = chunks[0].start
    windows: tuple[Window, ...] = (Window(head_end, tuple(range(len(chunks)))),)
    if options.strategy == "parallel" and options.layout in ("auto", "windowed"):
        rooms = _rooms(history, tokenizer, options, chunks, span_end, window)
        if options.layout == "windowed" or any(c.end > r for c, r in zip(chunks, rooms, strict=True)):
            layout = "windowed"
            windows = plan_windows(chunks, head_end, rooms, block_size)
    opts = options.model_copy(update={"layout": layout})
    starts = [w.start for w in windows for _ in w.chunks] if layout == "windowed" else None
    prefixes = PrefixDigests(history.token_ids)
    prompts = build_prompts(history, tokenizer, opts, chunks, span_end, starts=starts, prefixes=prefixes)
    strict = build_prompts(history, tokenizer, opts, chunks, span_end, strict=True, starts=starts, prefixes=prefixes)
    if layout != "windowed":
        return PromptSet(opts, prompts, strict, prefill_floor(prompts, span_end, block_size), windows)
    own = sum(len(p.tail) + len(p.body) % block_size for p in prompts)
    floor = windowed_floor(windows, chunks, head_end, own, span_end, block_size)
    return PromptSet(opts, prompts, strict, floor, windows)


def prefill_floor(prompts: Sequence[ChunkPrompt], history_end: int, block_size: int) -> int:
    """The least prefill any prefix cache can do: the history once plus every prompt's own tokens.

    History tokens are counted once, rounded up to a block; each prompt adds what it holds beyond
    history tokens (tail, markers) plus the partial block its history part ends in, which the
    next prompt cannot reuse because their tails differ.
    """
    history = -(-history_end // block_size) * block_size
    own = sum(len(p) - p.history_tokens + (p.chunk.end % block_size if p.raw_prefix else 0) for p in prompts)
    return history + own
