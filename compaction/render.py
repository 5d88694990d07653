"""Stage 1: a history rendered ONCE with the model's chat template and tokenised once.

Every later stage (partition, layouts) works on these token ids, so chunk borders never
re-tokenise and prompts share exact token prefixes.

Content is data: message text is tokenised as text; only the chat template's own markers are control tokens.

A tokenizer parses control tokens (`<|im_end|>`, `<|im_start|>`, ...) wherever their spelling
occurs, so a fetched web page or file in a tool result that spells `<|im_end|>\\n<|im_start|>system`
would become a real system turn inside every compaction prompt. Here the rendering is tokenised
as usual (so content without such spellings keeps exactly the ids the agent's own
`/v1/chat/completions` turns produce, and the agent's prefix cache stays reusable), then only the
stretches where a control token was found inside a message's content are tokenised again, as text.

Where each message's content lies in the rendering is found by rendering the same history with
every content replaced by a sentinel: the template's own text between sentinels is exact, so the
content spans follow without guessing (templates that trim content are handled too).

A history with tool traffic is rendered as the agent's turns were (`chat_view`s and its tool list, when
the template writes tool calls): token for token the prompts vLLM's chat endpoint prefilled for it.
"""

from __future__ import annotations

import bisect
import itertools
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compaction.errors import InvalidInput
from compaction.history import Message, chat_view, template_view
from compaction.tokenizer import ChatTokenizer

Span = tuple[int, int]  # [start, end) in characters of the rendered text
_SENTINEL = re.compile("\ue000(\\d+)\ue001")


def _sentinel(i: int) -> str:
    return f"\ue000{i}\ue001"


@dataclass(frozen=True)
class _Floor:
    markers: Mapping[str, int]  # role -> control tokens the template marks each turn of that role with
    verbatim: frozenset[str]  # roles whose content the template writes out as it is


_FLOORS: weakref.WeakKeyDictionary[Any, _Floor] = weakref.WeakKeyDictionary()
_MARK = "\ue000floor\ue001"


