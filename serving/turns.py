"""Server-side compaction on `POST /v1/chat/completions`: the ingress side of `context_management`.

An agent adds `context_management: [{"type": "compaction", "compact_threshold": N, ...}]` (with the
`openai` client: `extra_body=`) and `x-session-id: S`. Per turn the ingress
  1. validates the entry (422 naming `context_management[0].<field>`),
  2. counts the rendered prompt (reusing the count of what the session sent before) and how far one
     turn of the session grew it lately (the largest of its last RECENT_TURNS turns),
  3. below every threshold (and not about to pass compact_threshold on the next turn): forwards the
     turn unchanged (no coordinator call);
     otherwise asks the coordinator what to do (`serving.background`), on the session's coordinator replica,
  4. forwards `compaction.messages + messages[replaces_through:]` to the model, on the session's replica,
  5. returns the model's answer with a top-level `compaction` object (on the last chunk when streaming).
A request without `context_management` is passed to ray.serve.llm untouched.

The turn and its outcome (`ChatTurn`, `TurnCompaction`) are what the ingress and the coordinator exchange;
the coordinator's side of a turn is `serving.background`.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from compaction.bounded import BoundedLRU
from compaction.context_edits import Edit, apply_edits
from compaction.errors import InvalidInput, PromptTooLong
from compaction.history import Message, chat_view, parse_messages, template_view
from compaction.partition import PlanLimits
from compaction.render import rendered_views, token_floor
from compaction.tokenizer import ChatTokenizer
from compaction.turn_policy import (
    ContextManagement,
    check_window,
    parse_context_management,
    wants_background,
)
from serving.coordinator import ServiceStats
from serving.tenants import ANONYMOUS, DEFAULT_TENANT, Tenant
from serving.wire.tools import engine_tools

Status = Literal["applied", "running", "none"]
Wire = Literal["chat", "responses", "messages"]
WIRE_FIELD = "session"  # the field a wire mismatch names; the ingress says where its session id came from
FIELD = "context_management"
DEFAULT_REPLY_TOKENS = 256  # reply budget assumed when the request sets none (window check only)
RECENT_TURNS = 4  # a session's next turn may grow its prompt as much as the largest of its last few
RECORD_BYTES = 256  # one session's record in one of PromptCounter's tables, beside its session id
DEFAULT_COUNTER_BYTES = 16 * 2**20  # PromptCounter's three tables together, per model and ingress replica


class ChatTurn(BaseModel):
    """One chat turn with context management, as the ingress hands it to the coordinator."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str
    messages: list[Message] = Field(description="The request's messages, validated.")
    entry: ContextManagement = Field(description="The request's compaction entry.")
    session_id: str | None = Field(description="x-session-id; background compaction needs one.")
    prompt_tokens: int = Field(description="Tokens of the request's rendered prompt, counted by the ingress.")
    tools: list[dict[str, Any]] | None = Field(
        None, description="Its tool list as the engine renders it (serving.wire.tools): compactions render it too."
    )
    growth: int = Field(0, description="The most one turn of this session grew its prompt lately (tokens).")
    idle_s: float | None = Field(
        None, description="The session's mean time from a reply to its next turn lately (s); None: not measured."
    )
    room: int = Field(description="The most prompt tokens the model window takes beside the reply budget.")
    wire: Wire = Field("chat", description="The API format of the turn; a session keeps the format it began with.")
    tenant: str = Field(DEFAULT_TENANT, description="Whose turn: sessions and their runs are per tenant.")
    cache_salt: str | None = Field(None, description="The tenant's prefix-cache salt on the engines (None: unsalted).")
    force: bool = Field(
        False, description="The client asked for a compaction now (Codex's compaction_trigger), thresholds aside."
    )