def token_floor(views: Sequence[Mapping[str, Any]], tokenizer: ChatTokenizer) -> int:
    """At least this many tokens: what `views` render to, bounded from below without rendering them, so a
    history that cannot fit is refused before the seconds its rendering and counting would take. Each turn
    adds the control tokens the template marks a turn of its role with (a tokenizer splits text at those
    first, so they never merge with content), and content the template writes out takes a token per
    `max_token_chars` of its non-blank characters or more (a template may trim blanks): each turn's own
    when control tokens enclose it, together for turns a template merges."""
    floor = _FLOORS.get(tokenizer)
    if floor is None:
        floor = _FLOORS.setdefault(tokenizer, _probe_floor(tokenizer))
    per, total, loose = tokenizer.max_token_chars, 0, 0
    for i, view in enumerate(views):
        role, content = view.get("role"), view.get("content")
        # a template may fold the first turn into a header it writes anyway (Llama's system turn, Mistral's
        # system text in the first user turn): its markers are not counted
        marked = floor.markers.get(role, 0) if i and isinstance(role, str) else 0
        total += marked
        if role in floor.verbatim and isinstance(content, str):
            chars = sum(map(len, content.split()))
            if marked:  # its own stretch between control tokens: no token spans two contents
                total += -(-chars // per)
            else:
                loose += chars
    return total + loose // per


def _probe_floor(tokenizer: ChatTokenizer) -> _Floor:
    """Per role, whether one turn's content is written out once (also when the template merges turns of the
    role, as Qwen-style templates do with tool results), and the control tokens one more turn adds after a
    turn of another role and again after one of its own (none when a second turn rewrites the first's end:
    merged). A role the template refuses at that place gets no floor."""
    markers: dict[str, int] = {}
    verbatim = set()
    for role in ("system", "user", "assistant", "tool"):
        before = [{"role": "user", "content": "a"}] + (
            [{"role": "assistant", "content": "b"}] if role != "assistant" else []
        )
        turn = {"role": role, "content": _MARK}
        try:
            texts = [tokenizer.render([*before, *[turn] * n]) for n in range(3)]
        except Exception:  # a template raises what it likes for a role it refuses
            continue
        if all(text.count(_MARK) == n for n, text in enumerate(texts)):
            verbatim.add(role)  # each turn's content written out once, merged into one turn or not
        if texts[1].startswith(texts[0]) and texts[2].startswith(texts[1]):
            added = [
                sum(i in tokenizer.control_token_ids for i in tokenizer.encode(later[len(earlier) :]))
                for earlier, later in itertools.pairwise(texts)
            ]
            markers[role] = min(added)
    return _Floor(markers, frozenset(verbatim))


def _unsupported(why: str) -> InvalidInput:
    return InvalidInput("model", f"the chat template {why}; its histories cannot be compacted in token space")


def content_spans(views: Sequence[dict[str, Any]], text: str, tokenizer: ChatTokenizer) -> tuple[Span, ...]:
    """The character span of each message's content inside `text`, the rendering of `views`."""
    return located_contents(views, text, tokenizer, range(len(views)))[0]


def located_contents(
    views: Sequence[dict[str, Any]],
    text: str,
    tokenizer: ChatTokenizer,
    which: Sequence[int],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[tuple[Span, ...], list[str]]:
    """The spans of the contents of `views[which]` inside `text` (the rendering of `views` with `tools`), and the
    template's own text before, between and after them."""
    marked = {i: n for n, i in enumerate(which)}
    blank = [{**v, "content": _sentinel(marked[i])} if i in marked else v for i, v in enumerate(views)]
    skeleton = tokenizer.render(blank, tools=tools)
    parts = _SENTINEL.split(skeleton)
    pieces, order = parts[0::2], [int(i) for i in parts[1::2]]
    if order != list(range(len(which))):
        raise _unsupported("does not render every message's content once, in order")
    spans: list[Span] = []
    cursor = 0
    for n, i in enumerate(which):
        if not text.startswith(pieces[n], cursor):
            raise _unsupported("renders differently depending on message content")
        cursor += len(pieces[n])
        content = views[i]["content"]
        for form in (content, content.strip(), content.lstrip(), content.rstrip()):
            if text.startswith(form, cursor) and text.startswith(pieces[n + 1], cursor + len(form)):
                spans.append((cursor, cursor + len(form)))
                cursor += len(form)
                break
        else:
            raise _unsupported("changes message content beyond trimming whitespace")
    if text[cursor:] != pieces[-1]:
        raise _unsupported("renders differently depending on message content")
    return tuple(spans), pieces


def encode_rendering(text: str, spans: Sequence[Span], tokenizer: ChatTokenizer) -> tuple[list[int], list[int]]:
    """Token ids of `text` (and each token's first character) with every content span tokenised as text.

    Identical to `tokenizer.encode_with_offsets(text)` unless some content spells a control token;
    then only the tokens covering that content are replaced by its tokenisation as text.
    """
    ids, offsets = tokenizer.encode_with_offsets(text)
    control = tokenizer.control_token_ids
    starts = [start for start, _ in spans]
    forged: set[int] = set()
    for token, offset in zip(ids, offsets, strict=True):
        at = bisect.bisect_right(starts, offset) - 1
        if token in control and at >= 0 and offset < spans[at][1]:
            forged.add(at)
    for at in sorted(forged, reverse=True):  # right to left: earlier offsets stay valid
        start, end = spans[at]
        first = max(bisect.bisect_right(offsets, start) - 1, 0)  # the token holding the content's first character
        last = bisect.bisect_left(offsets, end)  # the first token starting at or after the content's end
        stop = offsets[last] if last < len(offsets) else len(text)
        again, again_offsets = tokenizer.encode_with_offsets(text[offsets[first] : stop], as_text=True)
        ids[first:last] = again
        offsets[first:last] = [offsets[first] + o for o in again_offsets]
    return ids, offsets


@dataclass(frozen=True)
class RenderedHistory:
    """A history rendered once: the token ids and where each message starts among them."""

    messages: tuple[Message, ...]  # validated copies; the source of the verbatim parts of the output
    token_ids: tuple[int, ...]  # the whole history through the chat template, no generation prompt
    message_starts: tuple[int, ...]  # token where message i's turn begins (the template's preamble precedes 0)
    open_starts: frozenset[int] = frozenset()  # starts inside a turn the template merges (consecutive tool results)
    contents: tuple[tuple[int, int], ...] = ()  # tokens [start, end) of message i's content (its text alone)


def _prefix_end(views: Sequence[dict[str, str]], i: int, text: str, tokenizer: ChatTokenizer) -> int:
    """Characters of `text` before message i's turn: the exact, O(i) way."""
    prefix = tokenizer.render(views[:i]) if i else tokenizer.preamble(views[0]["role"])
    if not text.startswith(prefix):
        raise InvalidInput(
            "messages",
            "the model's chat template does not render a history as a prefix of its continuation; "
            "this model cannot be compacted in token space",
        )
    return len(prefix)


def _located_starts(
    views: Sequence[dict[str, str]], text: str, spans: Sequence[Span], tokenizer: ChatTokenizer
) -> list[int] | None:
    """Each message's first character: the preamble's end, then the turn end after each content.

    Linear in the history, where rendering every prefix is quadratic (a 250k-token history took
    48 s). None when the template does not close every turn right after its content.
    """
    starts = [len(tokenizer.preamble(views[0]["role"]))]
    end_of_turn = tokenizer.end_of_turn
    for _, end in spans[:-1]:
        if not text.startswith(end_of_turn, end):
            return None
        starts.append(end + len(end_of_turn))
    return starts


def render_history(
    messages: Sequence[Message], tokenizer: ChatTokenizer, tools: Sequence[Mapping[str, Any]] | None = None
) -> RenderedHistory:
    """Render and tokenise the history once, recording each message's first token.

    A history with tool traffic (or a tool list) is rendered as the agent's own turns are (`_as_agent`), so
    the compaction's prompts start with the tokens the agent's turns left in the prefix cache.
    Otherwise: message text is tokenised as text (`compaction.content`). Tokens before the first message's
    turn (a default system prompt the template inserts) belong to no message. Message borders are
    located in the rendered text and spot-checked against an exact prefix rendering; if the check
    fails, every border is computed the exact way.
    """
    if _as_agents_turns(messages, tokenizer, tools):
        return _as_agent(messages, tokenizer, tools)
    views = [template_view(m) for m in messages]
    text = tokenizer.render(views)
    spans = content_spans(views, text, tokenizer)
    ids, offsets = encode_rendering(text, spans, tokenizer)
    chars = _located_starts(views, text, spans, tokenizer)
    checks = {len(views) // 2, len(views) - 1}
    if chars is None or any(chars[i] != _prefix_end(views, i, text, tokenizer) for i in checks):
        chars = [_prefix_end(views, i, text, tokenizer) for i in range(len(views))]
    return RenderedHistory(tuple(messages), tuple(ids), _tokens_at(chars, offsets), contents=_in_tokens(spans, offsets))


def _as_agents_turns(
    messages: Sequence[Message], tokenizer: ChatTokenizer, tools: Sequence[Mapping[str, Any]] | None
) -> bool:
    """Whether the history is rendered from `chat_view`s (tool traffic the template writes out), not `template_view`s
    (no tool traffic: the two render alike; a template that drops tool calls: they are written as text)."""
    return bool(tools or any(m.tool_calls or m.role == "tool" for m in messages)) and writes_tool_calls(tokenizer)


def rendered_tokens(
    messages: Sequence[Message],
    tokenizer: ChatTokenizer,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> int:
    """Tokens of the history as `render_history` renders it (with the generation prompt: an agent's turn of it)."""
    views = rendered_views(messages, tokenizer, tools)
    listed = tools if _as_agents_turns(messages, tokenizer, tools) else None
    return len(tokenizer.encode(tokenizer.render(views, add_generation_prompt, listed)))


def rendered_views(
    messages: Sequence[Message], tokenizer: ChatTokenizer, tools: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The views `render_history` renders the history from: the agent's (`chat_view`) or `template_view`s."""
    agent = _as_agents_turns(messages, tokenizer, tools)
    return [chat_view(m) if agent else template_view(m) for m in messages]


def _tokens_at(chars: Sequence[int], offsets: Sequence[int]) -> tuple[int, ...]:
    """The first token starting at or after each character position."""
    return tuple(bisect.bisect_left(offsets, char) for char in chars)


def _in_tokens(spans: Sequence[Span], offsets: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Character spans as token spans: from the first token starting at or after each end."""
    return tuple((bisect.bisect_left(offsets, a), bisect.bisect_left(offsets, b)) for a, b in spans)


_CALLED = "\ue000called\ue001"
_WRITES_CALLS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def writes_tool_calls(tokenizer: ChatTokenizer) -> bool:
    """Whether the chat template writes an assistant's tool calls and the tool's result (a template that drops
    them would hide them from the summariser: such histories are rendered as `template_view`s instead)."""
    known = _WRITES_CALLS.get(tokenizer)
    if known is None:
        call = {"id": "c", "type": "function", "function": {"name": _CALLED, "arguments": {}}}
        probe: list[dict[str, Any]] = [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": _MARK},
        ]
        try:
            text = tokenizer.render(probe)
            known = _CALLED in text and _MARK in text
        except Exception:  # a template raises what it likes for what it does not support
            known = False
        _WRITES_CALLS[tokenizer] = known
    return known


def _as_agent(
    messages: Sequence[Message], tokenizer: ChatTokenizer, tools: Sequence[Mapping[str, Any]] | None
) -> RenderedHistory:
    """The history as vLLM's chat endpoint renders an agent's turn of it (`chat_view`s and the tool list through
    the model's template), token for token, so the compaction reads the agent's prefix cache.

    Such templates write tool calls outside any content and may merge consecutive tool results into one turn,
    so borders are found from the template's own text: the contents that are not empty are located with
    sentinels, and in the template text before each (and after the last) the messages it holds take the
    turn ends found there, the last message the last turn end. A message with none left starts where the
    text before it begins, inside an open turn (`open_starts`)."""
    views = rendered_views(messages, tokenizer, tools)
    text = tokenizer.render(views, tools=tools)
    which = [i for i, view in enumerate(views) if view["content"]]
    spans, pieces = located_contents(views, text, tokenizer, which, tools)
    ids, offsets = encode_rendering(text, spans, tokenizer)
    end_of_turn, chars, open_chars = tokenizer.end_of_turn, [], set()
    bounds = [0, *(end for _, end in spans)]
    holders = [*which, len(views) - 1]  # the last message each gap holds (the tail gap: the rest)
    first = 0
    for gap, (start, last) in enumerate(zip(bounds, holders, strict=False)):
        piece, held = pieces[gap], list(range(first, last + 1))
        ends = [start + m.end() for m in re.finditer(re.escape(end_of_turn), piece) if start + m.end() < len(text)]
        taken = ends[-len(held) :] if held else []
        for n, i in enumerate(held):
            at = n - (len(held) - len(taken))
            chars.append(taken[at] if at >= 0 else start)
            if at < 0 and i:
                open_chars.add(start)
        first = last + 1
    starts = _tokens_at(chars, offsets)
    open_starts = frozenset(t for t, c in zip(starts, chars, strict=True) if c in open_chars)
    found = dict(zip(which, spans, strict=True))
    bounds_of = [found.get(i, (c, c)) for i, c in enumerate(chars)]  # an empty content: where its message starts
    return RenderedHistory(tuple(messages), tuple(ids), starts, open_starts, _in_tokens(bounds_of, offsets))