class TurnCompaction(BaseModel):
    """The `compaction` object of a chat response."""

    model_config = ConfigDict(frozen=True)
    status: Status = Field(
        description="applied: the turn was answered from messages + request.messages[replaces_through:]; "
        "running: a background compaction of this session is under way (or done, waiting for the threshold); "
        "none: the prompt was answered as sent."
    )
    messages: list[Message] | None = Field(
        None, description="applied: the compacted head (kept system messages, carried and new summary)."
    )
    replaces_through: int | None = Field(
        None, description="applied: the client continues from messages + history[replaces_through:]."
    )
    stall_s: float = Field(0.0, description="How long this turn waited for compaction.")
    prompt_tokens: int = Field(description="Tokens of the prompt as sent.")
    compacted_prompt_tokens: int | None = Field(None, description="applied: tokens of the prompt answered.")
    source: Literal["background", "blocking"] | None = Field(None, description="applied: which compaction.")
    note: str | None = Field(None, description="Why a compaction was not applied or fell back, when it matters.")
    stats: ServiceStats | None = Field(None, description="applied: the compaction's stats (the last one if two).")
    reply_for: int | None = Field(
        None,
        exclude=True,
        description="The service's own, not part of the response: this turn started a rolling session's last run "
        "before the threshold, of this many messages, which takes the reply too once it is sent (serving.background).",
    )


class PromptCounter:
    """Tokens of a chat request's rendered prompt, reusing the count of the part a session already sent.

    An agent's rendered history only grows at its end, and a tokenizer splits text at special tokens
    before anything else, so the tokens of the text up to the last special token of the previous
    turn are a fixed count: only what follows is tokenised again (an 8k-token history costs ~30 ms
    to tokenise whole on a CPU core, about what a whole SmolLM2 decode step costs). The tool list a
    request sends (thousands of tokens for a coding agent's tools) is in the first turn, so it too is counted
    once per session.
    """

    def __init__(
        self,
        tokenizer: TurnTokenizer,
        specials: Sequence[str],
        max_sessions: int = 8192,
        max_bytes: int = DEFAULT_COUNTER_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.specials = tuple(s for s in specials if s)
        # Three tables of per-session records, sharing max_bytes (RECORD_BYTES + the session id per record).
        share = max_bytes // 3
        size = lambda session, record: len(session) + RECORD_BYTES  # noqa: E731
        # session -> (chars, digest, tokens) of the text up to its last special token
        self._known: BoundedLRU[str, tuple[int, str, int]] = BoundedLRU(max_sessions, share, size)
        # session -> (tokens of the prompt last answered, growth of its last RECENT_TURNS turns)
        self._answered: BoundedLRU[str, tuple[int, tuple[int, ...]]] = BoundedLRU(max_sessions, share, size)
        # session -> (when its last reply finished, its last RECENT_TURNS gaps from a reply to the next turn)
        self._replied: BoundedLRU[str, tuple[float | None, tuple[float, ...]]] = BoundedLRU(max_sessions, share, size)

    def count(self, messages: Sequence[Message], session: str | None, tools: list[dict[str, Any]] | None = None) -> int:
        """`compaction.turn_policy.prompt_tokens` of `messages` and `tools` (in the engine's form,
        `serving.wire.tools`), reusing what this session's last turn counted."""
        views = rendered_views(messages, self.tokenizer, tools)
        history = self.tokenizer.render(views, tools=tools)
        full = self.tokenizer.render(views, add_generation_prompt=True, tools=tools)
        if not full.startswith(history):
            return len(self.tokenizer.encode(full))
        cut = max((history.rfind(s) + len(s) for s in self.specials if s in history), default=0)
        done, head = 0, 0
        known = self._known.peek(session) if session else None
        if known is not None and known[0] <= cut and _digest(history[: known[0]]) == known[1]:
            done, head = known[0], known[2]
        head += len(self.tokenizer.encode(history[done:cut])) if cut > done else 0
        if session:
            self._known.put(session, (cut, _digest(history[:cut]), head))
        return head + len(self.tokenizer.encode(full[cut:]))

    def growth(self, session: str | None, tokens: int) -> int:
        """How far one turn of this session may grow its prompt: the largest growth of its last few turns,
        this one's (since the prompt last answered) included; 0 for a session not seen before."""
        last, recent = (self._answered.peek(session) if session else None) or (None, ())
        return max(tokens - last if last is not None else 0, *recent, 0)

    def answered(self, session: str | None, sent: int, answered: int) -> None:
        """Record a turn: the prompt it sent and the prompt the model answered (smaller if compacted)."""
        if session:
            last, recent = self._answered.peek(session) or (None, ())
            if last is not None:
                recent = (*recent, max(sent - last, 0))[-RECENT_TURNS:]
            self._answered.put(session, (answered, recent))

    def arrived(self, session: str | None) -> float | None:
        """A turn of the session arrives: its mean gap from a reply to the next turn lately (None: not seen)."""
        if not session:
            return None
        finished, gaps = self._replied.peek(session) or (None, ())
        if finished is not None:
            gaps = (*gaps, max(time.monotonic() - finished, 0.0))[-RECENT_TURNS:]
            self._replied.put(session, (None, gaps))
        return sum(gaps) / len(gaps) if gaps else None

    def replied(self, session: str | None) -> None:
        """The session's reply has been sent (its last byte, when streamed): the agent is in its tools now."""
        if session:
            gaps = (self._replied.peek(session) or (None, ()))[1]
            self._replied.put(session, (time.monotonic(), gaps))


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class PromptRenderer(Protocol):
    """The exact prompt length of a chat completion (compaction.tokenizer.HFChatTokenizer)."""

    def chat_prompt_tokens(self, views: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> int: ...

    def encode(self, text: str) -> list[int]: ...


class TurnTokenizer(ChatTokenizer, PromptRenderer, Protocol):
    """What the chat-turn path needs of a model's tokenizer: the core's, and the chat endpoint's prompt length."""


def _views(raw: Any) -> list[dict[str, Any]] | None:
    """The chat views of a body's messages; None when they are not chat messages this service reads."""
    try:
        return [chat_view(m) for m in parse_messages(raw if isinstance(raw, list) else [])]
    except InvalidInput:
        return None


def fit(
    forward: dict[str, Any], tokenizer: TurnTokenizer, window: int, default_reply: int | None = None
) -> dict[str, Any]:
    """The chat request within the model window: PromptTooLong when its prompt passes it (worded as agents
    read it to compact), a reply budget (max_tokens) past the room left cut to that room, and `default_reply`
    the budget of a request that sets none. A body whose messages this service cannot read goes as it is: the
    engine answers it."""
    views = _views(forward.get("messages"))
    if views is None:
        return forward
    floor = token_floor(views, tokenizer)  # no seconds spent counting a prompt that cannot fit
    if floor >= window:
        raise PromptTooLong(floor, window)
    tokens = tokenizer.chat_prompt_tokens(views, engine_tools(forward.get("tools")))
    if tokens >= window:
        raise PromptTooLong(tokens, window)
    room = window - tokens
    budgets = ("max_tokens", "max_completion_tokens")
    if default_reply is not None and not any(isinstance(forward.get(k), int) for k in budgets):
        forward = {**forward, "max_tokens": default_reply}
    return {**forward, **{k: room for k in budgets if isinstance(forward.get(k), int) and forward[k] > room}}


def edited(
    body: dict[str, Any], edits: Sequence[Edit], thinking: tuple[int, str], tokenizer: PromptRenderer
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat body after Anthropic's context edits (compaction.context_edits), and the edits applied."""
    if not edits:
        return body, []

    def count(messages: list[dict[str, Any]]) -> int:
        views = _views(messages)
        return tokenizer.chat_prompt_tokens(views, listed) if views is not None else 0

    listed = engine_tools(body.get("tools"))
    turns, text = thinking
    dropped = (turns, len(tokenizer.encode(text)) if text else 0)
    messages, applied = apply_edits(list(body.get("messages") or []), edits, count, dropped)
    return {**body, "messages": messages}, applied


def window_entry(window: int) -> ContextManagement:
    """The compaction entry of a client that asks for a compaction without one (Codex's compaction_trigger): the
    defaults for this window; the turn before the trigger was answered already, so it is compacted too."""
    threshold = max(256, window - DEFAULT_REPLY_TOKENS)
    return ContextManagement(type="compaction", compact_threshold=threshold, keep_current_turn=False)


def reply_budget(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_REPLY_TOKENS


def needs_coordinator(
    tokens: int, entry: ContextManagement, session: str | None, growth: int = 0, force: bool = False
) -> bool:
    """False when no decision can come of asking: below the hard threshold and not wanting a background run.
    (Whether the agent leaves idle time for one is the coordinator's call: a run may be under way already.)"""
    if force or tokens > entry.compact_threshold:
        return True
    return session is not None and wants_background(tokens, growth, entry)


CoordinatorCall = Callable[[ChatTurn], Awaitable[TurnCompaction]]


def check_fits(messages: Sequence[Message], tokenizer: ChatTokenizer, limits: PlanLimits) -> None:
    """OverLimit when the messages render to more than the model's max_history_tokens, known from their floor
    (compaction.render.token_floor) without the seconds that rendering a huge history takes."""
    limits.check_history(token_floor([template_view(m) for m in messages], tokenizer), at_least=True)


def counted(
    raw: list[Any], tools: Any, counter: PromptCounter, session: str | None, limits: PlanLimits | None = None
) -> tuple[list[Message], list[dict[str, Any]] | None, int]:
    """The turn's messages, its tool list in the engine's form and its prompt's tokens (tools included).
    `limits`: the model's caps, when the turn may be compacted: a history that cannot fit them is refused before
    counting."""
    messages = parse_messages(raw)
    if limits is not None:
        check_fits(messages, counter.tokenizer, limits)
    listed = engine_tools(tools)
    return messages, listed, counter.count(messages, session, listed)


async def prepare_turn(
    body: dict[str, Any],
    session: str | None,
    counter: PromptCounter,
    window: int,
    ask: CoordinatorCall,
    wire: Wire = "chat",
    tenant: Tenant = ANONYMOUS,
    force: bool = False,
    limits: PlanLimits | None = None,
) -> tuple[dict[str, Any], TurnCompaction | None]:
    """The request to forward to the model (context_management removed, maybe compacted) and the outcome.
    `wire`: the API format the turn arrived in (a translated Responses or Messages request is a chat body);
    `tenant`: who sent it (`counter` is that tenant's); `force`: compact now whatever the thresholds say (with
    the request's entry, else one for this window); `limits`: the model's caps on what a compaction takes."""
    entry = parse_context_management(body.get(FIELD))
    forward = {k: v for k, v in body.items() if k != FIELD}
    if entry is None and force:
        entry = window_entry(window)
    if entry is None:
        return forward, None
    reply = reply_budget(body)
    check_window(entry, window, reply)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("messages", "send a non-empty list of chat messages")
    # Parsing and counting a long history takes a while: off the event loop, which other requests share.
    messages, tools, tokens = await asyncio.to_thread(counted, raw, body.get("tools"), counter, session, limits)
    growth = counter.growth(session, tokens)
    idle = counter.arrived(session)
    if not needs_coordinator(tokens, entry, session, growth, force):
        counter.answered(session, tokens, tokens)
        return forward, TurnCompaction(status="none", prompt_tokens=tokens)
    turn = ChatTurn(
        model=str(body.get("model")),
        messages=messages,
        entry=entry,
        session_id=session,
        prompt_tokens=tokens,
        tools=tools,
        growth=growth,
        idle_s=idle,
        room=window - reply,
        wire=wire,
        tenant=tenant.id,
        cache_salt=tenant.cache_salt,
        force=force,
    )
    outcome = await ask(turn)
    counter.answered(session, tokens, outcome.compacted_prompt_tokens or tokens)
    if outcome.status == "applied" and outcome.messages is not None and outcome.replaces_through is not None:
        head = [m.model_dump(mode="json", exclude_none=True) for m in outcome.messages]
        forward["messages"] = head + raw[outcome.replaces_through :]
    return forward, outcome
